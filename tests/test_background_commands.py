"""tests/conftest.py starts a background command (BACKGROUND_COMMANDS) only for a test that will
run: after -k and --deselect, and none under --collect-only."""

from __future__ import annotations

import pytest

import tests.conftest as shared


@pytest.mark.parametrize(
    "options, started",
    [
        ([], ["a", "b"]),
        # test_a is collected, then deselected: its command stays off
        (["-k", "test_b"], ["b"]),
        (["--deselect", "test_ab.py::test_b"], ["a"]),
        (["--collect-only"], []),
    ],
)
def test_background_commands_start_for_the_selected_tests(
    pytester, monkeypatch, options, started
):
    monkeypatch.setattr(shared, "BACKGROUND_COMMANDS", {"test_a": "a", "test_b": "b"})
    calls = []
    monkeypatch.setattr(shared, "start_background", calls.append)
    pytester.makeconftest("from tests.conftest import pytest_collection_finish\n")
    pytester.makepyfile(test_ab="def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    pytester.runpytest_inprocess("-p", "no:cacheprovider", *options)
    assert sorted(calls) == started
