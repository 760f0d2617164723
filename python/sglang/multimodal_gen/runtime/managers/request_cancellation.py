# SPDX-License-Identifier: Apache-2.0
"""Cancels a generation request whose HTTP client has gone, at its next
denoising step.

The HTTP server publishes the id of each request whose client disconnected
(``AsyncSchedulerClient.forward_while_connected``); the driver of each
single-rank replica subscribes, and the denoising loop checks before every
step (``raise_if_cancelled``). A cancelled request ends with
``RequestCancelledError``, which the worker answers like any failed request:
its state lives on the request and goes with it, and the next request runs
as if it had never been sent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import zmq

from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

if TYPE_CHECKING:
    from sglang.multimodal_gen.runtime.pipelines_core.schedule_batch import Req

logger = init_logger(__name__)

# Request ids are unique, so a cancellation that arrives after its request
# finished is harmless; only the newest ones are kept.
_MAX_CANCELLED_IDS = 4096


class RequestCancelledError(RuntimeError):
    """The request's client disconnected before it finished."""


class CancelListener:
    """The ids of requests whose client has gone, received on a SUB socket."""

    def __init__(self, context: zmq.Context, endpoint: str):
        self._socket = context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._cancelled: OrderedDict[str, None] = OrderedDict()

    def _receive(self) -> None:
        while True:
            try:
                request_id = self._socket.recv_string(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._cancelled[request_id] = None
            if len(self._cancelled) > _MAX_CANCELLED_IDS:
                self._cancelled.popitem(last=False)

    def is_cancelled(self, request_id: str) -> bool:
        """Whether the request, or the client request it is one output of, was
        cancelled."""
        # the denoising stages import this module
        from sglang.multimodal_gen.runtime.pipelines_core.request_utils import (
            split_output_request_id,
        )

        self._receive()
        output = split_output_request_id(request_id)
        return request_id in self._cancelled or (
            output is not None and output[0] in self._cancelled
        )


_listener: CancelListener | None = None


def init_cancel_listener(context: zmq.Context, endpoint: str) -> None:
    global _listener
    _listener = CancelListener(context, endpoint)


def raise_if_cancelled(batch: Req) -> None:
    """At a step boundary: end the request if its client has gone."""
    if _listener is None or batch.is_warmup:
        return
    for request_id in batch.client_request_ids():
        if _listener.is_cancelled(request_id):
            raise RequestCancelledError(
                f"request {request_id} cancelled: its client disconnected"
            )
