"""Upstream's own unit tests against the fork: what passes on the pristine pinned release must pass
on the fork, and the fork's own tests (the series') must pass there.

The fork's `sglang/multimodal_gen/test/unit/` (upstream's tests plus the series' own) runs first.
The tests that failed there (whole modules where one failed to import) run again on the pristine
tree, and those that pass there run again on the fork, as one selection (usually none: a rerun of
the same selection on both sides keeps order effects out of the comparison); a test that passes on
pristine but not in the fork's rerun is a regression. Tests that fail on both (no GPU, a package
the environment lacks) are counted and not the fork's doing. A test that failed in the fork's
suite and that pristine lacks (its file, or the test in its file) is the fork's own: nothing on
pristine can excuse it, and it is a regression too (e.g. a later patch breaking an earlier
patch's tests, which `forktools review` runs only with the patches up to their own). All runs use
HF_HUB_OFFLINE=1: tests that would try the Hub fail or fall back at once instead of after
retries, the same way on both sides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
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


def run_pytest(
    root: Path, targets: list[str], *options: str
) -> subprocess.CompletedProcess:
    command, env = pytest_command(root, targets, *options)
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)


FORK_SERVER = Path(__file__).with_name("pytest_fork_server.py")
FRESH_PYTEST_ENV = "FORKTOOLS_FRESH_PYTEST"


@contextlib.contextmanager
def forked_pytest(
    preload: tuple[str, ...] = (),
) -> Iterator[Callable[..., subprocess.CompletedProcess]]:
    """`run_pytest`, each run forked from one process that imported torch, transformers,
    diffusers, PEFT and pytest once (pytest_fork_server.py; `preload`: those modules
    instead): the same run as a fresh process, without ~9 CPU-seconds of imports; its stdout
    holds stderr too. With FORKTOOLS_FRESH_PYTEST=1 in the environment, plain `run_pytest`.
    """
    if os.environ.get(FRESH_PYTEST_ENV) == "1":
        yield run_pytest
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    server = subprocess.Popen(
        [sys.executable, str(FORK_SERVER), *preload],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )

    def run(
        root: Path, targets: list[str], *options: str
    ) -> subprocess.CompletedProcess:
        command, env = pytest_command(root, targets, *options)
        with tempfile.NamedTemporaryFile(suffix=".out") as output:
            request = dict(cwd=str(root), env=env, args=command[3:], output=output.name)
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            reply = server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the pytest fork server exited ({server.wait()})")
            text = Path(output.name).read_text(errors="replace")
        return subprocess.CompletedProcess(
            command, json.loads(reply)["returncode"], text, ""
        )

    try:
        yield run
    finally:
        server.stdin.close()
        server.wait()


SELECT_PLUGIN_DIR = Path(__file__).with_name("pytest_plugins")


def _start_unit_tests(
    root: Path, targets: list[str], junit: Path, select: Path | None = None
) -> subprocess.Popen:
    """A pytest run that goes on past modules failing to import and writes each test's
    outcome to `junit`; with `select`, only the tests of `targets` (files) that the file
    `select` names (forktools_select)."""
    options = ["--continue-on-collection-errors", f"--junitxml={junit}"]
    if select is not None:
        options += ["-p", "forktools_select"]
    command, env = pytest_command(root, targets, *options)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if select is not None:
        env.update(
            FORKTOOLS_SELECT=str(select),
            PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(SELECT_PLUGIN_DIR)]),
        )
    return subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


@dataclasses.dataclass
class SuiteComparison:
    fork: dict[str, str]  # the whole suite
    pristine_rerun: dict[str, str]  # the tests that failed there, on pristine
    fork_rerun: dict[str, str]  # those that pass on pristine, again on the fork
    # failed in the fork's suite, and pristine lacks them
    fork_only: list[str] = dataclasses.field(default_factory=list)

    @property
    def regressions(self) -> list[str]:
        """Pass on pristine, fail or go missing (a collection error) on the fork; or only
        the fork has them and they failed in its suite."""
        return sorted(
            [
                test_id
                for test_id, outcome in self.pristine_rerun.items()
                if outcome == OK and self.fork_rerun.get(test_id) != OK
            ]
            + self.fork_only
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
            f"(failing on pristine too: {len(self.failing_on_both)}; pristine lacking: "
            f"{len(self.fork_only)}); regressions: {len(self.regressions)}"
        ]
        lines += [f"  REGRESSION {test_id}" for test_id in self.regressions]
        return "\n".join(lines)


def compare_with_pristine(fork_root: Path, pristine_root: Path) -> SuiteComparison:
    """Run the fork's unit tests, the failed ones on pristine, and those that pass there on
    the fork again."""
    with tempfile.TemporaryDirectory() as tmp:
        fork = _run_unit_tests(fork_root, None, Path(tmp) / "fork")
        failed = [test_id for test_id, had in fork.items() if had == FAILED]
        # where pristine lacks a failed test's file, only the fork has the test
        on_pristine = {
            test_id: target
            for test_id in failed
            if (target := _rerun_target(fork_root, test_id)) is not None
            and (pristine_root / target.split("::")[0]).is_file()
        }
        pristine = _run_unit_tests(
            pristine_root, on_pristine.values(), Path(tmp) / "pristine"
        )
        fork_only = [
            test_id
            for test_id in failed
            if test_id not in on_pristine
            or not _had(pristine, test_id, on_pristine[test_id])
        ]
        # where the fork lacks a test, it is missing there: a regression without a rerun
        again = [
            target
            for test_id, had in pristine.items()
            if had == OK and (target := _rerun_target(fork_root, test_id))
        ]
        rerun = _run_unit_tests(fork_root, again, Path(tmp) / "rerun")
        return SuiteComparison(fork, pristine, rerun, sorted(fork_only))


def _run_unit_tests(root: Path, selection, files: Path) -> dict[str, str]:
    """The outcomes of the unit tests under `root`: all of them (`selection` None), else
    those `selection` names (node ids, or test files for all their tests), where a name the
    tree lacks selects nothing. `files`: the stem of the run's files."""
    junit = files.with_suffix(".xml")
    if selection is None:
        _start_unit_tests(root, [UNIT_TESTS], junit).wait()
        return _outcomes(junit)
    selection = sorted(set(selection))
    if not selection:
        return {}
    select = files.with_suffix(".select")
    select.write_text("\n".join(selection) + "\n")
    targets = sorted({target.split("::")[0] for target in selection})
    _start_unit_tests(root, targets, junit, select).wait()
    return _outcomes(junit)


def _had(outcomes: dict[str, str], test_id: str, target: str) -> bool:
    """Whether a run of `target` (`test_id`'s rerun target) with `outcomes` had the test:
    the test itself, or its module failing to import; for a module that failed to import
    in the fork's suite (the whole file as target), any of its tests."""
    file = target.split("::")[0]
    module = file.removesuffix(".py").replace("/", ".")
    if target != file:
        return test_id in outcomes or f"{module}::{module}" in outcomes
    return any(
        (name := had.split("::")[0]) == module or name.startswith(module + ".")
        for had in outcomes
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
