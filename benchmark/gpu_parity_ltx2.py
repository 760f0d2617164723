"""LTX-2 train_parity on the GPU at real widths: the fork's DiT (sglang's real loader, LoRA through
the weight updater's per-layer step) against ltx-core's LTXModel + PEFT LoRA under real CUDA bf16
autocast with SDPA's math kernel (miles' trainer), each stream alone, every paired module compared
as it is produced.

    python benchmark/gpu_parity_ltx2.py --out ltx2.json [--layers 2] [--budget-s 300]

Model: random weights at LTX-2 (19B)'s widths (video 32 heads x 128, FFN 16384, audio 32 x 64,
caption 3840 projected in the DiT, split RoPE with a float64 grid), `--layers` blocks, saved as
diffusers fp32 masters and loaded into ltx-core by name. Clips: 121 frames at 512x768 (16 x 16 x 24
= 6144 video tokens, 126 audio tokens) batch 1 and 2, and 33 frames at 480x704 (5 x 15 x 22);
1024 text tokens (the connectors' output length). LoRA r64 (alpha 128) on miles' targets in every
block. Controls (must differ): SDPA with torch's own kernel choice instead of math, and the other
autocast rule for rms_norm (fp32 from torch 2.12 on).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmark import gpu_common  # noqa: E402
from benchmark.parity_compare import (  # noqa: E402
    compare_case,
    fused_kernels_ran,
    other_rms_norm_rule,
)

LORA_RANK, LORA_ALPHA = 64, 128
LTX2_19B = dict(
    in_channels=128,
    out_channels=128,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    caption_channels=3840,
    rope_type="split",
    rope_double_precision=True,
    use_prompt_embeddings=True,
)
TEXT_TOKENS = 1024
# (frames, height, width in pixels, batch, timestep)
CASES = (
    (121, 512, 768, 1, 999.0),
    (121, 512, 768, 2, 437.5),
    (33, 480, 704, 1, 702.3),
)


def write_masters(root: Path, config: dict, seed: int) -> Path:
    """diffusers' LTX-2 DiT with random weights at real scale, saved as fp32 masters."""
    from diffusers import LTX2VideoTransformer3DModel
    from sglang_train_parity.ltx2 import write_dit_model_index

    model = LTX2VideoTransformer3DModel(**config)
    gpu_common.randomize_(model, seed, "cpu")
    model.save_pretrained(root / "transformer")
    write_dit_model_index(root)
    return root


@contextlib.contextmanager
def torch_sdpa_kernel_choice():
    from sglang.multimodal_gen.runtime.layers import train_parity_ops

    original = train_parity_ops.math_attention
    train_parity_ops.math_attention = train_parity_ops.attention
    try:
        yield
    finally:
        train_parity_ops.math_attention = original


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_parity_ltx2"))
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny widths")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = "cpu" if args.tiny else "cuda"
    gpu_common.setup(device)

    import torch
    from diffusers import LTX2VideoTransformer3DModel
    from sglang_train_parity import ltx2
    from sglang_train_parity.reference import random_lora_state
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    config = dict(LTX2_19B, num_layers=args.layers)
    cases = CASES
    if args.tiny:
        config.update(ltx2.TINY_DIT_CONFIG, num_layers=args.layers)
        cases = ((9, 64, 96, 1, 999.0), (17, 64, 64, 2, 437.5))
    # sglang resolves the LTX-2 pipeline from the folder name
    root = write_masters(args.workdir / "LTX-2", config, 0)
    model = gpu_common.load_fork_dit(root, model_id=ltx2.MODEL_ID, numerics="train_parity")[0]
    masters = LTX2VideoTransformer3DModel.from_pretrained(
        root / "transformer", torch_dtype=torch.float32
    )
    state = random_lora_state(masters, LORA_RANK, LORA_ALPHA, 0, ltx2.LORA_TARGETS)
    wrap_linears_for_lora(model, "train_parity")
    push_lora(model, state, LORA_RANK, LORA_ALPHA)
    reference = ltx2.build_reference(masters, state, LORA_RANK, LORA_ALPHA, device)
    del state, masters
    result = {
        "script": "benchmark/gpu_parity_ltx2.py",
        "argv": sys.argv[1:],
        "versions": gpu_common.versions(),
        "config": config,
        "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": ltx2.LORA_TARGETS},
        "cases": [],
    }
    controls = {
        "torch's SDPA kernel choice": torch_sdpa_kernel_choice,
        "the other rms_norm autocast rule": other_rms_norm_rule,
    }
    ok = True
    for frames, height, width, batch, timestep in cases:
        case = dict(clip=f"{frames}x{height}x{width}", batch=batch, timestep=timestep)
        if time.monotonic() > deadline:
            result["cases"].append({"case": case, "skipped": "time budget"})
            continue
        inputs = ltx2.LTX2DiTInputs.random(
            batch,
            ltx2.latent_grid(frames, height, width),
            ltx2.audio_tokens(frames),
            16 if args.tiny else TEXT_TOKENS,
            config,
            timestep,
            seed=len(result["cases"]),
        )
        summary = compare_case(
            ltx2,
            model,
            reference,
            inputs,
            controls,
            device,
            pair_of=ltx2.sglang_to_ltx_core,
            outputs=("audio",),
        )
        result["cases"].append({"case": case, **summary})
        ok &= bool(summary["root_equal"]) and summary["equal_pairs"] == summary["pairs"]
        ok &= not any(summary[f"control {name}: root_equal"] for name in controls)
        print(
            f"ltx-2 {case}: root_equal={summary['root_equal']} "
            f"pairs {summary['equal_pairs']}/{summary['pairs']} bitwise; controls "
            + ", ".join(
                f"{name} max ulp {summary[f'control {name}: root_max_ulp']}"
                for name in controls
            ),
            flush=True,
        )
    ok &= fused_kernels_ran(result, device, every_kernel=False)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print("passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
