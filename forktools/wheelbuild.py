"""Build the fork's wheel: pinned upstream wheel + the patch series + the files under python/."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from wheel.cli.pack import pack
from wheel.cli.unpack import unpack

from forktools.series import apply_series, read_series
from forktools.upstream import REPO_ROOT, Pin, load_pin, obtain_wheel

# Zip timestamps of every entry; a fixed value makes two builds from the same inputs byte-identical.
BUILD_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can hold
# The fork's own tools (parity check, rollout demo, trainer reference): a top-level package
# of the wheel, its dependencies an extra, its command a console script.
TOOLS_DIR = REPO_ROOT / "tools"
TOOLS_PACKAGE = "sglang_train_parity"
TOOLS_EXTRA = "train-parity"
TOOLS_SCRIPT = "sglang-train-parity = sglang_train_parity.cli:main"


def prepare_tree(pin: Pin, upstream_wheel: Path, dest: Path) -> Path:
    """Unpack the upstream wheel into `dest`, apply the series with its new files, and add
    the fork's own tools package (outside `sglang/`, never imported by the server).

    Returns the unpacked wheel folder (holding `sglang/` and the dist-info folder).
    """
    unpack(str(upstream_wheel), str(dest))
    root = dest / f"{pin.package}-{pin.version}"
    apply_series(read_series(), root)
    shutil.copytree(
        TOOLS_DIR / TOOLS_PACKAGE,
        root / TOOLS_PACKAGE,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


def tools_requirements() -> list[Requirement]:
    lines = (TOOLS_DIR / "requirements.txt").read_text().splitlines()
    return [
        Requirement(line) for line in lines if line.strip() and not line.startswith("#")
    ]


def _add_tools_metadata(metadata: str) -> str:
    """The `train-parity` extra: the tools' requirements, and the same pins in the other
    extras that name the same projects (one diffusers whichever extras are installed).
    """
    pins = {canonicalize_name(r.name): r for r in tools_requirements()}

    def repin(match: re.Match) -> str:
        requirement = Requirement(match[1])
        pin = pins.get(canonicalize_name(requirement.name))
        if pin is None or requirement.marker is None:
            return match[0]
        return f"Requires-Dist: {pin.name}{pin.specifier}; {requirement.marker}"

    metadata = re.sub(r"^Requires-Dist: (.*)$", repin, metadata, flags=re.M)
    head, blank, body = metadata.partition("\n\n")
    extra = [f"Provides-Extra: {TOOLS_EXTRA}"] + [
        f'Requires-Dist: {r}; extra == "{TOOLS_EXTRA}"' for r in pins.values()
    ]
    return head + "\n" + "\n".join(extra) + blank + body


def stamp_version(pin: Pin, root: Path) -> Path:
    """Rename the dist-info folder and METADATA's Version to the fork's version."""
    old = root / f"{pin.package}-{pin.version}.dist-info"
    new = root / f"{pin.package}-{pin.fork_version}.dist-info"
    old.rename(new)
    metadata = new / "METADATA"
    text, count = re.subn(
        r"^Version: .*$",
        f"Version: {pin.fork_version}",
        metadata.read_text(),
        count=1,
        flags=re.M,
    )
    if count != 1:
        raise ValueError(f"{metadata}: no Version field")
    metadata.write_text(_add_tools_metadata(text))
    entry_points = new / "entry_points.txt"
    entry_points.write_text(
        entry_points.read_text().replace(
            "[console_scripts]\n", f"[console_scripts]\n{TOOLS_SCRIPT}\n", 1
        )
    )
    return new


def build_wheel(
    out_dir: Path, upstream_source: str | os.PathLike | None = None
) -> Path:
    """Build the fork's wheel into `out_dir` and return its path."""
    pin = load_pin()
    upstream_wheel = obtain_wheel(pin, upstream_source)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = prepare_tree(pin, upstream_wheel, Path(tmp))
        stamp_version(pin, root)
        saved_epoch = os.environ.get("SOURCE_DATE_EPOCH")
        os.environ["SOURCE_DATE_EPOCH"] = BUILD_EPOCH
        try:
            pack(str(root), str(out_dir), build_number=None)
        finally:
            if saved_epoch is None:
                del os.environ["SOURCE_DATE_EPOCH"]
            else:
                os.environ["SOURCE_DATE_EPOCH"] = saved_epoch
    wheel = out_dir / upstream_wheel.name.replace(
        f"-{pin.version}-", f"-{pin.fork_version}-", 1
    )
    if not wheel.is_file():
        raise RuntimeError(f"wheel pack wrote no {wheel.name} into {out_dir}")
    return wheel
