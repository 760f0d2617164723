"""Upstream's own unit tests against the fork: what passes on the pristine pinned release must pass
on the fork.

The fork's `sglang/multimodal_gen/test/unit/` (upstream's tests plus the series' own) runs first;
the test files with a failure or error there run again on the pristine tree, and a test that passes
on pristine but not on the fork is a regression. Tests that fail on both (no GPU, a package the
environment lacks) are reported as such and are not the fork's doing. Both runs use
HF_HUB_OFFLINE=1: tests that would try the Hub fail or fall back at once instead of after
retries, the same way on both sides.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

UNIT_TESTS = "sglang/multimodal_gen/test/unit"
OK, SKIPPED, FAILED = "passed", "skipped", "failed"


def _outcomes(junit: Path) -> dict[str, str]:
    """test id ("module.Class::name") -> passed / skipped / failed (failures and errors)."""
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        # a module that fails to import: no class, the module as the name
        test_id = f"{case.get('classname') or case.get('name')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcomes[test_id] = FAILED
        elif case.find("skipped") is not None:
            outcomes.setdefault(test_id, SKIPPED)
        else:
            outcomes.setdefault(test_id, OK)
    return outcomes


def _test_file(root: Path, test_id: str) -> str | None:
    """The file under `root` a junit classname belongs to (its longest module prefix)."""
    parts = test_id.split("::")[0].split(".")
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (root / path).is_file():
            return str(path)
    return None


def run_pytest(
    root: Path, targets: list[str], *options: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """pytest on `targets` (paths relative to `root`, the folder holding `sglang/`) with
    `root` first on the path and as the working folder, so that no conftest or rootdir of
    this repository applies."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options]
        + [str(root / t) for t in targets],
        cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root), **(env or {})),
        capture_output=True,
        text=True,
    )


def run_unit_tests(root: Path, targets: list[str], junit: Path) -> dict[str, str]:
    """Each test's outcome, from a pytest run that goes on past modules failing to import."""
    run_pytest(
        root,
        targets,
        "--continue-on-collection-errors",
        f"--junitxml={junit}",
        env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )
    return _outcomes(junit)


@dataclasses.dataclass
class SuiteComparison:
    fork: dict[str, str]
    pristine_rerun: dict[str, str]

    @property
    def regressions(self) -> list[str]:
        """Pass on pristine, fail or go missing (a collection error) on the fork."""
        return sorted(
            test_id
            for test_id, outcome in self.pristine_rerun.items()
            if outcome == OK and self.fork.get(test_id) != OK
        )

    @property
    def failing_on_both(self) -> list[str]:
        return sorted(
            test_id
            for test_id, outcome in self.fork.items()
            if outcome == FAILED and self.pristine_rerun.get(test_id) == FAILED
        )

    def summary(self) -> str:
        counts = {
            o: sum(v == o for v in self.fork.values()) for o in (OK, SKIPPED, FAILED)
        }
        lines = [
            f"fork: {counts[OK]} passed, {counts[SKIPPED]} skipped, {counts[FAILED]} failed "
            f"(failing on pristine too: {len(self.failing_on_both)}); regressions: "
            f"{len(self.regressions)}"
        ]
        lines += [f"  REGRESSION {test_id}" for test_id in self.regressions]
        return "\n".join(lines)


def compare_with_pristine(fork_root: Path, pristine_root: Path) -> SuiteComparison:
    """Run the fork's unit tests, then rerun the files with failures on pristine."""
    with tempfile.TemporaryDirectory() as tmp:
        fork = run_unit_tests(fork_root, [UNIT_TESTS], Path(tmp) / "fork.xml")
        files = sorted(
            {
                path
                for test_id, outcome in fork.items()
                if outcome == FAILED
                and (path := _test_file(fork_root, test_id)) is not None
                and (pristine_root / path).is_file()
            }
        )
        rerun = (
            run_unit_tests(pristine_root, files, Path(tmp) / "pristine.xml")
            if files
            else {}
        )
    return SuiteComparison(fork, rerun)


def installed_fork_root(pin) -> Path:
    """The folder holding this interpreter's `sglang`, which must be the fork."""
    installed = importlib.metadata.version(pin.package)
    if installed != pin.fork_version:
        raise RuntimeError(
            f"{pin.package} {installed} is installed here, not the fork {pin.fork_version}: "
            "pip install the fork first"
        )
    return Path(importlib.util.find_spec(pin.package).origin).parents[1]
