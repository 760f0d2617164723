"""Qwen-Image 2.1 train_parity on the GPU at real widths: the fork's DiT (sglang's real loader, LoRA
through the weight updater's per-layer step) against diffusers' QwenImage21Transformer2DModel +
PEFT LoRA under real CUDA bf16 autocast with diffusers' native attention, every paired module
compared as it is produced.

    python benchmark/gpu_parity_qwen21.py --out qwen21.json [--layers 2] [--budget-s 300]

Model: random weights at Qwen-Image 2.1's widths (dim 4096, 32 heads x 128, SwiGLU 12288, text 4096,
64 latent channels), `--layers` blocks. Images 1024x1024 (4096 target tokens) and 512x512; prompts
of 211 and 77 tokens, batch 2 with the shorter one padded. LoRA r64 (alpha 128) on the seven
projections of every block. RoPE tables rebuilt on the GPU on both sides (miles' trainer; the
server's default `--train-parity-rope-tables device`). Controls: the modulation rounded in bf16
as the default path does (must differ); the server's RoPE tables built on the CPU (reported: it
differs only where CPU- and GPU-built tables do). Also reported per case: whether diffusers'
pipeline form of the timestep (`t.to(bf16) / 1000`) rounds like the trainer's (`t / 1000`).
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
from benchmark.parity_compare import compare_case, fused_kernels_ran  # noqa: E402

LORA_RANK, LORA_ALPHA = 64, 128
QWEN_IMAGE_21 = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    eps=1e-6,
    causal_condition=True,
)
# (image side in pixels, text lengths per sample, timestep)
CASES = (
    (1024, (211,), 999.0),
    (1024, (77,), 437.5),
    (1024, (211, 77), 702.3),
    (512, (77,), 999.0),
)


def write_masters(root: Path, config: dict, seed: int) -> Path:
    """diffusers' Qwen-Image 2.1 DiT with random weights at real scale, saved as fp32 masters.
    Built on the CPU: its __init__ builds the RoPE tables and timestep frequencies where it runs."""
    from diffusers import QwenImage21Transformer2DModel

    model = QwenImage21Transformer2DModel(**config)
    gpu_common.randomize_(model, seed, "cpu")
    model.save_pretrained(root / "transformer")
    (root / "model_index.json").write_text(
        '{"_class_name": "QwenImage21Pipeline", "_diffusers_version": "0.42.1", '
        '"transformer": ["diffusers", "QwenImage21Transformer2DModel"]}'
    )
    return root


def inputs_for(config, side, text_lengths, timestep, seed, device):
    from sglang_train_parity.qwen_image21 import QwenImage21DiTInputs

    grid = side // 16
    inputs = QwenImage21DiTInputs.random(text_lengths, grid, grid, config, timestep, seed=seed)
    inputs.latents, inputs.text, inputs.timestep = (
        t.to(device) for t in (inputs.latents, inputs.text, inputs.timestep)
    )
    return inputs


@contextlib.contextmanager
def bf16_modulation():
    """LayerNorm-modulate in bf16, as the default path computes it."""
    import torch.nn.functional as F

    from sglang.multimodal_gen.runtime.layers import train_parity_ops

    original = train_parity_ops.layer_norm_scale_shift

    def modulate(x, shift, scale, eps, weight=None, bias=None):
        out = F.layer_norm(x, x.shape[-1:], weight, bias, eps) * (1 + scale)
        return out if shift is None else out + shift

    train_parity_ops.layer_norm_scale_shift = modulate
    try:
        yield
    finally:
        train_parity_ops.layer_norm_scale_shift = original


def rope_tables_on_cpu(model):
    @contextlib.contextmanager
    def control():
        model.rope_table_device, model._train_parity_rope_tables = "cpu", {}
        try:
            yield
        finally:
            model.rope_table_device, model._train_parity_rope_tables = None, {}

    return control


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_parity_qwen21"))
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--tiny", action="store_true", help="CPU dry run: tiny widths, 64x64")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = "cpu" if args.tiny else "cuda"
    gpu_common.setup(device)

    import torch
    from diffusers import QwenImage21Transformer2DModel
    from sglang_train_parity import qwen_image21
    from sglang_train_parity.reference import random_lora_state
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    config = dict(QWEN_IMAGE_21, num_layers=args.layers)
    cases = CASES
    if args.tiny:
        config.update(attention_head_dim=32, num_attention_heads=2, context_in_dim=48)
        config.update(axes_dims_rope=(8, 12, 12))
        cases = tuple((64, lengths, t) for _, lengths, t in CASES[1:3])
    root = write_masters(args.workdir, config, 0)
    model = gpu_common.load_fork_dit(
        root, model_id=qwen_image21.MODEL_ID, numerics="train_parity"
    )[0]
    masters = QwenImage21Transformer2DModel.from_pretrained(
        root / "transformer", torch_dtype=torch.float32
    )
    state = random_lora_state(masters, LORA_RANK, LORA_ALPHA, 0, qwen_image21.LORA_TARGETS)
    wrap_linears_for_lora(model, "train_parity")
    push_lora(model, state, LORA_RANK, LORA_ALPHA)
    reference = qwen_image21.build_reference(masters, state, LORA_RANK, LORA_ALPHA, device)
    del state
    result = {
        "script": "benchmark/gpu_parity_qwen21.py",
        "argv": sys.argv[1:],
        "versions": gpu_common.versions(),
        "config": config,
        "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": qwen_image21.LORA_TARGETS},
        "cases": [],
    }
    ok = True
    for side, text_lengths, timestep in cases:
        case = dict(image=f"{side}x{side}", text_lengths=text_lengths, timestep=timestep)
        if time.monotonic() > deadline:
            result["cases"].append({"case": case, "skipped": "time budget"})
            continue
        inputs = inputs_for(config, side, text_lengths, timestep, len(result["cases"]), device)
        controls = {
            "bf16 modulation": bf16_modulation,
            "server RoPE tables on the CPU": rope_tables_on_cpu(model),
        }
        summary = compare_case(qwen_image21, model, reference, inputs, controls, device)
        # diffusers' pipeline passes t.to(bf16) / 1000; the trainer (and the fork) t / 1000
        t = torch.tensor(timestep)
        summary["pipeline_timestep_rounds_alike"] = bool(
            (t / 1000).bfloat16() == t.bfloat16() / 1000
        )
        result["cases"].append({"case": case, **summary})
        ok &= bool(summary["root_equal"]) and summary["equal_pairs"] == summary["pairs"]
        ok &= not summary["control bf16 modulation: root_equal"]
        print(
            f"qwen-image-2.1 {case}: root_equal={summary['root_equal']} "
            f"pairs {summary['equal_pairs']}/{summary['pairs']} bitwise; controls "
            + ", ".join(
                f"{name} max ulp {summary[f'control {name}: root_max_ulp']}" for name in controls
            ),
            flush=True,
        )
    ok &= fused_kernels_ran(result, device, every_kernel=False)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print("passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
