"""The fork's wheel: name, version, reproducibility, and the pinned-upstream checks."""

from __future__ import annotations

import importlib.metadata
import shutil
import zipfile

import pytest

from forktools.upstream import UpstreamError, obtain_wheel, sha256_of
from forktools.wheelbuild import build_wheel


def test_wheel_name_and_version(pin, fork_wheel, upstream_wheel):
    assert pin.fork_version == f"{pin.version}+trainparity.{pin.fork_revision}"
    assert fork_wheel.name == upstream_wheel.name.replace(
        f"sglang-{pin.version}-", f"sglang-{pin.fork_version}-"
    )
    with zipfile.ZipFile(fork_wheel) as zf:
        names = zf.namelist()
        metadata = zf.read(f"sglang-{pin.fork_version}.dist-info/METADATA").decode()
        assert zf.testzip() is None
    assert "Name: sglang\n" in metadata
    assert f"\nVersion: {pin.fork_version}\n" in metadata
    assert not any(n.startswith(f"sglang-{pin.version}.dist-info/") for n in names)
    assert "sglang/multimodal_gen/runtime/utils/train_parity.py" in names
    assert "sglang_train_parity/cli.py" in names  # the fork's tools, outside sglang/
    assert not any(n.startswith("sglang/multimodal_gen/train_parity/") for n in names)


def test_wheel_declares_the_tools(pin, fork_wheel):
    """`pip install ".[train-parity]"` brings the tools' dependencies; the tools' command is a
    console script; the diffusion extra pins the same diffusers."""
    with zipfile.ZipFile(fork_wheel) as zf:
        info = f"sglang-{pin.fork_version}.dist-info"
        metadata = zf.read(f"{info}/METADATA").decode()
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
    assert "Provides-Extra: train-parity\n" in metadata
    for requirement in ("diffusers==0.42.1", "peft<0.22,>=0.21", "matplotlib>=3.8"):
        assert f'Requires-Dist: {requirement}; extra == "train-parity"' in metadata
    assert 'Requires-Dist: diffusers==0.42.1; extra == "diffusion"' in metadata
    assert "diffusers==0.37.0" not in metadata
    assert "sglang-train-parity = sglang_train_parity.cli:main" in entry_points
    assert "sglang = sglang.cli.main:main" in entry_points


def test_installed_distribution_is_the_fork(pin):
    """The environment the tests run in has the fork installed (README's test command does it)."""
    assert importlib.metadata.version("sglang") == pin.fork_version


def test_two_builds_are_byte_identical(fork_wheel, upstream_wheel, tmp_path):
    again = build_wheel(tmp_path, upstream_wheel)
    assert again.name == fork_wheel.name
    assert again.read_bytes() == fork_wheel.read_bytes()


def test_tampered_upstream_wheel_is_refused(pin, upstream_wheel, tmp_path):
    tampered = tmp_path / upstream_wheel.name
    shutil.copyfile(upstream_wheel, tampered)
    with open(tampered, "ab") as f:
        f.write(b"\0")
    with pytest.raises(UpstreamError) as e:
        obtain_wheel(pin, tampered)
    message = str(e.value)
    assert upstream_wheel.name in message
    assert pin.wheels[upstream_wheel.name] in message  # expected hash
    assert sha256_of(tampered) in message  # actual hash


def test_missing_upstream_wheel_is_named(pin, tmp_path):
    with pytest.raises(UpstreamError, match=pin.wheel_for_interpreter()):
        obtain_wheel(pin, tmp_path)


def test_unpinned_wheel_is_refused(pin, upstream_wheel, tmp_path):
    other = tmp_path / upstream_wheel.name.replace(pin.version, "9.9.9")
    shutil.copyfile(upstream_wheel, other)
    with pytest.raises(UpstreamError, match="not a pinned wheel"):
        obtain_wheel(pin, other)


def test_offline_build_from_a_folder(pin, upstream_wheel, tmp_path, monkeypatch):
    folder = tmp_path / "wheels"
    folder.mkdir()
    shutil.copyfile(upstream_wheel, folder / upstream_wheel.name)
    monkeypatch.setenv("SGLANG_TP_UPSTREAM_WHEEL", str(folder))
    assert obtain_wheel(pin) == folder / upstream_wheel.name


def test_pin_covers_cpython_311_and_312_on_x86_64(pin):
    for py in ("cp311", "cp312"):
        assert any(
            f"-{py}-{py}-" in name and name.endswith("x86_64.whl")
            for name in pin.wheels
        ), py
