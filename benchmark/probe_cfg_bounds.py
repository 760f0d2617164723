# SPDX-License-Identifier: Apache-2.0
"""Bounds on what the work left above the contract floor costs while a CFG
step's two forwards run at once: the 60-block train_parity DiT of
benchmark/speed.py (1024x1024, batch 1, CFG as two forwards, LoRA r64),
replayed from CUDA graphs, its branches at once (``run_cfg_branches``), timed

* as the runtime runs it,
* with each block's modulations computed once and reused by every later call
  (no modulation GEMVs: sharing them between the two branches would save about
  half of that),
* with the MLP up-projection's LoRA-B + GELU kernel left out (its base GEMM's
  output taken as it is: what a GELU epilogue as fast as cuBLAS's GEMM alone
  would leave),
* with the joint attention's V ``torch.cat`` left out (an uninitialised joint
  buffer: what writing V straight into it would leave),
* with all three left out.

A bound computes wrong outputs (the modulations are right only at the first
timestep), so only times are compared; the rounds are interleaved
(``speed.interleaved_variants``). Run 42 (results.md) also timed the
LoRA-B + GELU kernel at other tiles with this probe as of cdd8b61.

    python3 benchmark/probe_cfg_bounds.py --out $OUT/cfg_bounds.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import speed  # noqa: E402


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/cfg_bounds")
    model, step, device = speed.build_probe_dit(args)
    import torch

    from sglang.multimodal_gen.runtime.layers import train_parity_kernels
    from sglang.multimodal_gen.runtime.models.dits import qwen_image

    block_cls = qwen_image.QwenImageTransformerBlock
    original_modulation = block_cls._get_modulation_params
    original_add_lora_up = train_parity_kernels.add_lora_up
    original_cat = torch.cat

    def modulations_once(block, *args):
        if "_probe_modulation" not in block.__dict__:
            block._probe_modulation = original_modulation(block, *args)
        return block._probe_modulation

    def no_gelu_kernel(out, down, lora_B, scaling, gelu_tanh=False):
        if gelu_tanh:
            return out
        return original_add_lora_up(out, down, lora_B, scaling)

    def no_v_cat(tensors, dim=0, **kwargs):
        # the joint V: [batch, text + image tokens, heads, head_dim]
        if dim == 1 and len(tensors) == 2 and tensors[0].dim() == 4 and not kwargs:
            txt, img = tensors
            shape = (txt.shape[0], txt.shape[1] + img.shape[1], *txt.shape[2:])
            return img.new_empty(shape)
        return original_cat(tensors, dim=dim, **kwargs)

    bounds = {
        "modulations computed once": {
            (block_cls, "_get_modulation_params"): modulations_once
        },
        "no LoRA-B + GELU kernel": {
            (train_parity_kernels, "add_lora_up"): no_gelu_kernel
        },
        "no V torch.cat": {(torch, "cat"): no_v_cat},
    }
    variants = {
        "as the runtime runs it": {},
        **bounds,
        "all three": {k: v for patches in bounds.values() for k, v in patches.items()},
    }

    def reset():
        for block in model.transformer_blocks:
            block.__dict__.pop("_probe_modulation", None)

    runs = speed.interleaved_variants(step, model, device, variants, args, reset=reset)
    speed.write_probe_result(args, "benchmark/probe_cfg_bounds.py", runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
