"""The pinned upstream sglang release: which wheels the build accepts and how to obtain one."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename

REPO_ROOT = Path(__file__).resolve().parent.parent
PIN_FILE = REPO_ROOT / "patches" / "upstream.toml"
# A wheel file, or a folder holding the pinned wheels, to build from without network access.
UPSTREAM_WHEEL_ENV = "SGLANG_TP_UPSTREAM_WHEEL"
CACHE_DIR = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "sglang-train-parity"
)


class UpstreamError(RuntimeError):
    """The pinned upstream wheel is missing or is not the one the pin names."""


@dataclasses.dataclass(frozen=True)
class Pin:
    package: str
    version: str
    git_tag: str
    fork_revision: int
    wheels: dict[str, str]  # file name -> sha256

    @property
    def fork_version(self) -> str:
        return f"{self.version}+trainparity.{self.fork_revision}"

    def wheel_for_interpreter(self) -> str:
        """The pinned wheel file name that the running interpreter can install."""
        by_tag = {}
        for name in self.wheels:
            for tag in parse_wheel_filename(name)[3]:
                by_tag.setdefault(tag, name)
        for tag in sys_tags():  # most specific first
            if tag in by_tag:
                return by_tag[tag]
        raise UpstreamError(
            f"no pinned {self.package} {self.version} wheel for this interpreter "
            f"({sys.implementation.name} {sys.version_info.major}.{sys.version_info.minor}); "
            f"pinned: {', '.join(sorted(self.wheels))}"
        )


def load_pin(path: Path = PIN_FILE) -> Pin:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    return Pin(
        package=data["package"],
        version=data["version"],
        git_tag=data["git_tag"],
        fork_revision=int(data["fork_revision"]),
        wheels=dict(data["wheels"]),
    )


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_wheel(pin: Pin, path: Path) -> Path:
    expected = pin.wheels.get(path.name)
    if expected is None:
        raise UpstreamError(
            f"{path.name} is not a pinned wheel; pinned: {', '.join(sorted(pin.wheels))}"
        )
    actual = sha256_of(path)
    if actual != expected:
        raise UpstreamError(
            f"{path}: sha256 mismatch: expected {expected}, actual {actual}"
        )
    return path


def obtain_wheel(
    pin: Pin, source: str | os.PathLike | None = None, name: str | None = None
) -> Path:
    """Return a verified copy of the pinned wheel `name` (default: the running interpreter's).

    `source` (or the environment variable SGLANG_TP_UPSTREAM_WHEEL) names a local wheel file or a
    folder holding it; without one the wheel is downloaded with pip into a cache folder.
    """
    name = name or pin.wheel_for_interpreter()
    source = source or os.environ.get(UPSTREAM_WHEEL_ENV)
    if source:
        source = Path(source)
        path = source / name if source.is_dir() else source
        if not path.is_file():
            raise UpstreamError(f"upstream wheel not found: {path} (wanted {name})")
        return verify_wheel(pin, path)

    cached = CACHE_DIR / name
    if cached.is_file():
        return verify_wheel(pin, cached)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
        _pip_download(pin, name, Path(tmp))
        downloaded = Path(tmp) / name
        if not downloaded.is_file():
            got = ", ".join(p.name for p in Path(tmp).iterdir()) or "nothing"
            raise UpstreamError(f"pip download gave {got}, not the pinned wheel {name}")
        verify_wheel(pin, downloaded)
        downloaded.replace(cached)
    return cached


def _pip_download(pin: Pin, name: str, dest: Path) -> None:
    _, _, _, tags = parse_wheel_filename(name)
    tag = next(iter(tags))
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--python-version", tag.interpreter.removeprefix("cp"),
        "--implementation", "cp", "--abi", tag.abi, "--platform", tag.platform,
        "-d", str(dest), f"{pin.package}=={pin.version}",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise UpstreamError(
            f"could not download {name} with pip (set {UPSTREAM_WHEEL_ENV} to a local copy to build "
            f"offline):\n{result.stderr[-2000:]}"
        )
