# SPDX-License-Identifier: Apache-2.0
"""/health reports a scheduler that has neither answered nor finished a
denoising step for --scheduler-stall-timeout seconds."""

import asyncio
import time

import pytest
import zmq

from sglang.multimodal_gen.runtime.managers.scheduler_heartbeat import (
    Heartbeat,
    HeartbeatMonitor,
)


def test_stall_timeout_flag(parse_server_args, train_parity_args):
    assert train_parity_args(numerics="default").scheduler_stall_timeout == 300
    assert (
        parse_server_args(["--scheduler-stall-timeout", "5"]).scheduler_stall_timeout
        == 5
    )
    with pytest.raises(ValueError, match="stall-timeout must be a positive integer"):
        train_parity_args(numerics="default", scheduler_stall_timeout=0)


def test_a_silent_replica_is_reported_and_a_beating_one_is_not(tmp_path):
    endpoint = f"ipc://{tmp_path}/heartbeat"
    context = zmq.Context()
    beating = Heartbeat(context, endpoint, replica=1)
    silent_then_back = Heartbeat(context, endpoint, replica=0)

    async def beat_for(seconds: float, *heartbeats: Heartbeat) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for heartbeat in heartbeats:
                heartbeat.beat()
            await asyncio.sleep(0.05)

    async def run(monitor: HeartbeatMonitor) -> None:
        task = asyncio.create_task(monitor.run(endpoint, replicas=2, timeout_s=1))
        try:
            await beat_for(0.5, beating)
            assert monitor.stall() is None
            await beat_for(1.0, beating)
            stall = monitor.stall()
            assert "dp replica 0 " in stall and "--scheduler-stall-timeout" in stall
            await beat_for(1.0, beating, silent_then_back)
            assert monitor.stall() is None
        finally:
            task.cancel()

    monitor = HeartbeatMonitor()
    try:
        asyncio.run(run(monitor))
    finally:
        context.destroy(linger=0)
    # a monitor that is not running knows nothing of the schedulers
    assert monitor.stall() is None
