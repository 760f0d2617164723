"""Shared fixtures: the pinned upstream wheel, the fork's wheel, pristine upstream trees, and
the series review and upstream's unit suite running beside the other tests."""

from __future__ import annotations

import os

# One OpenMP thread per process, set before anything imports torch, and inherited by every
# process the tests start (servers, CLIs, the background commands): the tests run tiny models,
# and on CI's two cores several test processes run at once, where more threads only contend
# (docs/maintaining.md has the measurement).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forktools.upstream import load_pin, obtain_wheel
from forktools.wheelbuild import build_wheel

pytest_plugins = ["pytester"]  # tests/test_background_commands.py runs pytest sessions


@pytest.fixture(scope="session")
def pin():
    return load_pin()


@pytest.fixture(scope="session")
def upstream_wheel(pin) -> Path:
    """The verified pinned upstream wheel (downloaded once into the user cache)."""
    return obtain_wheel(pin)


@pytest.fixture(scope="session")
def fork_wheel(upstream_wheel, tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("dist"), upstream_wheel)


@pytest.fixture(scope="session")
def pristine_package(upstream_wheel, tmp_path_factory) -> Path:
    """The upstream wheel's files, unpatched, as an importable folder (holds `sglang/`)."""
    root = tmp_path_factory.mktemp("pristine")
    with zipfile.ZipFile(upstream_wheel) as zf:
        zf.extractall(root)
    return root


@pytest.fixture(scope="session")
def tiny_qwen_image(tmp_path_factory) -> Path:
    """The tiny Qwen-Image pipeline (sglang_train_parity.tiny_model), built once for every
    test that reads it (none writes to it). sglang recognises the family from the folder name
    (and model_index.json)."""
    from sglang_train_parity.tiny_model import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("model") / "tiny-qwen-image")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output if it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


REPO = Path(__file__).resolve().parent.parent
# test -> the `python -m forktools` command it waits for. Each takes minutes on two cores, mostly
# in processes that wait on each other: it starts as soon as collection has chosen the tests to
# run, if its test is one of them, and runs beside the other tests.
BACKGROUND_COMMANDS = {
    "test_no_upstream_test_regresses": "upstream-suite",  # upstream's unit suite on the fork
    "test_upstream_diff_is_reviewable_on_its_own": "review",  # each upstream diff on its own
}
background_runs = pytest.StashKey[dict[str, subprocess.Popen]]()


def start_background(command: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "forktools", command],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def pytest_collection_finish(session):
    """Start the background commands of the tests that will run: session.items is the final
    selection (pytest_collection_modifyitems sees the tests before -k, -m and --deselect
    drop theirs); none under --collect-only."""
    if session.config.option.collectonly:
        return
    selected = {item.originalname for item in session.items}
    session.config.stash[background_runs] = {
        command: start_background(command)
        for test, command in BACKGROUND_COMMANDS.items()
        if test in selected
    }


def background_output(config, command: str, timeout: float = 3600) -> tuple[int, str]:
    """The exit status and output of the background `command` (BACKGROUND_COMMANDS)."""
    process = config.stash[background_runs][command]
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output


def pytest_unconfigure(config):
    for process in config.stash.get(background_runs, {}).values():
        if process.poll() is None:
            process.kill()
