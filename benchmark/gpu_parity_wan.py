"""Wan train_parity on the GPU at real widths: the fork's Wan DiT (sglang's real loader, LoRA
through the weight updater's per-layer step) against diffusers' WanTransformer3DModel + PEFT LoRA
under real CUDA bf16 autocast with SDPA flash, every paired module compared as it is produced.

    python benchmark/gpu_parity_wan.py --out wan.json [--layers 2] [--budget-s 400]

Models (random weights at real scale, `--layers` blocks): Wan2.1-T2V-14B's widths (dim 5120, 40
heads x 128, FFN 13824, text 4096) and Wan2.2-TI2V-5B's (dim 3072, 24 heads, FFN 14336, 48 latent
channels, per-token timesteps). Clips: 81 frames at 480x832 and 17 frames at 480x832 (VAE stride 8,
or 16 for the 5B). LoRA r64 (alpha 128) on self-/cross-attention and FFN of every block. The
control: the same train_parity DiT with the other autocast rule for rms_norm, which must differ.
"""

from __future__ import annotations

import argparse
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
WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
WAN_5B = dict(WAN_14B, num_attention_heads=24, ffn_dim=14336, in_channels=48, out_channels=48)
# name -> (sglang model id, config, VAE spatial stride, per-token timesteps)
MODELS = {
    "wan2.1-t2v-14b": ("Wan2.1-T2V-14B-Diffusers", WAN_14B, 8, False),
    "wan2.2-ti2v-5b": ("Wan2.2-TI2V-5B-Diffusers", WAN_5B, 16, True),
}
CLIPS = ((81, 480, 832), (17, 480, 832))
# (batch, text tokens before T5's zero padding to 512, timestep)
CASES = ((1, 35, 999.0), (1, 120, 437.5))
SHORT_CLIP_CASES = ((2, 35, 999.0),)


def write_masters(root: Path, config: dict, seed: int, device: str) -> Path:
    """diffusers' Wan DiT with random weights at real scale, saved as fp32 masters."""
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device(device):
        model = WanTransformer3DModel(**config)
    gpu_common.randomize_(model, seed, device)
    model.to("cpu").save_pretrained(root / "transformer")
    (root / "model_index.json").write_text(
        '{"_class_name": "WanPipeline", "_diffusers_version": "0.42.1", '
        '"transformer": ["diffusers", "WanTransformer3DModel"]}'
    )
    return root


def inputs_for(config, clip, stride, per_token, batch, text_len, timestep, seed, device):
    from sglang_train_parity.wan import WanDiTInputs

    frames, height, width = clip
    latent = ((frames - 1) // 4 + 1, height // stride, width // stride)
    inputs = WanDiTInputs.random(
        batch, *latent, 512, config, timestep, per_token=per_token, seed=seed
    )
    inputs.text[:, text_len:] = 0  # T5 embeds, zero-padded to 512 as the pipeline does
    return WanDiTInputs(*(t.to(device) for t in (inputs.latents, inputs.text, inputs.timestep)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/gpu_parity_wan"))
    parser.add_argument("--budget-s", type=float, default=400.0)
    parser.add_argument(
        "--tiny", action="store_true", help="CPU dry run: tiny widths, a 5-frame clip"
    )
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    device = "cpu" if args.tiny else "cuda"
    gpu_common.setup(device)

    import torch
    from diffusers import WanTransformer3DModel
    from sglang_train_parity import wan
    from sglang_train_parity.reference import random_lora_state
    from sglang_train_parity.sglang_dit import push_lora, wrap_linears_for_lora

    from sglang.multimodal_gen.runtime.layers import train_parity_ops

    result = {
        "script": "benchmark/gpu_parity_wan.py",
        "argv": sys.argv[1:],
        "versions": gpu_common.versions(),
        "autocast_rms_norm_in_fp32": train_parity_ops.AUTOCAST_RMS_NORM_IN_FP32,
        "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA, "targets": wan.LORA_TARGETS},
        "models": {},
    }
    ok = True
    for seed, name in enumerate(args.models.split(",")):
        model_id, base_config, stride, per_token = MODELS[name]
        config = dict(base_config, num_layers=args.layers)
        clips = CLIPS
        if args.tiny:
            config.update(num_attention_heads=2, attention_head_dim=24, text_dim=32, ffn_dim=96)
            clips = ((5, 48, 64),)
        root = write_masters(args.workdir / name, config, seed, device)
        model = gpu_common.load_fork_dit(root, model_id=model_id, numerics="train_parity")[0]
        masters = WanTransformer3DModel.from_pretrained(
            root / "transformer", torch_dtype=torch.float32
        )
        state = random_lora_state(masters, LORA_RANK, LORA_ALPHA, seed, wan.LORA_TARGETS)
        wrap_linears_for_lora(model, "train_parity")
        push_lora(model, state, LORA_RANK, LORA_ALPHA)
        reference = wan.build_reference(masters, state, LORA_RANK, LORA_ALPHA, device)
        records = []
        for clip in clips:
            cases = CASES + (SHORT_CLIP_CASES if clip[0] < 81 else ())
            for batch, text_len, timestep in cases:
                case = dict(clip=clip, batch=batch, text_len=text_len, timestep=timestep)
                if time.monotonic() > deadline:
                    records.append({"case": case, "skipped": "time budget"})
                    continue
                inputs = inputs_for(
                    config, clip, stride, per_token, batch, text_len, timestep, len(records), device
                )
                summary = compare_case(
                    wan,
                    model,
                    reference,
                    inputs,
                    {"other rms_norm rule": other_rms_norm_rule},
                    device,
                )
                records.append({"case": case, **summary})
                ok &= bool(summary["root_equal"]) and summary["equal_pairs"] == summary["pairs"]
                ok &= not summary["control other rms_norm rule: root_equal"]
                print(
                    f"{name} {case}: root_equal={summary['root_equal']} "
                    f"pairs {summary['equal_pairs']}/{summary['pairs']} bitwise; control "
                    f"max ulp {summary['control other rms_norm rule: root_max_ulp']}",
                    flush=True,
                )
        result["models"][name] = {"config": config, "cases": records}
        del model, reference, masters
        if device == "cuda":
            torch.cuda.empty_cache()
    ok &= fused_kernels_ran(result, device, every_kernel=False)
    args.out.write_text(__import__("json").dumps(result, indent=1, default=str))
    print("passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
