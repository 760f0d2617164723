# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph replay of the train_parity DiT forward at exact request shapes.

A graph replays the kernels one forward launched, with the same arguments,
so a replay computes the same bits as that forward; it saves the host's
launch work. Nothing is padded to a bucket: every distinct set of input
shapes, strides and non-tensor arguments gets its own graph, captured the
second time it is seen (the first call runs eagerly, which is also where the
fused kernels check themselves against their eager chains).

A graph holds the addresses of the DiT's parameters and buffers and the
Python values its forward branched on or computed with. Before every call
the DiT's state is read again (its module tree, parameter and buffer
storage, each LoRA layer's flags, rank, alpha and strength); when any of it
has changed, as after a weight or adapter update (also one that rescales an
adapter whose factors stay in their storage), every graph is dropped and
captured anew. What the LoRA layers read from the forward context (the
runtime LoRA scale) is part of each call's signature. Calls a graph cannot
replay exactly run eagerly: with autograd on, with module hooks installed,
with tensors (inputs, parameters or buffers) that are not contiguous CUDA
tensors, or with inputs the DiT's ``train_parity_graph_replayable``
refuses; each reason is logged once.

The branches of a CFG step (``run_cfg_branches``) run on streams of their
own, so that their replays overlap on the GPU: each issuing stream has its
own graphs, graph pool and capture stream, and an eager forward on a branch
stream starts after the other branches' work. The branches after one that
replayed take the state it read instead of reading it again: between them
only the step's own code runs, and a replay changes nothing the state holds.

``SGLANG_TRAIN_PARITY_CUDA_GRAPH=0`` turns it off.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import cache, partial
from itertools import chain
from operator import attrgetter, is_not, methodcaller
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from sglang.multimodal_gen.runtime.layers.lora.linear import BaseLayerWithLoRA
from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)

# Graphs kept per DiT; the least recently replayed one goes first.
MAX_GRAPHS = 16

# C-level iteration: the state of a 60-block DiT is thousands of dicts
_not_none = partial(is_not, None)
_lora_state = methodcaller("numerics_state")


def _on_gpu(tensors: list[torch.Tensor]) -> bool:
    return all(map(attrgetter("is_cuda"), tensors))


def _runs_eagerly(reason: str) -> None:
    """None, for a call that runs the eager forward; logs why, once per reason."""
    logger.info_once(
        "train_parity: the DiT forward runs eagerly, without a CUDA graph: %s", reason
    )


class _ModuleTreeState:
    """Reads what a graph of ``root``'s forward depends on besides its inputs,
    in about a millisecond for a 60-block DiT (the step waits for it before
    its first kernel). The tree's modules are listed again only when a
    module's children changed; every call reads each module's hooks,
    parameters and buffers through views of the dicts ``nn.Module`` keeps
    them in, which it never replaces, so a read calls no method per module."""

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self.children: list | None = None

    def _list_modules(self) -> None:
        modules = list(self.root.modules())
        self.children_views = [m._modules.values() for m in modules]
        self.children = self._children()
        self.hook_dicts = [
            d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)
        ]
        self.tensor_views = [
            d.values() for m in modules for d in (m._parameters, m._buffers)
        ]
        self.lora_layers = [m for m in modules if isinstance(m, BaseLayerWithLoRA)]

    def _children(self) -> list:
        # the listed modules' children: from the root down they fix the tree
        # (modules compare by identity)
        return list(chain.from_iterable(self.children_views))

    def read(self) -> tuple | None:
        """The module tree, parameter and buffer storage and each LoRA layer's
        ``numerics_state`` (its flags, rank, alpha and strength); None with a
        hook on any module or a tensor off the GPU."""
        if self.children is None or self._children() != self.children:
            self._list_modules()
        if any(map(len, self.hook_dicts)):
            return _runs_eagerly("a module has forward hooks")
        tensors = list(filter(_not_none, chain.from_iterable(self.tensor_views)))
        if not _on_gpu(tensors):
            return _runs_eagerly("a parameter or buffer is not on the GPU")
        return (
            self.children,
            tuple(map(torch.Tensor.data_ptr, tensors)),
            tuple(map(_lora_state, self.lora_layers)),
        )


class _Graph:
    def __init__(self, forward, leaves: list, spec, pool, capture_stream) -> None:
        self.inputs = [
            leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        ]
        args, kwargs = tree_unflatten(self.inputs, spec)
        # a first run on a side stream, as capture requires (lazy initialisation)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=capture_stream):
            self.output = forward(*args, **kwargs)

    def replay(self, leaves: list) -> Any:
        for static, leaf in zip(self.inputs, leaves):
            if isinstance(leaf, torch.Tensor):
                static.copy_(leaf)
        self.graph.replay()
        return tree_map(
            lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.output
        )


class ExactShapeGraphs:
    """Replaces ``dit.forward``: replays a CUDA graph per exact call signature."""

    def __init__(self, dit: nn.Module) -> None:
        self.dit = dit
        self.eager_forward = dit.forward
        # callers that pick their kwargs by the forward's signature see the DiT's
        self.__wrapped__ = self.eager_forward
        # None: capture failed for this key, which then runs eagerly
        self.graphs: OrderedDict[Any, _Graph | None] = OrderedDict()
        self.seen: set = set()
        self.state: tuple | None = None
        # the state a replay in the running CFG step read, for its later branches
        self.step_state: tuple | None = None
        self.tree_state = _ModuleTreeState(dit)
        # per issuing stream: graphs replayed at once must not share memory
        self.pools: dict[int, Any] = {}
        dit.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(leaves, spec, kwargs)
        state = None if key is None else self._state()
        if state is None:
            return self._eager(args, kwargs)
        if state != self.state:
            self.graphs.clear()
            self.seen.clear()
            # a pool whose graphs are all gone cannot take another capture
            # (the caching allocator asserts on its use count)
            self.pools.clear()
            self.state = state
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self._eager(args, kwargs)
            _after_other_branches()
            self.step_state = None
            self.graphs[key] = self._capture(leaves, spec)
            if len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        elif _branch_streams:
            # A replay runs no Python of the DiT, so the next branch of this
            # CFG step finds the state this one read.
            self.step_state = state
        self.graphs.move_to_end(key)
        graph = self.graphs[key]
        if graph is None:
            return self._eager(args, kwargs)
        return graph.replay(leaves)

    def _eager(self, args: tuple, kwargs: dict) -> Any:
        _after_other_branches()
        self.step_state = None
        return self.eager_forward(*args, **kwargs)

    def _capture(self, leaves: list, spec) -> _Graph | None:
        stream = torch.cuda.current_stream()
        if stream.cuda_stream not in self.pools:
            self.pools[stream.cuda_stream] = torch.cuda.graph_pool_handle()
        name = type(self.dit).__name__
        try:
            graph = _Graph(
                self.eager_forward,
                leaves,
                spec,
                self.pools[stream.cuda_stream],
                # a captured GEMM writes the cuBLAS workspace of the stream it
                # was captured on
                _capture_stream(stream.device, stream.cuda_stream),
            )
        except Exception as exc:  # the forward did something a graph cannot hold
            logger.warning(
                "train_parity: no CUDA graph of the %s forward for these inputs, "
                "which run eagerly: %s",
                name,
                exc,
            )
            return None
        logger.info("train_parity: captured a CUDA graph of the %s forward", name)
        return graph

    def _key(self, leaves: list, spec, kwargs: dict) -> tuple | None:
        if torch.is_grad_enabled():
            return _runs_eagerly("autograd is on")
        if not self.dit.train_parity_graph_replayable(kwargs):
            return _runs_eagerly(
                f"{type(self.dit).__name__} does not replay calls with these inputs"
            )
        # a graph per issuing stream: one graph replayed at once on two streams
        # would share its inputs, outputs and memory
        key = [
            spec,
            BaseLayerWithLoRA.forward_context_state(),
            _current_stream_id(),
        ]
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if not (leaf.is_cuda and leaf.is_contiguous()):
                    return _runs_eagerly("an input is not a contiguous CUDA tensor")
                key.append((leaf.shape, leaf.dtype, leaf.device))
            else:
                try:
                    hash(leaf)
                except TypeError:
                    return _runs_eagerly("an input is not hashable")
                key.append(leaf)
        return tuple(key)

    def _state(self) -> tuple | None:
        """What the captured graphs depend on besides their inputs; None where a
        graph cannot stand for the forward (hooks, parameters off the GPU)."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return _runs_eagerly("global forward hooks are registered")
        if self.step_state is not None:
            return self.step_state
        return self.tree_state.read()


def _current_stream_id() -> int | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.current_stream().cuda_stream


@cache
def _capture_stream(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@cache
def _branch_stream(device: torch.device, index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


# The streams of the CFG branches run_cfg_branches is running, while it runs.
_branch_streams: list[torch.cuda.Stream] = []


def _after_other_branches() -> None:
    """An eager forward (or a capture) on a branch stream starts after the
    other branches' work: it may read what their forwards cached for it (the
    modulations of a timestep, tables built on first use). A graph replay
    reads nothing of the kind, so only replays overlap."""
    if not _branch_streams:
        return
    current = torch.cuda.current_stream()
    for stream in _branch_streams:
        if stream != current:
            current.wait_stream(stream)


def run_cfg_branches(
    dit: nn.Module | None, predict: Callable[[Any], Any], branches: Sequence
) -> list:
    """``[predict(branch) for branch in branches]``, a CFG step's branch
    predictions. Where ``dit`` replays CUDA graphs, each branch runs with a
    stream of its own as the current stream, so that their replays overlap on
    the GPU; each stream starts after the current stream's work, which waits
    for all of them before it returns. A kernel computes the same bits on any
    stream, and each branch replays its own graphs from its own memory pool.
    Otherwise (also without a ``dit``: a stage driven without its model) the
    branches run one after the other."""
    if (
        len(branches) < 2
        or _branch_streams
        or dit is None
        or not isinstance(dit.forward, ExactShapeGraphs)
        or not next(dit.parameters()).is_cuda
    ):
        return [predict(branch) for branch in branches]
    main = torch.cuda.current_stream()
    streams = [_branch_stream(main.device, i) for i in range(len(branches))]
    results = []
    dit.forward.step_state = None
    try:
        for stream, branch in zip(streams, branches):
            stream.wait_stream(main)
            _branch_streams.append(stream)
            with torch.cuda.stream(stream):
                results.append(predict(branch))
    finally:
        _branch_streams.clear()
        dit.forward.step_state = None
        for stream in streams:
            main.wait_stream(stream)
    # the branches' outputs are read on the current stream from here on
    tree_map(
        lambda t: t.record_stream(main) if isinstance(t, torch.Tensor) else t,
        results,
    )
    return results


def install(dit: nn.Module) -> bool:
    """Replay ``dit``'s forward from CUDA graphs where its class says how
    (``train_parity_graph_replayable``); False where it does not."""
    if not callable(getattr(dit, "train_parity_graph_replayable", None)):
        return False
    ExactShapeGraphs(dit)
    return True
