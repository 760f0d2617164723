"""Upstream's own unit suite stays green: every test of sglang/multimodal_gen/test/unit that passes on
the pristine pinned release passes on the installed fork (`python -m forktools upstream-suite`, which
tests/conftest.py starts when this test is collected, so that it runs beside the other tests)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import background_output

pytestmark = pytest.mark.slow


def test_no_upstream_test_regresses(request):
    returncode, output = background_output(request.config, "upstream-suite")
    print(output)
    assert returncode == 0, output
    summary = re.search(r"^fork: (\d+) passed, .* regressions: 0$", output, re.M)
    assert summary and int(summary[1]) > 4000, output  # the whole suite ran
