# SPDX-License-Identifier: Apache-2.0
"""A second CUDA stream for work that can overlap the current stream's.

A kernel computes the same bits on any stream, so moving independent work to
a second stream changes when it runs, never what it computes. Under CUDA-graph
capture the two streams become two branches of the graph, joined where one
hands a tensor to the other.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn.modules import module as nn_module


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether forward hooks run around ``module``: they may move its weights
    on another stream and order only the current stream after that (layerwise
    offload, FSDP), so work on a side stream must be fenced by the current
    stream at the module's start and end."""
    return bool(
        module._forward_pre_hooks
        or module._forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_forward_hooks
    )


@functools.cache
def _side_stream(device: torch.device, stream_id: int) -> torch.cuda.Stream:
    # One per issuing stream: forwards running at once on two streams (a CFG
    # step's branches) must not share its cuBLAS workspace, which a captured
    # GEMM writes, nor queue behind each other's side work.
    # Normal priority: at high priority its kernels take the SMs first and slow
    # the current stream's, which is the step's critical path, more than
    # waiting for them would.
    return torch.cuda.Stream(device)


class SideStream:
    """``with side:`` issues work onto the side stream. ``to_main`` makes the
    current stream wait for the work issued there so far, ``to_side`` the
    reverse; both record the tensors they hand over on the receiving stream,
    so the caching allocator does not reuse their memory before the receiver's
    kernels ran. ``inputs`` are handed to the side stream at construction.
    Off CUDA, or with ``overlap=False``, every call is a no-op and the work
    runs in issue order on the current stream (``NO_SIDE_STREAM``).
    """

    def __init__(
        self, device: torch.device, *inputs: torch.Tensor, overlap: bool = True
    ) -> None:
        self.enabled = overlap and device.type == "cuda"
        if self.enabled:
            self.main = torch.cuda.current_stream(device)
            self.side = _side_stream(device, self.main.cuda_stream)
            self.to_side(*inputs)
        self._contexts: list[torch.cuda.StreamContext] = []

    def __enter__(self) -> SideStream:
        if self.enabled:
            self._contexts.append(torch.cuda.stream(self.side))
            self._contexts[-1].__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.enabled:
            self._contexts.pop().__exit__(*exc_info)

    def to_main(self, *tensors: torch.Tensor) -> None:
        if self.enabled:
            self._hand_over(self.side, self.main, tensors)

    def to_side(self, *tensors: torch.Tensor) -> None:
        if self.enabled:
            self._hand_over(self.main, self.side, tensors)

    def join(self) -> None:
        """The current stream waits for everything issued on the side stream."""
        if self.enabled:
            self.main.wait_stream(self.side)

    @staticmethod
    def _hand_over(
        sender: torch.cuda.Stream,
        receiver: torch.cuda.Stream,
        tensors: tuple[torch.Tensor, ...],
    ) -> None:
        receiver.wait_stream(sender)
        for tensor in tensors:
            tensor.record_stream(receiver)


# Every call a no-op: the work runs in issue order on the current stream.
NO_SIDE_STREAM = SideStream(torch.device("cpu"), overlap=False)
