"""The main job end to end: `sglang-train-parity demo` starts real sglang servers on CPU, pushes 3
LoRA updates, rolls out with true CFG, and recomputes every step as the trainer does: exactly 0.0
under train_parity with the server's policy checksum equal to the trainer's, nonzero under
default, nothing left running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DEMO = [str(Path(sys.executable).with_name("sglang-train-parity")), "demo"]
UPDATE_LINE = re.compile(
    r"^\[(train_parity|default)\] update (\d): .* "
    r"model_output_max_abs_diff=(\S+) model_output_mean_abs_diff=(\S+) "
    r"policy_checksum=(\S+)$",
    re.M,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from sglang_train_parity.tiny_model import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("model") / "tiny-qwen-image")


def tagged_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    """An environment with a unique tag, which every process the demo starts inherits;
    the demo's temporary files (server logs kept on failure) go to `tmp_path`."""
    tag = uuid.uuid4().hex
    return (
        dict(os.environ, SGLANG_TRAIN_PARITY_DEMO_TEST=tag, TMPDIR=str(tmp_path)),
        tag,
    )


def live_processes(tag: str) -> list[int]:
    """Pids of live processes carrying `tag` in their environment (not killed, only found)."""
    marker = f"SGLANG_TRAIN_PARITY_DEMO_TEST={tag}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # exited meanwhile, or not ours
            pass
    return pids


def test_demo_train_parity_is_exact_and_default_is_not(model_dir, tmp_path):
    env, tag = tagged_env(tmp_path)
    result = subprocess.run(
        [*DEMO, "--model-dir", str(model_dir), "--updates", "3"],
        capture_output=True,
        text=True,
        timeout=480,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    diffs = {
        (mode, int(update)): (float(max_diff), float(mean_diff), checksum)
        for mode, update, max_diff, mean_diff, checksum in UPDATE_LINE.findall(
            result.stdout
        )
    }
    assert [diffs[("train_parity", u)] for u in (1, 2, 3)] == [(0.0, 0.0, "equal")] * 3
    # the default server packs the text Q/K/V: other weights, other numerics
    assert all(diffs[("default", u)][0] > 0 for u in (1, 2, 3))
    assert all(diffs[("default", u)][2] == "differs" for u in (1, 2, 3))
    assert re.search(r"^1 +\| 0\.0 / 0\.0 +\| equal +\| \d", result.stdout, re.M)
    assert live_processes(tag) == []


def test_demo_stops_its_server_on_ctrl_c(model_dir, tmp_path):
    env, tag = tagged_env(tmp_path)
    demo = subprocess.Popen(
        [
            *DEMO,
            "--model-dir",
            str(model_dir),
            "--skip-default",
            "--updates",
            "30",  # ~40 s of rollouts: Ctrl-C lands mid-run, not after a short run ended
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        for line in demo.stdout:  # bounded by the demo's own server start timeout
            if "server healthy" in line:
                break
        assert len(live_processes(tag)) > 2, "the demo and its server should be up"
        demo.send_signal(signal.SIGINT)  # what Ctrl-C sends
        assert demo.wait(timeout=60) == 128 + signal.SIGINT
        assert live_processes(tag) == []
    finally:
        # if the test failed: the demo and whatever of its servers is left, by pid
        for pid in live_processes(tag):
            os.kill(pid, signal.SIGKILL)
        demo.wait(timeout=10)
