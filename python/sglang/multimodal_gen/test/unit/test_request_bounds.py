# SPDX-License-Identifier: Apache-2.0
"""One request cannot hold the server: under --numerics train_parity its
denoising work is bounded at admission, and in every mode a request whose HTTP
client disconnects is cancelled at its next denoising step."""

import asyncio
import time
from types import SimpleNamespace

import pytest
import zmq
import zmq.asyncio

from sglang.multimodal_gen.runtime.managers import request_cancellation
from sglang.multimodal_gen.runtime.managers.request_cancellation import (
    CancelListener,
    RequestCancelledError,
    raise_if_cancelled,
)
from sglang.multimodal_gen.runtime.scheduler_client import (
    AsyncSchedulerClient,
    ClientDisconnectedError,
)
from sglang.multimodal_gen.runtime.utils import request_bounds
from sglang.multimodal_gen.runtime.utils.train_parity import TrainParityError

_SMALL_BOUNDS = dict(
    train_parity_max_inference_steps=8,
    train_parity_max_num_frames=8,
    train_parity_max_image_pixels=64 * 64,
    train_parity_max_denoising_work=8 * 64 * 64 - 1,
)


def test_bounds_have_defaults_and_flags(parse_server_args, train_parity_args):
    args = train_parity_args()
    assert args.train_parity_max_inference_steps == request_bounds.MAX_INFERENCE_STEPS
    assert args.train_parity_max_num_frames == request_bounds.MAX_NUM_FRAMES
    assert args.train_parity_max_denoising_work == request_bounds.MAX_DENOISING_WORK
    parsed = parse_server_args(
        [
            *("--train-parity-max-inference-steps", "8"),
            *("--train-parity-max-num-frames", "9"),
            *("--train-parity-max-denoising-work", "10"),
        ]
    )
    assert parsed.train_parity_max_inference_steps == 8
    assert parsed.train_parity_max_num_frames == 9
    assert parsed.train_parity_max_denoising_work == 10
    with pytest.raises(ValueError, match="max-num-frames must be positive, got 0"):
        train_parity_args(train_parity_max_num_frames=0)
    with pytest.raises(ValueError, match="applies only with --numerics train_parity"):
        train_parity_args(numerics="default", train_parity_max_inference_steps=8)


@pytest.mark.parametrize(
    "request_kwargs, option, flag",
    [
        (
            dict(num_inference_steps=9),
            "num_inference_steps=9",
            "--train-parity-max-inference-steps",
        ),
        (dict(num_frames=9), "num_frames=9", "--train-parity-max-num-frames"),
        (
            dict(width=128, height=64),
            "width=128 height=64",
            "--train-parity-max-image-pixels",
        ),
        (
            dict(num_inference_steps=8, width=64, height=64),
            "num_inference_steps=8 num_frames=1 width=64 height=64",
            "--train-parity-max-denoising-work",
        ),
    ],
)
def test_a_request_over_a_bound_is_refused(
    request_kwargs, option, flag, train_parity_args, train_parity_request
):
    args = train_parity_args(**_SMALL_BOUNDS)
    with pytest.raises(TrainParityError, match=f"does not support {option}: ") as e:
        train_parity_request(args, true_cfg_scale=4.0, **request_kwargs)
    assert flag in str(e.value)
    train_parity_request(train_parity_args(numerics="default"), **request_kwargs)


def test_a_request_within_the_bounds_is_admitted(
    train_parity_args, train_parity_request
):
    args = train_parity_args(**_SMALL_BOUNDS)
    train_parity_request(
        args, true_cfg_scale=4.0, num_inference_steps=8, width=64, height=32
    )
    # an image model refuses num_frames != 1 whatever the bound, so the frame
    # bound is checked on its own
    frames = SimpleNamespace(num_inference_steps=8, num_frames=8, width=8, height=8)
    assert not list(request_bounds.request_problems(frames, args))


def _req(request_id: str, is_warmup: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        is_warmup=is_warmup,
        client_request_ids=lambda: [request_id],
    )


@pytest.fixture
def cancel_channel(tmp_path, monkeypatch):
    """A PUB socket as the HTTP server binds it, and the scheduler's listener."""
    context = zmq.asyncio.Context()
    endpoint = f"ipc://{tmp_path}/cancel"
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    sync_context = zmq.Context()
    monkeypatch.setattr(
        request_cancellation, "_listener", CancelListener(sync_context, endpoint)
    )
    time.sleep(0.2)  # the subscription reaches the publisher
    yield publisher
    publisher.close(linger=0)
    context.term()
    request_cancellation._listener._socket.close(linger=0)
    sync_context.term()


def _until_cancelled(request_id: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            raise_if_cancelled(_req(request_id))
        except RequestCancelledError:
            return
        time.sleep(0.01)
    raise AssertionError(f"{request_id} was not cancelled")


def test_a_request_whose_client_is_gone_is_cancelled(cancel_channel):
    client = AsyncSchedulerClient()
    client._cancel_socket = cancel_channel
    started = asyncio.Event()

    async def forward(req):
        started.set()
        await asyncio.sleep(60)

    client.forward = forward

    async def client_gone():
        await started.wait()

    async def run():
        with pytest.raises(ClientDisconnectedError, match="client disconnected"):
            await client.forward_while_connected(_req("gone"), client_gone())

    asyncio.run(run())
    _until_cancelled("gone")
    # its outputs, run as requests of their own, stop too
    with pytest.raises(RequestCancelledError, match="gone:1 cancelled"):
        raise_if_cancelled(_req("gone:1"))
    raise_if_cancelled(_req("other"))
    raise_if_cancelled(_req("gone", is_warmup=True))


def test_a_connected_client_gets_its_reply(cancel_channel):
    client = AsyncSchedulerClient()
    client._cancel_socket = cancel_channel

    async def forward(req):
        return f"output of {req.request_id}"

    client.forward = forward

    async def run():
        never = asyncio.get_running_loop().create_future()
        return await client.forward_while_connected(_req("kept"), never)

    assert asyncio.run(run()) == "output of kept"
    raise_if_cancelled(_req("kept"))
