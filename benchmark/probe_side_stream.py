# SPDX-License-Identifier: Apache-2.0
"""What the Qwen-Image text stream on a side CUDA stream saves, and how its
kernels and the image stream's share the GPU: the 60-block train_parity DiT of
benchmark/speed.py (1024x1024, batch 1, CFG as two forwards, LoRA r64),
replayed from CUDA graphs, timed

* as the DiT runs it (side stream at normal priority),
* at high priority (as the DiT ran it until run 30),
* with everything on one stream (``SideStream(overlap=False)``),
* with the graph instantiated by the driver with
  ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY`` (each kernel node keeps
  the priority of the stream it was captured from): side stream high, and
  image stream high with the side stream normal,
* with each block's modulations computed once and reused (a bound on what
  taking the modulation GEMVs off the side stream could save; its output
  equals the others' only at the timestep the modulations were computed for,
  the one compared).

The CFG step's two forwards run one after the other (``run_cfg_branches``
patched to run them in turn). The variants' timed rounds are interleaved;
each recaptures its graphs, and each step output is checked bitwise against
the one-stream output. One profiled step per variant gives each stream's
busy time and kernels.

    python3 benchmark/probe_side_stream.py --out $OUT/side_stream.json
"""

from __future__ import annotations

import ctypes
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmark import gpu_common, speed  # noqa: E402

USE_NODE_PRIORITY = 8  # CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
LAUNCH_ATTRIBUTE_PRIORITY = 8  # CU_LAUNCH_ATTRIBUTE_PRIORITY
KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: CUresult {rc}")


def node_priorities(graph_handle: int) -> dict:
    """How many kernel nodes of a captured graph carry each priority."""
    cuda = _driver()
    count = ctypes.c_size_t(0)
    graph = ctypes.c_void_p(graph_handle)
    _check(cuda.cuGraphGetNodes(graph, None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(cuda.cuGraphGetNodes(graph, nodes, ctypes.byref(count)), "cuGraphGetNodes")
    histogram: dict = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        _check(
            cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "type"
        )
        if kind.value != KERNEL_NODE:
            continue
        value = (ctypes.c_int * 16)()
        _check(
            cuda.cuGraphKernelNodeGetAttribute(
                ctypes.c_void_p(node), LAUNCH_ATTRIBUTE_PRIORITY, value
            ),
            "cuGraphKernelNodeGetAttribute",
        )
        histogram[str(value[0])] = histogram.get(str(value[0]), 0) + 1
    return histogram


def node_priority_graph_class(torch, seen: list):
    """A ``torch.cuda.CUDAGraph`` whose replay launches an executable the driver
    instantiated with per-node priorities."""

    class NodePriorityGraph(torch.cuda.CUDAGraph):
        def __new__(cls):
            return super().__new__(cls, keep_graph=True)

        def __init__(self):
            # the binding's __init__ runs with the call's arguments
            torch._C._CUDAGraph.__init__(self, True)

        def replay(self):
            cuda = _driver()
            if getattr(self, "_exec", None) is None:
                handle = self.raw_cuda_graph()
                seen.append(node_priorities(handle))
                self._exec = ctypes.c_void_p()
                _check(
                    cuda.cuGraphInstantiateWithFlags(
                        ctypes.byref(self._exec),
                        ctypes.c_void_p(handle),
                        ctypes.c_ulonglong(USE_NODE_PRIORITY),
                    ),
                    "cuGraphInstantiateWithFlags",
                )
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            _check(cuda.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")

    return NodePriorityGraph


def main() -> int:
    args = speed.probe_args(__doc__.split("\n\n")[0], "/tmp/side_stream")
    model, step, device = speed.build_probe_dit(args)
    import torch

    from sglang.multimodal_gen.runtime.models.dits import qwen_image
    from sglang.multimodal_gen.runtime.utils import side_stream, train_parity_graphs
    from sglang.multimodal_gen.runtime.utils.side_stream import SideStream

    graphs = model.__dict__.get("forward")

    def stream_of(priority, device, stream_id):
        return torch.cuda.Stream(device, priority=priority)

    priorities_seen: dict = {}
    block_cls = qwen_image.QwenImageTransformerBlock
    original_modulation = block_cls._get_modulation_params
    original_graph = torch.cuda.graph

    def modulations_once(block, *args):
        if "_probe_modulation" not in block.__dict__:
            block._probe_modulation = original_modulation(block, *args)
        return block._probe_modulation

    def node_priority(name, capture_priority=None):
        patches = {
            (train_parity_graphs.torch.cuda, "CUDAGraph"): node_priority_graph_class(
                torch, priorities_seen.setdefault(name, [])
            )
        }
        if capture_priority is not None and device == "cuda":
            capture = torch.cuda.Stream(priority=capture_priority)
            patches[(torch.cuda, "graph")] = functools.partial(
                original_graph, stream=capture
            )
        return patches

    high_side = {
        (side_stream, "_side_stream"): functools.cache(functools.partial(stream_of, -1))
    }
    variants = {
        "one stream": {
            (qwen_image, "SideStream"): functools.partial(SideStream, overlap=False)
        },
        "side stream, normal priority (as the DiT runs it)": {},
        "side stream, high priority": high_side,
        "node priority: side high": {
            **node_priority("node priority: side high"),
            **high_side,
        },
        "node priority: image high, side normal": node_priority(
            "node priority: image high, side normal", -1
        ),
        "modulations computed once (bound)": {
            (block_cls, "_get_modulation_params"): modulations_once
        },
    }
    # one CFG branch at a time: the streams of one forward are compared
    for patches in variants.values():
        patches[(train_parity_graphs, "run_cfg_branches")] = lambda dit, branches: [
            branch() for branch in branches
        ]
    if device != "cuda":  # the driver's graph API needs CUDA
        variants = {k: v for k, v in variants.items() if not k.startswith("node")}
    result = {"script": "benchmark/probe_side_stream.py", "argv": sys.argv[1:]}
    result["graphs"] = graphs is not None

    def reset():
        for block in model.transformer_blocks:
            block.__dict__.pop("_probe_modulation", None)

    runs = speed.interleaved_variants(
        step, model, device, variants, args, reset=reset, profile=True
    )
    result["variants"] = {
        name: {
            **speed.variant_summary(run, runs["one stream"]),
            "kernel_node_priorities": priorities_seen.get(name, [])[:2],
            "profile": {
                k: run["profile"].get(k)
                for k in ("profiled_step_wall_ms", "kernel_time_ms", "device_timeline")
            },
        }
        for name, run in runs.items()
    }
    result["versions"] = gpu_common.versions()
    args.out.write_text(json.dumps(result, indent=1))
    print(
        json.dumps(
            {
                name: {k: v for k, v in entry.items() if k != "profile"}
                for name, entry in result["variants"].items()
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
