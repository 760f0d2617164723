"""Shared fixtures: the pinned upstream wheel, the fork's wheel, pristine upstream trees, and
upstream's unit suite running beside the other tests."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from forktools.upstream import load_pin, obtain_wheel
from forktools.wheelbuild import build_wheel


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


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run a command, failing the test with its output if it fails."""
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{cmd} failed:\n{result.stdout}\n{result.stderr}"
    return result


REPO = Path(__file__).resolve().parent.parent
UPSTREAM_SUITE_TEST = "test_upstream_suite.py"
# `python -m forktools upstream-suite`, started as soon as its test is collected
upstream_suite_run = pytest.StashKey[subprocess.Popen]()


def pytest_collection_modifyitems(config, items):
    """Upstream's unit suite takes about ten minutes on two cores, mostly in processes that
    wait on each other: it runs beside the other tests, and its test waits for it."""
    if any(item.path.name == UPSTREAM_SUITE_TEST for item in items):
        config.stash[upstream_suite_run] = subprocess.Popen(
            [sys.executable, "-m", "forktools", "upstream-suite"],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )


def pytest_unconfigure(config):
    process = config.stash.get(upstream_suite_run, None)
    if process is not None and process.poll() is None:
        process.kill()
