"""Model-level parity run: the fork's Qwen-Image DiT (loaded through sglang's real loader) against
diffusers + PEFT under CUDA's autocast policy (emulated on CPU), every paired module compared.

    python tests/qwen_parity_run.py MODEL_DIR OUT.json --numerics train_parity [--updates 3]

LoRA goes into the sglang model the way the post-training weight updater puts it there: every
supported Linear wrapped in the DiT's numerics mode, then `set_lora_weights(A, B,
merge_weights=<from --lora-merge-mode>, clear_existing=True)` with the trainer's fp32 masters, once
per simulated optimizer step. Writes one JSON record per (update, batch, branch, timestep).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault(
    "TORCH_COMPILE_DISABLE", "1"
)  # upstream compiles forward_native on CPU

import torch  # noqa: E402
from sglang_train_parity.compare import compare_modules  # noqa: E402
from sglang_train_parity.cpu_kernels import register_cpu_kernels  # noqa: E402
from sglang_train_parity.reference import (  # noqa: E402
    QwenDiTInputs,
    build_reference,
    random_lora_state,
    reference_forward,
)
from sglang_train_parity.sglang_dit import (  # noqa: E402
    load_dit,
    push_lora,
    sglang_forward,
    wrap_linears_for_lora,
)

IMG_H = IMG_W = 8
TXT_LEN = {"cond": 7, "uncond": 5}  # odd lengths, different per branch, as real prompts
TIMESTEPS = (999.0, 500.0)
BATCHES = (1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default="train_parity")
    parser.add_argument(
        "--updates", type=int, default=3, help="LoRA updates (0: no LoRA)"
    )
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--lora-alpha", type=int, default=12
    )  # scale 1.5: not a power of two
    parser.add_argument("--lora-merge-mode", default="dynamic")
    args = parser.parse_args()
    register_cpu_kernels()  # only upstream's default norm path calls them
    model = load_dit(args.model_dir, numerics=args.numerics)
    from diffusers import QwenImageTransformer2DModel

    masters = QwenImageTransformer2DModel.from_pretrained(
        args.model_dir / "transformer", torch_dtype=torch.float32
    )
    joint_dim = masters.config.joint_attention_dim
    lora = args.updates > 0
    if lora:
        wrap_linears_for_lora(model, args.numerics)
    records = []
    for update in range(max(args.updates, 1)):
        state = (
            random_lora_state(masters, args.lora_rank, args.lora_alpha, seed=update)
            if lora
            else None
        )
        reference = build_reference(
            copy.deepcopy(masters), state, args.lora_rank, args.lora_alpha
        )
        if lora:
            push_lora(
                model,
                state,
                args.lora_rank,
                args.lora_alpha,
                args.lora_merge_mode == "merge",
            )
        for batch in BATCHES:
            for branch, txt_len in TXT_LEN.items():
                for timestep in TIMESTEPS:
                    inputs = QwenDiTInputs.random(
                        batch,
                        IMG_H,
                        IMG_W,
                        txt_len,
                        joint_dim,
                        timestep,
                        seed=len(records),
                    )
                    ours = sglang_forward(model, inputs)
                    _, theirs = reference_forward(reference, inputs, "cpu")
                    pairs = compare_modules(ours, theirs, lora)
                    root = next(p for p in pairs if p["sglang"] == "")
                    records.append(
                        {
                            "update": update,
                            "batch": batch,
                            "branch": branch,
                            "timestep": timestep,
                            "root_equal": root["equal"],
                            "root_max_ulp": root["max_ulp"],
                            "pairs": pairs,
                        }
                    )
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
