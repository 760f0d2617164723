# SPDX-License-Identifier: Apache-2.0
"""What running a CFG step's two forwards concurrently, each on its own CUDA
stream, saves: the 60-block train_parity DiT of benchmark/speed.py (1024x1024,
batch 1, CFG as two forwards, LoRA r64), replayed from CUDA graphs.

Two graphs replayed at once must not share memory: each is captured into its
own graph pool, from its own capture stream (cuBLAS keeps a workspace per
stream, and a captured GEMM writes the workspace of the stream it was
captured on), with its own side stream for the text stream. The variants'
timed rounds are interleaved; every timed step's output of the concurrent
variant is compared bitwise with the sequential one at the same step. The
control replays both graphs at once from one pool and one capture stream,
where they may overwrite each other's memory.

    python3 benchmark/probe_cfg_streams.py --out $OUT/cfg_streams.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import gpu_common, speed  # noqa: E402


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/cfg_streams")
    model, step_fn, device = speed.build_probe_dit(args)
    import torch

    from sglang.multimodal_gen.runtime.utils import side_stream, train_parity_graphs

    graphs = model.__dict__.get("forward")

    streams_for: dict = {}

    def stream_for(role: str):
        """One stream per (role, current stream): the capture and side streams
        of a graph captured under a branch stream are that branch's own."""
        key = (role, torch.cuda.current_stream().cuda_stream)
        if key not in streams_for:
            streams_for[key] = torch.cuda.Stream()
        return streams_for[key]

    original_capture = train_parity_graphs.ExactShapeGraphs._capture
    original_graph = torch.cuda.graph

    def capture_in_own_pool(self, leaves, spec):
        self.pool = None
        return original_capture(self, leaves, spec)

    def graph_on_branch_stream(cuda_graph, pool=None, **kwargs):
        return original_graph(cuda_graph, pool=pool, stream=stream_for("capture"), **kwargs)

    concurrent_patches = {
        (train_parity_graphs.ExactShapeGraphs, "_capture"): capture_in_own_pool,
        (torch.cuda, "graph"): graph_on_branch_stream,
        (side_stream, "_side_stream"): lambda device: stream_for("side"),
    }
    branch_streams = (torch.cuda.Stream(), torch.cuda.Stream()) if device == "cuda" else None
    variants = {
        "sequential": ({}, step_fn()),
        "concurrent CFG branches": (
            concurrent_patches,
            step_fn(branch_streams=branch_streams),
        ),
        # control: both graphs in one pool, captured from one stream
        "concurrent, one pool and one capture stream (control)": (
            {},
            step_fn(branch_streams=branch_streams),
        ),
    }
    originals = {key: getattr(*key) for patches, _ in variants.values() for key in patches}
    result = {"script": "benchmark/probe_cfg_streams.py", "argv": sys.argv[1:]}
    result["graphs"] = graphs is not None
    times = {name: [] for name in variants}
    outputs = {name: {} for name in variants}
    for round_ in range(args.rounds):
        for name, (patches, step) in variants.items():
            for key, value in originals.items():
                setattr(*key, patches.get(key, value))
            if graphs is not None:
                graphs.state = None  # as after an update: the next call drops every graph
            for i in range(3):  # first sight eager, second capture: then replays
                step(i)
            times[name].append(speed.time_steps(step, 0, args.steps, device))
            if round_ == 0:
                for i in range(args.steps):
                    outputs[name][i] = step(i).detach().cpu()
    for key, value in originals.items():
        setattr(*key, value)
    sequential = outputs["sequential"]
    result["variants"] = {
        name: {
            "step_ms_median": round(statistics.median(sum(runs, [])), 2),
            "round_medians_ms": [round(statistics.median(r), 2) for r in runs],
            "steps_equal_to_sequential": sum(
                bool(torch.equal(out, sequential[i])) for i, out in outputs[name].items()
            ),
            "steps_compared": len(outputs[name]),
        }
        for name, runs in times.items()
    }
    result["versions"] = gpu_common.versions()
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["variants"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
