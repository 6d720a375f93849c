"""A shard's failure as fields, and the words every reader shows for it."""

from __future__ import annotations

import signal

from llmgw_core import failures
from llmgw_core.events import ReplicaRecord, ShardFailure, ShardStatus

CRASH = ShardFailure(
    reason="sim (pid 7) exited with code 42",
    exit=42,
    log_tail=("llmgw-sim: serving", "llmgw-sim: exiting with code 42"),
    attempt=3,
    at=5.0,
)


def status(**kw: object) -> ShardStatus:
    return ShardStatus(node="n", shard="s", replica="r0", state="failed", **kw)  # type: ignore[arg-type]


def test_the_text_form_is_the_reason_then_the_attempts_log_lines() -> None:
    assert failures.text(CRASH) == (
        "sim (pid 7) exited with code 42; last log lines:\n"
        "llmgw-sim: serving\n"
        "llmgw-sim: exiting with code 42"
    )
    assert failures.text(ShardFailure(reason="no health answer within 1 s")) == "no health answer within 1 s"
    assert failures.text(None) == failures.summary(None) == ""


def test_details_name_the_attempt_and_the_exit_in_words() -> None:
    assert failures.details(CRASH) == "attempt 3, exit code 42"
    killed = ShardFailure(reason="x", exit=-signal.SIGKILL, attempt=1)
    assert failures.details(killed) == "attempt 1, killed by SIGKILL"
    assert failures.details(ShardFailure(reason="x", exit=-200)) == "killed by signal 200"
    assert failures.details(ShardFailure(reason="x")) == ""


def test_a_retry_names_its_attempt_and_the_last_failure_in_one_line() -> None:
    assert failures.retrying(4, CRASH) == "attempt 4; last: sim (pid 7) exited with code 42"


def test_a_failed_shards_reason_line_comes_from_its_fields() -> None:
    s = status(reason=failures.text(CRASH), last_failure=failures.text(CRASH), failure=CRASH)
    assert failures.reason_line(s) == "sim (pid 7) exited with code 42"
    assert failures.failure_of(s) is CRASH


def test_a_writer_that_predates_the_fields_is_read_from_its_text() -> None:
    """Only here is a failure's text read back: for a launcher or placement that wrote no fields."""
    old = status(reason=failures.text(CRASH), last_failure=failures.text(CRASH), last_failure_at=5.0)
    assert failures.reason_line(old) == "sim (pid 7) exited with code 42"
    assert failures.failure_of(old) == ShardFailure(reason=CRASH.reason, log_tail=CRASH.log_tail, at=5.0)
    record = ReplicaRecord(
        deployment="d", replica="r0", profile="p", profile_fp="f", state="degraded", last_failure="killed"
    )
    assert failures.failure_of(record) == ShardFailure(reason="killed")
    assert failures.failure_of(status()) is None
