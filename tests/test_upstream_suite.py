"""Upstream's own unit suite stays green: every test of sglang/multimodal_gen/test/unit that passes on
the pristine pinned release passes on the installed fork, and so does every test there that only
the fork has (`python -m forktools upstream-suite`, which
tests/conftest.py starts when this test is collected, so that it runs beside the other tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from forktools.upstream_suite import (
    UNIT_TESTS,
    _outcomes,
    compare_with_pristine,
    forked_pytest,
    run_pytest,
)
from tests.conftest import background_output


@pytest.mark.slow
def test_no_upstream_test_regresses(request):
    returncode, output = background_output(request.config, "upstream-suite")
    print(output)
    assert returncode == 0, output
    summary = re.search(r"^fork: (\d+) passed, .* regressions: 0$", output, re.M)
    assert summary and int(summary[1]) > 4000, output  # the whole suite ran


def _unit_tests(root: Path, files: dict[str, str]) -> Path:
    """A stand-in package tree holding `files` (name -> source) as its unit tests."""
    tests = root / UNIT_TESTS
    tests.mkdir(parents=True)
    for name, text in files.items():
        (tests / name).write_text(text)
    return root


def test_a_regression_passes_on_pristine_or_is_the_forks_own(tmp_path):
    """The comparison on two stand-in trees: failing on both is counted, not a regression;
    failing (or not importing) only on the fork is one; so is a failing test that only the
    fork has (in a file of its own, or added to one of upstream's: pristine's rerun runs on
    without it), and the fork's own passing tests are not."""
    passes = "def test_{}():\n    pass\n".format
    fails = "def test_{}():\n    assert False\n".format
    pristine = _unit_tests(
        tmp_path / "pristine",
        {
            "test_a.py": passes("ok") + fails("bad") + passes("broken"),
            "test_b.py": passes("ok"),
        },
    )
    fork = _unit_tests(
        tmp_path / "fork",
        {
            "test_a.py": passes("ok") + fails("bad") + fails("broken") + fails("added"),
            "test_b.py": "import not_a_module\n" + passes("ok"),
            "test_new.py": passes("new_ok") + fails("new"),
        },
    )
    comparison = compare_with_pristine(fork, pristine)
    module = UNIT_TESTS.replace("/", ".")
    assert comparison.regressions == [
        f"{module}.test_a::test_added",
        f"{module}.test_a::test_broken",
        f"{module}.test_b::test_ok",
        f"{module}.test_new::test_new",
    ]
    assert comparison.failing_on_both == [f"{module}.test_a::test_bad"]
    assert comparison.fork_only == [
        f"{module}.test_a::test_added",
        f"{module}.test_new::test_new",
    ]
    assert "pristine lacking: 2); regressions: 4" in comparison.summary()


RECORDS_ITS_PROCESS = """import json, os, sys


def test_records_its_process():
    record = dict(cwd=os.getcwd(), path=sys.path, argv=sys.argv, env=dict(os.environ))
    with open(os.path.join(os.environ["RECORD_DIR"], "record.json"), "w") as f:
        json.dump(record, f)


def test_fails():
    assert False
"""


def test_a_forked_pytest_run_is_a_fresh_one(tmp_path, monkeypatch):
    """forked_pytest (forktools review's runs) against run_pytest on a stand-in tree: the same
    exit status, outcomes, working directory, sys.path, sys.argv and environment."""
    root = _unit_tests(tmp_path / "tree", {"test_process.py": RECORDS_ITS_PROCESS})
    monkeypatch.setenv("RECORD_DIR", str(tmp_path))
    record, junit = tmp_path / "record.json", tmp_path / "junit.xml"
    runs = {}
    with forked_pytest(preload=("pytest",)) as forked:
        for name, run in (("fresh", run_pytest), ("forked", forked)):
            result = run(root, [UNIT_TESTS], f"--junitxml={junit}")
            assert "1 failed, 1 passed" in result.stdout, result.stdout
            runs[name] = (
                result.returncode,
                _outcomes(junit),
                json.loads(record.read_text()),
            )
            record.unlink()
    assert runs["forked"] == runs["fresh"]
    assert runs["fresh"][0] == 1
