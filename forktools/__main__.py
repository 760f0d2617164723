"""python -m forktools COMMAND: build the fork and maintain its patch series (docs/maintaining.md)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from forktools.review import format_review, review_series
from forktools.series import PatchError, apply_series, read_series
from forktools.tree import export_tree, export_upstream_diffs, open_tree, rebase_tree
from forktools.upstream import UPSTREAM_WHEEL_ENV, UpstreamError, load_pin, obtain_wheel
from forktools.upstream_suite import compare_with_pristine, installed_fork_root
from forktools.wheelbuild import build_wheel


def _wheel_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--upstream-wheel",
        help=f"local pinned upstream wheel, or a folder holding it (default: ${UPSTREAM_WHEEL_ENV}, else pip download)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forktools", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("build", help="build the fork's wheel")
    p.add_argument("-o", "--out-dir", default="dist", type=Path)
    _wheel_arg(p)

    p = sub.add_parser(
        "check", help="apply the series strictly to the pristine pinned upstream"
    )
    _wheel_arg(p)

    p = sub.add_parser(
        "open", help="editable git tree: upstream + one commit per patch"
    )
    p.add_argument("tree", type=Path)
    _wheel_arg(p)

    p = sub.add_parser(
        "export", help="write an edited tree's commits back to patches/ and python/"
    )
    p.add_argument("tree", type=Path)

    p = sub.add_parser(
        "rebase", help="apply the series to another upstream wheel and report"
    )
    p.add_argument("tree", type=Path)
    p.add_argument(
        "--new-wheel", required=True, type=Path, help="the newer upstream wheel file"
    )

    p = sub.add_parser(
        "upstream-diffs", help="one patch per concern for the upstream repository"
    )
    p.add_argument("-o", "--out-dir", default="dist/upstream-patches", type=Path)

    p = sub.add_parser(
        "review",
        help="each upstream diff in order on the pristine tree: git apply, upstream's "
        "formatters on its added lines, its own unit tests",
    )
    p.add_argument("--no-tests", action="store_true", help="apply and check style only")
    _wheel_arg(p)

    p = sub.add_parser(
        "upstream-suite",
        help="upstream's unit tests on the installed fork; a test that passes on the "
        "pristine release and not on the fork fails the run",
    )
    _wheel_arg(p)

    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (PatchError, UpstreamError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    pin = load_pin()
    if args.command == "build":
        print(build_wheel(args.out_dir, args.upstream_wheel))
    elif args.command == "check":
        wheel = obtain_wheel(pin, args.upstream_wheel)
        with tempfile.TemporaryDirectory() as tmp:
            from wheel.cli.unpack import unpack

            unpack(str(wheel), tmp)
            root = Path(tmp) / f"{pin.package}-{pin.version}"
            for patch, changed, added in apply_series(read_series(), root):
                print(
                    f"{patch.name}: applies exactly ({len(changed)} files changed, "
                    f"{len(added)} added)"
                )
        print(f"series OK against {wheel.name}")
    elif args.command == "open":
        patches = open_tree(pin, obtain_wheel(pin, args.upstream_wheel), args.tree)
        print(
            f"{args.tree}: upstream {pin.version} + {len(patches)} commits (tag 'upstream' marks the base)"
        )
    elif args.command == "export":
        for path in export_tree(args.tree):
            print(path)
    elif args.command == "rebase":
        report = rebase_tree(pin, args.new_wheel, args.tree)
        for name, status in report:
            print(f"{name}: {status}")
        failed = [
            name for name, status in report if status.startswith("DOES NOT APPLY")
        ]
        print(
            f"{len(report) - len(failed)} of {len(report)} patches applied; tree at {args.tree}"
        )
        return 1 if failed else 0
    elif args.command == "upstream-diffs":
        for path in export_upstream_diffs(args.out_dir):
            print(path)
    elif args.command == "review":
        wheel = obtain_wheel(pin, args.upstream_wheel)
        with tempfile.TemporaryDirectory() as tmp:
            from wheel.cli.unpack import unpack

            unpack(str(wheel), tmp)
            pristine = Path(tmp) / f"{pin.package}-{pin.version}"
            reviews = review_series(pin, pristine, run_tests=not args.no_tests)
        for review in reviews:
            print(format_review(review))
        return 0 if all(r.ok for r in reviews) else 1
    elif args.command == "upstream-suite":
        wheel = obtain_wheel(pin, args.upstream_wheel)
        with tempfile.TemporaryDirectory() as tmp:
            from wheel.cli.unpack import unpack

            unpack(str(wheel), tmp)
            pristine = Path(tmp) / f"{pin.package}-{pin.version}"
            comparison = compare_with_pristine(installed_fork_root(pin), pristine)
        print(comparison.summary())
        return 1 if comparison.regressions else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
