# SPDX-License-Identifier: Apache-2.0
"""Whether each scheduler is still answering, for ``/health``.

The driver of each DP replica beats from its event loop (idle or between
requests) and at every denoising step boundary of the request it runs. The
HTTP server records the last beat of each replica; ``/health`` answers 503,
naming the replica, once one has not beaten for ``--scheduler-stall-timeout``
seconds.

So a load balancer sees 200 from a server that is idle or busy with a request
that steps, however long the request, and 503 from one whose scheduler is
stuck (a hung collective or kernel, or one step or stage longer than the
bound): it takes that server out of rotation until it beats again, or an
orchestrator restarts it. The bound must exceed the longest step-free stretch
of a legitimate request (one step, the text encoding or the VAE decode).
"""

from __future__ import annotations

import time

import zmq
import zmq.asyncio

from sglang.multimodal_gen.runtime.utils.logging_utils import init_logger

logger = init_logger(__name__)

# At most this often a scheduler sends a beat.
_BEAT_INTERVAL_S = 0.5


class Heartbeat:
    """A replica driver's beats: its replica index, dropped while nobody listens."""

    def __init__(self, context: zmq.Context, endpoint: str, replica: int):
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 1)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(endpoint)
        self._replica = replica
        self._last_beat = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat < _BEAT_INTERVAL_S:
            return
        self._last_beat = now
        try:
            self._socket.send_json(self._replica, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass


_heartbeat: Heartbeat | None = None


def init_heartbeat(context: zmq.Context, endpoint: str, replica: int) -> None:
    global _heartbeat
    _heartbeat = Heartbeat(context, endpoint, replica)


def beat() -> None:
    """The scheduler is making progress (a no-op on ranks that do not beat)."""
    if _heartbeat is not None:
        _heartbeat.beat()


class HeartbeatMonitor:
    """The HTTP server's record of each replica's last beat."""

    def __init__(self) -> None:
        self._last_beats: dict[int, float] = {}
        self._timeout_s: int | None = None

    async def run(self, endpoint: str, replicas: int, timeout_s: int) -> None:
        context = zmq.asyncio.Context()
        socket = context.socket(zmq.PULL)
        socket.bind(endpoint)
        now = time.monotonic()
        self._last_beats = {replica: now for replica in range(replicas)}
        self._timeout_s = timeout_s
        try:
            while True:
                replica = await socket.recv_json()
                self._last_beats[replica] = time.monotonic()
        finally:
            self._timeout_s = None
            socket.close(linger=0)
            context.destroy(linger=0)

    def stall(self) -> str | None:
        """Why a scheduler counts as stuck, or None while every one beats."""
        if self._timeout_s is None:
            return None
        now = time.monotonic()
        for replica, last_beat in self._last_beats.items():
            silent_s = now - last_beat
            if silent_s > self._timeout_s:
                return (
                    f"the scheduler of dp replica {replica} has not answered or "
                    f"finished a denoising step for {silent_s:.0f} s (bound "
                    f"{self._timeout_s} s, --scheduler-stall-timeout): it is "
                    "stuck in a request; requests to it wait"
                )
        return None


scheduler_heartbeats = HeartbeatMonitor()
