"""Upstream's own unit suite stays green: every test of sglang/multimodal_gen/test/unit that passes on
the pristine pinned release passes on the installed fork (forktools/upstream_suite.py; the slowest
test of the run, about ten minutes on two cores)."""

from __future__ import annotations

import pytest

from forktools.upstream_suite import compare_with_pristine, installed_fork_root

pytestmark = pytest.mark.slow


def test_no_upstream_test_regresses(pin, pristine_package):
    comparison = compare_with_pristine(installed_fork_root(pin), pristine_package)
    print(comparison.summary())
    assert len(comparison.fork) > 4000  # the whole suite ran
    assert comparison.regressions == [], comparison.summary()
