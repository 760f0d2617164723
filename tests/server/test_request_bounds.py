"""One request cannot wedge the server (issue 42, item 2), against a real `--numerics
train_parity` server on CPU: a request over a bound on its denoising work is refused with a 4xx
naming the field, the bound and the flag, and leaves the served policy as it was; a rollout whose
client has gone is cancelled at its next denoising step, so the next client is served at once,
bitwise."""

from __future__ import annotations

import time

import pytest
import requests
from sglang_train_parity import rollout_demo as demo

from .test_bad_input import assert_serves_with_parity

pytestmark = pytest.mark.slow

# The second server's bounds: small enough for the tiny model's requests to reach them.
MAX_STEPS = 60
MAX_WORK = 200_000  # pixel-steps: 48 steps of a 64 x 64 image


def assert_bound_refused(server, overrides, *fragments):
    before = demo.policy_checksum(server)
    response = server.post("/rollout/generate", **{**demo.ROLLOUT_REQUEST, **overrides})
    assert 400 <= response.status_code < 500, response.text
    for fragment in fragments:
        assert fragment in response.text, response.text
    assert demo.policy_checksum(server) == before


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            dict(num_inference_steps=1001),
            [
                "num_inference_steps=1001",
                "bound of 1000 steps",
                "--train-parity-max-inference-steps",
            ],
        ),
        (
            dict(num_frames=1026),
            [
                "num_frames=1026",
                "bound of 1025 frames",
                "--train-parity-max-num-frames",
            ],
        ),
        (
            dict(width=65536, height=65536),
            [
                "width=65536 height=65536",
                "4294967296 pixels",
                "--train-parity-max-image-pixels",
            ],
        ),
    ],
    ids=["steps", "frames", "pixels"],
)
def test_default_bounds_refuse_at_admission(server, served, overrides, fragments):
    assert_bound_refused(server, overrides, *fragments)
    assert_serves_with_parity(server, served)


def test_disconnected_rollout_is_cancelled(server, served):
    """An abandoned 300-step rollout used to run to its end (about 30 s here) while the next
    client waited; now it stops at its next step and the next rollout starts at once."""
    start = time.monotonic()
    demo.request_rollout(server, num_inference_steps=2)
    two_step_rollout_s = time.monotonic() - start
    before = demo.policy_checksum(server)
    with pytest.raises(requests.Timeout):
        server.post(
            "/rollout/generate",
            timeout=two_step_rollout_s + 1.0,
            **{**demo.ROLLOUT_REQUEST, "num_inference_steps": 300},
        )
    start = time.monotonic()
    demo.request_rollout(server, num_inference_steps=2)
    waited_s = time.monotonic() - start
    # the cancelled rollout's next step boundary, then this rollout: far below its other steps
    assert waited_s < 2 * two_step_rollout_s + 2.0, (waited_s, two_step_rollout_s)
    log = server.log_path.read_text()
    assert "the client disconnected; cancelled at its next denoising step" in log
    assert "cancelled: its client disconnected" in log
    assert demo.policy_checksum(server) == before
    assert_serves_with_parity(server, served)


@pytest.fixture(scope="module")
def bounded_server(model_dir, tmp_path_factory):
    """A server started with small bounds."""
    with demo.serve(
        model_dir,
        "train_parity",
        tmp_path_factory.mktemp("bounded-logs"),
        extra_args=[
            *("--train-parity-max-inference-steps", str(MAX_STEPS)),
            *("--train-parity-max-denoising-work", str(MAX_WORK)),
        ],
    ) as server:
        yield server


def test_bounds_set_by_flags_are_logged_and_enforced(bounded_server):
    log = bounded_server.log_path.read_text()
    assert (
        f"num_inference_steps <= {MAX_STEPS} (--train-parity-max-inference-steps)"
        in log
    )
    assert (
        f"num_inference_steps * num_frames * width * height <= {MAX_WORK} "
        "(--train-parity-max-denoising-work)" in log
    )
    assert_bound_refused(
        bounded_server,
        dict(num_inference_steps=MAX_STEPS + 1),
        f"num_inference_steps={MAX_STEPS + 1}",
        f"bound of {MAX_STEPS} steps",
        "--train-parity-max-inference-steps",
    )
    assert_bound_refused(
        bounded_server,
        dict(num_inference_steps=50),
        "204800 pixel-steps",
        f"bound of {MAX_WORK}",
        "--train-parity-max-denoising-work",
    )
    demo.request_rollout(bounded_server, num_inference_steps=2)
