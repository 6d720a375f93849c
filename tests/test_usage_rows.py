"""One `UsageRow`: what `llmgw ctl usage` prints from the stream and what the cluster page's
`/api/usage` answers from its running tally are one type, summed alike.

Regression: the row was defined twice (ctl's and placement's), free to drift apart."""

from __future__ import annotations

import pytest

from llmgw.ctl._keys import summed
from llmgw_core.bus import Bus
from llmgw_core.keys import UsageRecord, UsageRow
from llmgw_placement.usage import UsageWindow

NOW = 1_700_000_000.0


@pytest.mark.parametrize("by", ["", "key", "deployment"])
def test_ctl_and_the_page_sum_the_same_records_into_the_same_rows(by: str) -> None:
    records = [
        UsageRecord(
            key="alice", deployment="chat", prompt_tokens=10, completion_tokens=5, requests=1, end=NOW - 60
        ),
        UsageRecord(
            key="alice", deployment="code", prompt_tokens=7, completion_tokens=1, requests=2, end=NOW - 30
        ),
        UsageRecord(
            key="bob", deployment="chat", prompt_tokens=3, completion_tokens=2, requests=1, end=NOW - 10
        ),
    ]
    window = UsageWindow(Bus.__new__(Bus))  # the tally alone: it reads no stream here
    for record in records:
        window.add(record, now=NOW)
    page = window.rows(by, now=NOW)
    assert page == summed(records, by)
    assert all(type(row) is UsageRow for row in page)
