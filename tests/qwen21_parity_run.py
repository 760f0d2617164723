"""Model-level parity run for Qwen-Image 2.1: a tiny DiT folder loaded through sglang's real loader,
against diffusers + PEFT under CUDA's autocast policy (emulated on CPU), every paired module
compared.

    python tests/qwen21_parity_run.py MODEL_DIR OUT.json [--numerics M] [--updates 3]
        [--rope-tables device|cpu]

LoRA goes in as the post-training weight updater puts it (tests/qwen_parity_run.py). Writes one
JSON record per (update, batch, branch, timestep).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch  # noqa: E402
from sglang_train_parity import qwen_image21  # noqa: E402
from sglang_train_parity.compare import compare_modules  # noqa: E402
from sglang_train_parity.reference import random_lora_state  # noqa: E402
from sglang_train_parity.sglang_dit import (  # noqa: E402
    load_dit,
    push_lora,
    wrap_linears_for_lora,
)

# a non-square latent grid; prompts of each branch, per batch size (batch 2 pads the shorter)
HEIGHT, WIDTH = 4, 6
TEXT_LENGTHS = {1: {"cond": (7,), "uncond": (5,)}, 2: {"cond": (7, 7), "uncond": (5, 3)}}
TIMESTEPS = (999.0, 437.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default="train_parity")
    parser.add_argument("--updates", type=int, default=3, help="LoRA updates (0: none)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=12)  # scale 1.5
    parser.add_argument("--rope-tables", default="device")
    args = parser.parse_args()
    from diffusers import QwenImage21Transformer2DModel

    server_kwargs = {"numerics": args.numerics}
    if args.numerics == "train_parity":
        server_kwargs["train_parity_rope_tables"] = args.rope_tables
    model = load_dit(args.model_dir, qwen_image21.MODEL_ID, **server_kwargs)
    masters = QwenImage21Transformer2DModel.from_pretrained(
        args.model_dir / "transformer", torch_dtype=torch.float32
    )
    lora = args.updates > 0
    if lora:
        wrap_linears_for_lora(model, args.numerics)
    records = []
    for update in range(max(args.updates, 1)):
        state = None
        if lora:
            state = random_lora_state(
                masters, args.lora_rank, args.lora_alpha, update, qwen_image21.LORA_TARGETS
            )
            push_lora(model, state, args.lora_rank, args.lora_alpha)
        reference = qwen_image21.build_reference(
            copy.deepcopy(masters),
            state,
            args.lora_rank,
            args.lora_alpha,
            rope_tables=args.rope_tables,
        )
        for batch, branches in TEXT_LENGTHS.items():
            for branch, lengths in branches.items():
                for timestep in TIMESTEPS:
                    inputs = qwen_image21.QwenImage21DiTInputs.random(
                        lengths,
                        HEIGHT,
                        WIDTH,
                        dict(masters.config),
                        timestep,
                        seed=len(records),
                    )
                    ours = qwen_image21.sglang_forward(model, inputs)
                    _, theirs = qwen_image21.reference_forward(reference, inputs, "cpu")
                    pairs = compare_modules(
                        ours, theirs, lora, qwen_image21.sglang_to_diffusers
                    )
                    root = next(p for p in pairs if p["sglang"] == "")
                    records.append(
                        {
                            "update": update,
                            "batch": batch,
                            "branch": branch,
                            "text_lengths": list(lengths),
                            "timestep": timestep,
                            "root_equal": root["equal"],
                            "root_max_ulp": root["max_ulp"],
                            "pairs": pairs,
                        }
                    )
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
