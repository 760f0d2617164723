"""Why a train_parity server's DiT calls replay CUDA graphs or not: with GRAPH_DIAG=<file> set,
demo_site/sitecustomize.py imports this module in every process, which wraps
``ExactShapeGraphs.__call__`` once sglang has imported it and appends one JSON line per DiT call
to that file: autograd, whether the DiT calls the inputs replayable, input tensors off the GPU
or not contiguous, forward hooks, the DiT's parameters and buffers off the GPU (count and the
first modules), the issuing stream, and the graphs held before and after the call. The
graph's own conditions are ``train_parity_graphs.ExactShapeGraphs._key`` and ``_state``; this
only reports them. Run 46 (docs/results.md) found with it why the server replayed none."""

import builtins
import json
import os
import sys

_GRAPHS_MODULE = "sglang.multimodal_gen.runtime.utils.train_parity_graphs"
_import = builtins.__import__


def _wrap(graphs_module) -> None:
    import torch
    import torch.nn.modules.module as nn_module
    from torch.utils._pytree import tree_flatten

    call = graphs_module.ExactShapeGraphs.__call__

    def diagnosed_call(self, *args, **kwargs):
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]
        modules = list(self.dit.named_modules())
        off_gpu = [
            name
            for name, module in modules
            for t in (*module._parameters.values(), *module._buffers.values())
            if t is not None and not t.is_cuda
        ]
        record = {
            "pid": os.getpid(),
            "grad": torch.is_grad_enabled(),
            "replayable": self.dit.train_parity_graph_replayable(kwargs),
            "inputs_off_gpu": [(i, tuple(t.shape)) for i, t in tensors if not t.is_cuda],
            "inputs_not_contiguous": [
                (i, tuple(t.shape)) for i, t in tensors if not t.is_contiguous()
            ],
            "global_hooks": bool(
                nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks
            ),
            "hooked_modules": [
                name for name, m in modules if m._forward_hooks or m._forward_pre_hooks
            ][:5],
            "tensors_off_gpu": (len(off_gpu), off_gpu[:3]),
            "stream": (
                torch.cuda.current_stream().cuda_stream
                if torch.cuda.is_available()
                else None
            ),
            "graphs_before": len(self.graphs),
        }
        out = call(self, *args, **kwargs)
        record["graphs_after"] = len(self.graphs)
        with open(os.environ["GRAPH_DIAG"], "a") as f:
            f.write(json.dumps(record) + "\n")
        return out

    graphs_module.ExactShapeGraphs.__call__ = diagnosed_call


def _import_and_wrap(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    graphs_module = sys.modules.get(_GRAPHS_MODULE)
    # wrapped once the module has finished executing (``install`` is its last definition)
    if graphs_module is not None and hasattr(graphs_module, "install"):
        builtins.__import__ = _import
        _wrap(graphs_module)
    return module


builtins.__import__ = _import_and_wrap
