"""Build the fork's wheel: pinned upstream wheel + the patch series + the files under python/."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from wheel.cli.pack import pack
from wheel.cli.unpack import unpack

from forktools.series import apply_series, read_series
from forktools.upstream import Pin, load_pin, obtain_wheel

# Zip timestamps of every entry; a fixed value makes two builds from the same inputs byte-identical.
BUILD_EPOCH = "315532800"  # 1980-01-01, the earliest time a zip entry can hold


def prepare_tree(pin: Pin, upstream_wheel: Path, dest: Path) -> Path:
    """Unpack the upstream wheel into `dest` and apply the series with its new files.

    Returns the unpacked wheel folder (holding `sglang/` and the dist-info folder).
    """
    unpack(str(upstream_wheel), str(dest))
    root = dest / f"{pin.package}-{pin.version}"
    apply_series(read_series(), root)
    return root


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
    metadata.write_text(text)
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
