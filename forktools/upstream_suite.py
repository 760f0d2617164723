"""Upstream's own unit tests against the fork: what passes on the pristine pinned release must pass
on the fork.

The fork's `sglang/multimodal_gen/test/unit/` (upstream's tests plus the series' own) runs first.
The tests that failed there (whole modules where one failed to import) run again on the pristine
tree, and those that pass there run again on the fork, as one selection (usually none: a rerun of
the same selection on both sides keeps order effects out of the comparison, and only a test that
passes on pristine can be a regression); a test that passes on pristine but not in the fork's rerun
is a regression. Tests that fail on both (no GPU, a package the environment lacks) are counted and
not the fork's doing. All runs use HF_HUB_OFFLINE=1: tests that would try the Hub fail or fall back
at once instead of after retries, the same way on both sides.
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


def _rerun_target(root: Path, test_id: str) -> str | None:
    """What pytest takes to run `test_id` again under `root`: its node id, or the file of a
    module that failed to import. None if `root` has no such file."""
    module, _, name = test_id.partition("::")
    parts = [part for part in module.split(".") if part]
    for end in range(len(parts), 0, -1):
        path = Path(*parts[:end]).with_suffix(".py")
        if (root / path).is_file():
            if end == len(parts) and name == module:  # the module failed to import
                return str(path)
            return "::".join([str(path), *parts[end:], name])
    return None


def pytest_command(
    root: Path, targets: list[str], *options: str
) -> tuple[list[str], dict[str, str]]:
    """pytest on `targets` (paths relative to `root`, the folder holding `sglang/`) with
    `root` first on the path and as the rootdir, to run from `root`: the command and its
    environment. No configuration file applies (this repository's pyproject.toml would, for
    an environment inside the checkout), so test ids are the same for every root."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-c", os.devnull, f"--rootdir={root}", *options]
    return command + [str(root / t) for t in targets], dict(
        os.environ, PYTHONPATH=str(root)
    )


def run_pytest(root: Path, targets: list[str]) -> subprocess.CompletedProcess:
    command, env = pytest_command(root, targets)
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)


def _start_unit_tests(root: Path, targets: list[str], junit: Path) -> subprocess.Popen:
    """A pytest run that goes on past modules failing to import and writes each test's
    outcome to `junit`."""
    options = ["--continue-on-collection-errors", f"--junitxml={junit}"]
    command, env = pytest_command(root, targets, *options)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@dataclasses.dataclass
class SuiteComparison:
    fork: dict[str, str]  # the whole suite
    pristine_rerun: dict[str, str]  # the tests that failed there, on pristine
    fork_rerun: dict[str, str]  # those that pass on pristine, again on the fork

    @property
    def regressions(self) -> list[str]:
        """Pass on pristine, fail or go missing (a collection error) on the fork."""
        return sorted(
            test_id
            for test_id, outcome in self.pristine_rerun.items()
            if outcome == OK and self.fork_rerun.get(test_id) != OK
        )

    @property
    def failing_on_both(self) -> list[str]:
        """Failed in the fork's suite and on pristine."""
        return sorted(
            test_id
            for test_id, outcome in self.pristine_rerun.items()
            if outcome == FAILED
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
    """Run the fork's unit tests, the failed ones on pristine, and those that pass there on
    the fork again."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = {
            name: Path(tmp) / f"{name}.xml" for name in ("fork", "rerun", "pristine")
        }
        _start_unit_tests(fork_root, [UNIT_TESTS], junit["fork"]).wait()
        fork = _outcomes(junit["fork"])
        targets = _rerun_targets(fork, FAILED, fork_root, also_under=pristine_root)
        if not targets:
            return SuiteComparison(fork, {}, {})
        _start_unit_tests(pristine_root, targets, junit["pristine"]).wait()
        pristine = _outcomes(junit["pristine"])
        # where the fork lacks a test's file, it is missing there: a regression without a rerun
        targets = _rerun_targets(pristine, OK, fork_root)
        if not targets:
            return SuiteComparison(fork, pristine, {})
        _start_unit_tests(fork_root, targets, junit["rerun"]).wait()
        return SuiteComparison(fork, pristine, _outcomes(junit["rerun"]))


def _rerun_targets(
    outcomes: dict[str, str], outcome: str, root: Path, also_under: Path | None = None
) -> list[str]:
    """What pytest takes to run the tests of `outcomes` that had `outcome` again under
    `root` (and `also_under`, where that has their files too)."""
    return sorted(
        {
            target
            for test_id, had in outcomes.items()
            if had == outcome
            and (target := _rerun_target(root, test_id)) is not None
            and (also_under is None or (also_under / target.split("::")[0]).is_file())
        }
    )


def installed_fork_root(pin) -> Path:
    """The folder holding this interpreter's `sglang`, which must be the fork."""
    installed = importlib.metadata.version(pin.package)
    if installed != pin.fork_version:
        raise RuntimeError(
            f"{pin.package} {installed} is installed here, not the fork {pin.fork_version}: "
            "pip install the fork first"
        )
    return Path(importlib.util.find_spec(pin.package).origin).parents[1]
