"""The suite's budget, test by test: a test over its time per commit fails, by name.

Registered by tests/conftest.py; `-p tests.slow_guard` loads it anywhere (its own test does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

# The longest a test may take (setup, call and teardown) in `./dev test` unless marked `slow`:
# the suite has a budget, and a test that grows past this is said by name, not found later in
# the total. `--durations` prints the slowest as before. Seconds of a quiet machine: with more
# xdist workers than cores each test gets that much less of one, and the line moves with it;
# `--slow-s` or LLMGW_SLOW_S sets another (on a machine busy with other work).
SLOW_S = 60.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--slow-s",
        type=float,
        default=float(os.environ.get("LLMGW_SLOW_S", SLOW_S)),
        help=f"seconds a test not marked `slow` may take on a quiet core (default {SLOW_S:g}; LLMGW_SLOW_S)",
    )


def slow_limit(seconds: float) -> float:
    """`seconds` of a quiet core, as long as each test has one: more with more workers than cores."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return seconds * max(1.0, workers / (os.cpu_count() or 1))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    """Fail a test whose phases took over its `slow_limit` together, unless it is marked `slow`,
    `soak` (whose length each test sets) or runs a real engine or container: reported at the
    phase that crossed the line, with its figures."""
    report: pytest.TestReport = yield
    spent = item.stash.setdefault(_SPENT, 0.0) + report.duration
    item.stash[_SPENT] = spent
    exempt = any(item.get_closest_marker(name) for name in _EXEMPT)
    limit = slow_limit(item.config.getoption("--slow-s"))
    said = item.stash.get(_SAID, False)  # over its time, or failed on its own: said once
    item.stash[_SAID] = said or report.failed
    if spent > limit and not exempt and report.passed and not said:
        item.stash[_SAID] = True
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} took {spent:.1f} s (up to its {report.when}), over the {limit:g} s a test may "
            "take per commit: make it quicker (a clock seam, the in-process control plane, a shared "
            "fixture), or mark it `slow` and say why"
        )
    return report


# Real engines and containers load torch, a model or an image: their time is theirs.
_EXEMPT = ("slow", "soak", "real_vllm", "real_ray", "containers")
_SPENT = pytest.StashKey[float]()
_SAID = pytest.StashKey[bool]()
