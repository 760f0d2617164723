"""Model-level parity run for Wan: each expert of a tiny Wan DiT folder, loaded through sglang's
real loader, against diffusers + PEFT under CUDA's autocast policy (emulated on CPU), every paired
module compared.

    python tests/wan_parity_run.py MODEL_DIR OUT.json --model-id ID [--numerics M] [--updates 3]
        [--per-token-timesteps]

LoRA goes in as the post-training weight updater puts it (tests/qwen_parity_run.py), one adapter
per expert, names resolved as the updater resolves a trainer's. Writes one JSON record per
(expert, update, batch, branch, timestep).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch  # noqa: E402
from sglang_train_parity import wan  # noqa: E402
from sglang_train_parity.compare import compare_modules  # noqa: E402
from sglang_train_parity.cpu_kernels import register_cpu_kernels  # noqa: E402
from sglang_train_parity.reference import random_lora_state  # noqa: E402
from sglang_train_parity.sglang_dit import (  # noqa: E402
    load_dit,
    push_lora,
    wrap_linears_for_lora,
)

# an odd number of latent frames and a non-square latent grid (3 x 4 tokens after patching)
FRAMES, HEIGHT, WIDTH = 3, 6, 8
TEXT_LEN = {"cond": 7, "uncond": 5}
# per expert of a two-expert model: timesteps on its side of the boundary (875 for A14B)
TIMESTEPS = {"transformer": (999.0, 900.25), "transformer_2": (874.5, 3.0)}
BATCHES = (1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model-id", required=True)
    parser.add_argument("--numerics", default="train_parity")
    parser.add_argument("--updates", type=int, default=3, help="LoRA updates (0: none)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=12)  # scale 1.5
    parser.add_argument("--per-token-timesteps", action="store_true")
    args = parser.parse_args()
    register_cpu_kernels()  # only upstream's default norm path calls them
    from diffusers import WanTransformer3DModel

    lora = args.updates > 0
    experts = [e for e in wan.EXPERTS if (args.model_dir / e).is_dir()]
    records = []
    for expert_index, expert in enumerate(experts):
        model = load_dit(
            args.model_dir, args.model_id, expert, numerics=args.numerics
        )
        masters = WanTransformer3DModel.from_pretrained(
            args.model_dir / expert, torch_dtype=torch.float32
        )
        if lora:
            wrap_linears_for_lora(model, args.numerics)
        for update in range(max(args.updates, 1)):
            state = None
            if lora:
                seed = 100 * expert_index + update
                state = random_lora_state(
                    masters, args.lora_rank, args.lora_alpha, seed, wan.LORA_TARGETS
                )
                push_lora(model, state, args.lora_rank, args.lora_alpha)
            reference = wan.build_reference(
                copy.deepcopy(masters), state, args.lora_rank, args.lora_alpha
            )
            for batch in BATCHES:
                for branch, text_len in TEXT_LEN.items():
                    for timestep in TIMESTEPS[expert]:
                        inputs = wan.WanDiTInputs.random(
                            batch,
                            FRAMES,
                            HEIGHT,
                            WIDTH,
                            text_len,
                            dict(masters.config),
                            timestep,
                            per_token=args.per_token_timesteps,
                            seed=len(records),
                        )
                        ours = wan.sglang_forward(model, inputs)
                        _, theirs = wan.reference_forward(reference, inputs, "cpu")
                        pairs = compare_modules(
                            ours, theirs, lora, wan.sglang_to_diffusers
                        )
                        root = next(p for p in pairs if p["sglang"] == "")
                        records.append(
                            {
                                "expert": expert,
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
