"""Shared fixtures: the pinned upstream wheel, the fork's wheel, and pristine upstream trees."""

from __future__ import annotations

import subprocess
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
