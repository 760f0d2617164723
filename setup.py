"""PEP 517 build backend of sglang-train-parity (see pyproject.toml's `build-backend`).

`pip install .` builds the fork's wheel from the pinned upstream sglang wheel (patches/upstream.toml),
the patch series (patches/series) and the new files under python/; forktools/wheelbuild.py does the work.
Build offline with `SGLANG_TP_UPSTREAM_WHEEL=<wheel or folder> pip install --no-build-isolation .` or
`pip install . --config-settings upstream-wheel=<wheel or folder>`.
"""

from pathlib import Path

from forktools.upstream import UPSTREAM_WHEEL_ENV

UPSTREAM_WHEEL_SETTING = "upstream-wheel"


def get_requires_for_build_wheel(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    from forktools.wheelbuild import build_wheel as build

    source = (config_settings or {}).get(UPSTREAM_WHEEL_SETTING)
    return build(Path(wheel_directory), source).name


if __name__ == "__main__":
    raise SystemExit(
        "setup.py is this project's PEP 517 backend: run `pip install .` or "
        f"`python -m forktools build` (offline: set {UPSTREAM_WHEEL_ENV})"
    )
