"""The series as upstream reviewers get it: each exported diff applied with `git apply`, in order,
to the pristine pinned tree; upstream's formatters on the lines it adds; its own unit tests run
against the tree holding it and its predecessors, and nothing later."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import subprocess
import tempfile
from pathlib import Path

from forktools.series import UPSTREAM_PREFIX, Patch, read_series, upstream_path
from forktools.style import style_problems
from forktools.tree import TREE_PACKAGE_DIR, export_upstream_diffs
from forktools.upstream import Pin
from forktools.upstream_suite import forked_pytest

UNIT_TESTS = "python/sglang/multimodal_gen/test/unit/"


@dataclasses.dataclass
class PatchReview:
    name: str
    applies: str  # "" when `git apply` took it, else git's message
    style: list[str]
    tests: list[str]  # the patch's own test files (upstream paths)
    test_output: str = ""
    tests_passed: bool | None = None  # None: not run

    @property
    def ok(self) -> bool:
        return not self.applies and not self.style and self.tests_passed is not False


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", "-c", "core.autocrlf=false", *args],
        cwd=repo,
        capture_output=True,
        text=True,
    )


def _touched(diff_path: Path) -> list[str]:
    import unidiff

    return [
        upstream_path(f.target_file)
        for f in unidiff.PatchSet(diff_path.read_text())
        if not f.is_removed_file
    ]


def _run_tests(run_pytest, repo: Path, tests: list[str]) -> tuple[bool, str]:
    result = run_pytest(
        repo / TREE_PACKAGE_DIR, [t.removeprefix(UPSTREAM_PREFIX) for t in tests]
    )
    return result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def review_series(
    pin: Pin, pristine_package: Path, run_tests: bool = True
) -> list[PatchReview]:
    """Review every patch of the series in order against a copy of `pristine_package` (the
    unpacked pinned wheel, holding `sglang/`)."""
    reviews = []
    patches: list[Patch] = read_series()
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        run_pytest = stack.enter_context(forked_pytest()) if run_tests else None
        repo = Path(tmp) / "upstream"
        shutil.copytree(
            pristine_package / pin.package, repo / TREE_PACKAGE_DIR / pin.package
        )
        _git(repo, "init", "-q")
        for patch, diff_path in zip(
            patches, export_upstream_diffs(Path(tmp) / "diffs")
        ):
            touched = _touched(diff_path)
            before = {
                rel: (repo / rel).read_text() if (repo / rel).exists() else None
                for rel in touched
            }
            applied = _git(repo, "apply", str(diff_path))
            review = PatchReview(
                patch.name,
                applies=(
                    (applied.stderr.strip() or "failed") if applied.returncode else ""
                ),
                style=[],
                tests=sorted(t for t in touched if t.startswith(UNIT_TESTS)),
            )
            reviews.append(review)
            if review.applies:
                break  # later diffs build on this one
            for rel in touched:
                review.style += style_problems(
                    rel, before[rel], (repo / rel).read_text()
                )
            if run_tests and review.tests:
                review.tests_passed, review.test_output = _run_tests(
                    run_pytest, repo, review.tests
                )
    return reviews


def format_review(review: PatchReview) -> str:
    lines = [f"{review.name}: {'OK' if review.ok else 'PROBLEMS'}"]
    if review.applies:
        lines.append(f"  git apply: {review.applies}")
    lines += [f"  style: {problem}" for problem in review.style]
    tests = ", ".join(t.removeprefix(UNIT_TESTS) for t in review.tests) or "none"
    status = {None: "not run", True: "passed", False: "FAILED"}[review.tests_passed]
    lines.append(f"  tests ({tests}): {status}")
    if review.tests_passed is False:
        lines.append(review.test_output)
    return "\n".join(lines)
