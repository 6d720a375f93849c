"""The per-test time guard (tests/slow_guard.py) fails what it should and only that."""

from __future__ import annotations

import re

import pytest

pytest_plugins = ["pytester"]

TESTS = """
import time

import pytest


def test_quick():
    pass


def test_over_its_time():
    time.sleep(0.4)


@pytest.mark.slow
def test_marked_slow():
    time.sleep(0.4)


@pytest.fixture
def slow_setup():
    time.sleep(0.25)
    yield
    time.sleep(0.25)


def test_over_its_time_in_setup_and_teardown(slow_setup):
    pass


def test_that_fails_on_its_own():
    time.sleep(0.4)
    assert False, "its own failure"
"""


def test_a_test_over_its_time_fails_by_name_unless_marked_slow(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    pytester.makepyfile(test_timed=TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    slow: may take long\n")
    result = pytester.runpytest_inprocess("-p", "tests.slow_guard", "-p", "no:cacheprovider", "--slow-s=0.3")
    outcomes = {r.nodeid.split("::")[1]: (r.when, r.outcome) for r in _reports(result) if r.failed}
    assert outcomes == {
        "test_over_its_time": ("call", "failed"),
        "test_over_its_time_in_setup_and_teardown": ("teardown", "failed"),
        "test_that_fails_on_its_own": ("call", "failed"),
    }
    text = result.stdout.str()
    said = r"test_timed.py::test_over_its_time took \d+\.\d s \(up to its call\), over the 0.3 s"
    assert re.search(said, text), text
    assert "its own failure" in text
    result.assert_outcomes(passed=3, failed=2, errors=1)


def test_the_limit_grows_with_more_workers_than_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import slow_guard

    monkeypatch.setattr(slow_guard.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    assert slow_guard.slow_limit(60) == 90.0
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert slow_guard.slow_limit(60) == 60.0
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert slow_guard.slow_limit(60) == 60.0


def _reports(result: pytest.RunResult) -> list[pytest.TestReport]:
    return [r for r in result.reprec.getreports("pytest_runtest_logreport")]  # type: ignore[attr-defined]
