# SPDX-License-Identifier: Apache-2.0
"""What running a CFG step's two forwards at once, each on its own CUDA stream,
saves: the 60-block train_parity DiT of benchmark/speed.py (1024x1024, batch 1,
CFG as two forwards, LoRA r64), replayed from CUDA graphs, its branches run
as the denoising stage runs them (``run_cfg_branches``: each branch stream
replays its own graphs from its own graph pool, captured from its own capture
stream, with its own side stream) and, patched, one after the other.

The control replays both branches' graphs at once from one graph pool, where
they may overwrite each other's memory. The variants' timed rounds are
interleaved; every step output compared is checked bitwise against the
output of the branches in turn at the same step.

    python3 benchmark/probe_cfg_streams.py --out $OUT/cfg_streams.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import speed  # noqa: E402


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/cfg_streams")
    model, step, device = speed.build_probe_dit(args)
    import torch

    from sglang.multimodal_gen.runtime.utils import train_parity_graphs

    graphs = model.__dict__.get("forward")
    original_pool_handle = torch.cuda.graph_pool_handle
    shared_pool: list = []

    def one_pool():
        # a pool whose graphs are all gone cannot take another capture, so one
        # per round (graphs.state = None drops them)
        if not shared_pool:
            shared_pool.append(original_pool_handle())
        return shared_pool[0]

    variants = {
        "branches in turn": {
            (train_parity_graphs, "run_cfg_branches"): lambda dit, branches: [
                branch() for branch in branches
            ]
        },
        "branches at once (as the denoising stage runs them)": {},
        "control: at once from one graph pool": {
            (torch.cuda, "graph_pool_handle"): one_pool
        },
    }
    runs = speed.interleaved_variants(
        step, model, device, variants, args, reset=shared_pool.clear
    )
    speed.write_probe_result(
        args, "benchmark/probe_cfg_streams.py", runs, graphs=graphs is not None
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
