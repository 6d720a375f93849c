"""The usage tally placement keeps for its page and `/api/usage`: summed as `ctl usage` sums the
same records, and only over the last 24 h."""

from __future__ import annotations

import msgspec

from llmgw.ctl._keys import summed
from llmgw_core.keys import UsageRecord
from llmgw_placement.usage import WINDOW_S, UsageWindow

NOW = 1_800_000_000.0


def record(key: str, deployment: str, prompt: int, completion: int, requests: int, at: float) -> UsageRecord:
    return UsageRecord(
        key=key,
        deployment=deployment,
        prompt_tokens=prompt,
        completion_tokens=completion,
        requests=requests,
        start=at - 1,
        end=at,
    )


def test_the_tally_sums_as_ctl_usage_does_and_forgets_what_is_older_than_a_day() -> None:
    recent = [
        record("a", "chat", 4, 5, 1, NOW - 10),
        record("a", "chat", 8, 10, 2, NOW - 3600),
        record("b", "chat", 1, 1, 1, NOW - 60),
        record("b", "other", 3, 2, 1, NOW - WINDOW_S + 120),
    ]
    stale = record("a", "chat", 100, 100, 100, NOW - WINDOW_S - 120)
    window = UsageWindow(bus=None)  # type: ignore[arg-type]
    # Read an hour ago, the stale record was still in the window; it leaves the totals since.
    for r in [stale, *recent]:
        window.add(r, now=NOW - 3600)
    # Read now, a record older than a day is not counted at all.
    window.add(stale, now=NOW)
    for by in ("", "key", "deployment"):
        assert msgspec.to_builtins(window.rows(by, now=NOW)) == msgspec.to_builtins(summed(recent, by))
    assert [(r.key, r.deployment, r.prompt_tokens, r.requests) for r in window.rows(now=NOW)] == [
        ("a", "chat", 12, 3),
        ("b", "chat", 1, 1),
        ("b", "other", 3, 1),
    ]
    # A day later still, nothing is left.
    assert window.rows(now=NOW + WINDOW_S + 120) == []
