"""Model-level parity run for LTX-2: a tiny DiT folder loaded through sglang's real loader, against
ltx-core's LTXModel + PEFT under CUDA's autocast policy (emulated on CPU) with SDPA's math kernel,
each stream alone, every paired module compared.

    python tests/ltx2_parity_run.py MODEL_DIR OUT.json [--numerics M] [--updates 3]

LoRA goes in as the post-training weight updater puts it (tests/qwen_parity_run.py). Writes one
JSON record per (update, case).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from pathlib import Path

os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")

import torch  # noqa: E402
from sglang_train_parity import ltx2  # noqa: E402
from sglang_train_parity.compare import compare_modules  # noqa: E402
from sglang_train_parity.reference import random_lora_state  # noqa: E402
from sglang_train_parity.sglang_dit import (  # noqa: E402
    load_dit,
    push_lora,
    wrap_linears_for_lora,
)

# an odd latent grid (frames, height, width), audio tokens, text tokens
GRID, AUDIO_TOKENS, TEXT_TOKENS = (3, 2, 3), 7, 9
# (batch, timestep): 999 and 312.77 round in the trainer's bf16 sigma
CASES = ((1, 999.0), (2, 312.77))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--numerics", default="train_parity")
    parser.add_argument("--updates", type=int, default=3, help="LoRA updates (0: none)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=int, default=16)
    args = parser.parse_args()
    from diffusers import LTX2VideoTransformer3DModel

    model = load_dit(args.model_dir, ltx2.MODEL_ID, numerics=args.numerics)
    masters = LTX2VideoTransformer3DModel.from_pretrained(
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
                masters, args.lora_rank, args.lora_alpha, update, ltx2.LORA_TARGETS
            )
            push_lora(model, state, args.lora_rank, args.lora_alpha)
        reference = ltx2.build_reference(
            copy.deepcopy(masters), state, args.lora_rank, args.lora_alpha
        )
        for batch, timestep in CASES:
            inputs = ltx2.LTX2DiTInputs.random(
                batch,
                GRID,
                AUDIO_TOKENS,
                TEXT_TOKENS,
                dict(masters.config),
                timestep,
                seed=len(records),
            )
            ours = ltx2.sglang_forward(model, inputs)
            _, theirs = ltx2.reference_forward(reference, inputs, "cpu")
            pairs = compare_modules(ours, theirs, lora, ltx2.sglang_to_ltx_core)
            outputs = {p["sglang"]: p for p in pairs if p["sglang"] in ("", "audio")}
            records.append(
                {
                    "update": update,
                    "batch": batch,
                    "timestep": timestep,
                    "root_equal": outputs[""]["equal"],
                    "root_max_ulp": outputs[""]["max_ulp"],
                    "audio_equal": outputs["audio"]["equal"],
                    "pairs": pairs,
                }
            )
    args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
