# SPDX-License-Identifier: Apache-2.0
"""How long the GPU waits for the host to launch a replayed DiT forward: the
60-block train_parity DiT of benchmark/speed.py (1024x1024, batch 1, CFG as two
forwards, LoRA r64), its graphs captured by stepping it as the denoising stage
does, then each graph replayed alone, without the profiler:

* host: the ``cudaGraphLaunch`` call's host time (``CUDAGraph.replay``);
* exposed: the replay's device time from an idle GPU, less its device time
  when a sleep kernel keeps the GPU busy while the host launches it: the part
  of the launch the GPU waits for at the start of a waited-for step, plus
  whatever else differs after 30 ms of a sleeping GPU (its clocks, under a
  power cap, after a heavy replay).

The same for graphs of N tiny kernels on one stream (N = 100, 1000, 3000),
for a 100-kernel graph that first sleeps about 5 ms, launched before a
3000-kernel one (whether a short first graph hides the second's launch), and
for 3000 tiny kernels after and before one call of each of the runtime's
LoRA'd linear kernels (whether a kernel in the graph changes how its launch
overlaps the GPU's work; patch 0022's kernel has a 120-byte stack frame).

    python3 benchmark/probe_graph_launch.py --out $OUT/graph_launch.json

``PROBE_SINGLE_STREAM=1`` runs the DiT's text stream on the current stream;
``PROBE_KERNEL_PARAMS=1`` times graphs of 3000 launches of one small kernel
each (``many_kernel_graphs``) instead of the DiT's.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmark import gpu_common, speed  # noqa: E402

REPEATS = 10
SLEEP_CYCLES = 60_000_000  # about 30 ms at 2 GHz: longer than any launch


@triton.jit
def copy_pointers(src, dst, other, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs) + tl.load(other + offs))


@triton.jit
def copy_descriptors(src, dst, other, BLOCK: tl.constexpr):
    tile = src.load([0, 0]) + other.load([0, 0])
    dst.store([0, 0], tile)


def replay_timings(launch) -> dict:
    """Median host ms of ``launch()`` and its device ms from an idle GPU and
    from a busy one (the launch issued behind a sleep kernel)."""
    import torch

    host, idle, busy = [], [], []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        launch()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        idle.append(start.elapsed_time(end))

        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        launch()
        end.record()
        end.synchronize()
        busy.append(start.elapsed_time(end))
    result = {
        "host_launch_ms": statistics.median(host),
        "device_ms_from_idle": statistics.median(idle),
        "device_ms_from_busy": statistics.median(busy),
    }
    result["exposed_ms"] = result["device_ms_from_idle"] - result["device_ms_from_busy"]
    return {k: round(v, 3) for k, v in result.items()}


def tiny_graph(kernels: int, sleep_cycles: int = 0, first=None, last=None):
    import torch

    x = torch.zeros(256, device="cuda")

    def body():
        if sleep_cycles:
            torch.cuda._sleep(sleep_cycles)
        if first is not None:
            first()
        for _ in range(kernels):
            x.add_(1)
        if last is not None:
            last()

    return gpu_common.captured(body)


def gemm_kernels() -> dict:
    """The runtime's LoRA'd-linear kernels, each as a call on small operands."""
    import torch

    from sglang.kernels.ops.diffusion.gemm.linear_lora_gelu_gluon import (
        linear_lora_gelu_bf16,
    )
    from sglang.kernels.ops.diffusion.gemm.linear_lora_triton import linear_lora_bf16

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, weight, bias = randn(256, 3072), randn(1024, 3072), randn(1024)
    down, lora_B = randn(256, 64), randn(1024, 64)
    return {
        name: (lambda fn=fn: fn(x, weight, bias, down, lora_B, 2.0))
        for name, fn in (
            (
                "F.linear (cuBLAS)",
                lambda x, w, b, *_: torch.nn.functional.linear(x, w, b),
            ),
            ("linear_lora_bf16 (patch 0019)", linear_lora_bf16),
            ("linear_lora_gelu_bf16 (patch 0022)", linear_lora_gelu_bf16),
        )
    }


def many_kernel_graphs() -> dict:
    """Graphs of 3000 launches of one small kernel each: aten's add, a Triton
    copy with pointer arguments, the same copy through three TMA descriptors
    (128-byte kernel parameters each) and a cuBLAS GEMM."""
    import torch
    from triton.tools.tensor_descriptor import TensorDescriptor

    a, b, c = (torch.randn(64, 64, device="cuda").bfloat16() for _ in range(3))
    descs = [TensorDescriptor.from_tensor(t, [64, 64]) for t in (a, b, c)]
    calls = {
        "aten add_": lambda: a.add_(1),
        "Triton, pointers": lambda: copy_pointers[(1,)](a, b, c, BLOCK=4096),
        "Triton, 3 TMA descriptors": lambda: copy_descriptors[(1,)](*descs, BLOCK=64),
        "cuBLAS GEMM": lambda: torch.mm(a, b),
    }
    timings = {}
    for name, call in calls.items():
        graph = gpu_common.captured(lambda call=call: [call() for _ in range(3000)])
        timings[f"3000 x {name}"] = replay_timings(graph.replay)
    return timings


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/graph_launch")
    import torch

    result: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers}

    def record(section: str, value: dict) -> None:
        result[section] = value
        print(section, json.dumps(value, indent=1), flush=True)
        args.out.write_text(json.dumps(result, indent=1))

    tiny = {n: replay_timings(tiny_graph(n).replay) for n in (100, 1000, 3000)}
    head, body = tiny_graph(100, SLEEP_CYCLES // 6), tiny_graph(3000)

    def head_then_body():
        head.replay()
        body.replay()

    tiny["100 after a sleep, then 3000"] = replay_timings(head_then_body)
    for name, call in gemm_kernels().items():
        tiny[f"3000, then {name}"] = replay_timings(tiny_graph(3000, last=call).replay)
        tiny[f"{name}, then 3000"] = replay_timings(tiny_graph(3000, first=call).replay)
    record("tiny_graphs", tiny)
    if os.environ.get("PROBE_KERNEL_PARAMS") == "1":
        record("many_kernel_graphs", many_kernel_graphs())
        return 0

    if os.environ.get("PROBE_SINGLE_STREAM") == "1":
        # the text stream on the current stream: a graph without the fork and
        # join of every block
        from sglang.multimodal_gen.runtime.utils import side_stream

        init = side_stream.SideStream.__init__
        side_stream.SideStream.__init__ = lambda self, device, *inputs, overlap=True: (
            init(self, device, *inputs, overlap=False)
        )
        result["single_stream"] = True
    model, step, device = speed.build_probe_dit(args)
    for i in range(4):  # first sight, capture, replays
        step(i)
    torch.cuda.synchronize()
    graphs = model.__dict__["forward"]
    dit_graphs = [g for g in graphs.graphs.values() if g is not None]
    record(
        "dit_graphs",
        {
            f"graph {i}": replay_timings(g.graph.replay)
            for i, g in enumerate(dit_graphs)
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
