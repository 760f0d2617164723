# SPDX-License-Identifier: Apache-2.0
"""What the base GEMM kernel's schedule and the CFG step's one state read change
while a step's two forwards run at once: the 60-block train_parity DiT of
benchmark/speed.py (1024x1024, batch 1, CFG as two forwards, LoRA r64),
replayed from CUDA graphs, its branches at once on two streams
(``run_cfg_branches``), timed

* as the runtime runs it,
* with the DiT's state read before each branch (as before the branches after
  the first took its read),
* with the image stream's LoRA'd linears on cuBLAS's GEMM and the LoRA-B
  kernel (the base GEMM kernel off),
* with the base GEMM kernel launched as one program per tile instead of one
  persistent program per SM, or persistent on half the SMs (each of the two
  branches' kernels then leaves the other half free),
* with other tiles: not warp-specialized, and 128x128.

The variants' timed rounds are interleaved (``speed.interleaved_variants``);
every step output is checked bitwise against the runtime's at the same step.
A kernel schedule changes which program computes a tile, not the order in
which a tile sums its K blocks.

    python3 benchmark/probe_cfg_at_once.py --out $OUT/cfg_at_once.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import speed  # noqa: E402


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/cfg_at_once")
    model, step, device = speed.build_probe_dit(args)
    from sglang.kernels.ops.diffusion.gemm import linear_lora_triton
    from sglang.multimodal_gen.runtime.layers import train_parity_kernels
    from sglang.multimodal_gen.runtime.utils import train_parity_graphs

    tiles = linear_lora_triton._tiles

    def large_tiles(choice):
        return lambda n_rows: choice if n_rows >= 1024 else tiles(n_rows)

    variants = {
        "as the runtime runs it": {},
        "state read before each branch": {
            (train_parity_graphs.ExactShapeGraphs, "_state"): lambda self: (
                self.tree_state.read()
            )
        },
        "base GEMM kernel off": {
            (train_parity_kernels, "_LINEAR_LORA_MIN_ROWS"): 1 << 62
        },
        "base GEMM kernel, a program per tile": {
            (linear_lora_triton, "_num_sms"): lambda device: 1 << 20
        },
        "base GEMM kernel, persistent on half the SMs": {
            (linear_lora_triton, "_num_sms"): lambda device: 66
        },
        "base GEMM kernel, not warp-specialized": {
            (linear_lora_triton, "_tiles"): large_tiles(
                (128, 256, 64, 8, 3, 8, 2, False)
            )
        },
        "base GEMM kernel, 128x128 tiles": {
            (linear_lora_triton, "_tiles"): large_tiles(
                (128, 128, 64, 8, 4, 8, 1, True)
            )
        },
    }
    runs = speed.interleaved_variants(step, model, device, variants, args)
    speed.write_probe_result(
        args,
        "benchmark/probe_cfg_at_once.py",
        runs,
        graphs=model.__dict__.get("forward") is not None,
        gates=train_parity_kernels.gate_states(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
