"""One request cannot wedge the server (issue 42, item 2), against a real `--numerics
train_parity` server on CPU: a request over a bound on its denoising work is refused with a 4xx
naming the field, the bound and the flag, and leaves the served policy as it was; a rollout whose
client has gone is cancelled at its next denoising step, so the next client is served at once,
bitwise."""

from __future__ import annotations

import signal
import threading
import time

import psutil
import pytest
import requests
from sglang_train_parity import rollout_demo as demo

from .test_bad_input import assert_serves_with_parity

pytestmark = pytest.mark.slow

# The second server's bounds: small enough for the tiny model's requests to reach them.
MAX_STEPS = 100
MAX_WORK = 500_000  # pixel-steps: 122 steps of a 64 x 64 image
# its /health: longer than a step or the VAE decode of a 64 x 64 image, shorter than a 100-step
# rollout of it
STALL_TIMEOUT_S = 2


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
    """A server started with small bounds and a short stall timeout."""
    with demo.serve(
        model_dir,
        "train_parity",
        tmp_path_factory.mktemp("bounded-logs"),
        extra_args=[
            *("--train-parity-max-inference-steps", str(MAX_STEPS)),
            *("--train-parity-max-denoising-work", str(MAX_WORK)),
            *("--scheduler-stall-timeout", str(STALL_TIMEOUT_S)),
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
        dict(num_inference_steps=50, width=160, height=128),
        "1024000 pixel-steps",
        f"bound of {MAX_WORK}",
        "--train-parity-max-denoising-work",
    )
    demo.request_rollout(bounded_server, num_inference_steps=2)


def _health(server):
    return requests.get(server.url + "/health", timeout=2)


def test_health_reports_a_stuck_scheduler(bounded_server):
    """/health used to answer 200 while every call waited behind a wedged scheduler. A rollout
    longer than the stall timeout keeps it healthy (each step is progress); a scheduler that
    stops (SIGSTOP) is reported within the timeout, and recovers when it goes on."""
    statuses = []
    rollout = threading.Thread(
        target=demo.request_rollout,
        args=(bounded_server,),
        kwargs=dict(num_inference_steps=MAX_STEPS),
    )
    start = time.monotonic()
    rollout.start()
    while rollout.is_alive():
        statuses.append(_health(bounded_server).status_code)
        time.sleep(0.3)
    rollout.join()
    assert time.monotonic() - start > STALL_TIMEOUT_S
    assert set(statuses) == {200}, statuses

    (scheduler,) = [
        p
        for p in psutil.Process(bounded_server.process.pid).children(recursive=True)
        if "scheduler" in " ".join(p.cmdline())
    ]
    scheduler.send_signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + STALL_TIMEOUT_S + 3
        while (response := _health(bounded_server)).status_code == 200:
            assert (
                time.monotonic() < deadline
            ), "a stopped scheduler still reported healthy"
            time.sleep(0.3)
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert (
            "scheduler of dp replica 0" in error
            and "--scheduler-stall-timeout" in error
        )
    finally:
        scheduler.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while _health(bounded_server).status_code != 200:
        assert time.monotonic() < deadline, "the scheduler did not recover"
        time.sleep(0.3)
    demo.request_rollout(bounded_server, num_inference_steps=2)
