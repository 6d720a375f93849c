"""Replicas judged by their answers: the gateways' `Judgement`s as placement hears them, and
what placement makes of them.

An engine whose GPU faulted answers `/health` 200 and every completion 500: its launcher
says `ready`, and only the gateways see its answers fail. Each gateway tells placement, with
each demand report, the replicas that failed its requests in its outlier window, whether it
judges each failing, and the engine's own words (`gateway/outliers.py`). Every placement,
leading or standing by, keeps each gateway's latest report (`JudgedBook.heard`), dropped once
older than `stale_intervals` of its own interval, and sums them per replica as demand is
summed (two gateways that each saw 6 of 6 fail: 12 of 12).

A replica any fresh report judges failing is marked unhealthy (`JudgedBook.mark`), in words
frozen when it was marked (`unhealthy: 12 of 12 requests failed in 8 s: 500 CUDA error: an
illegal memory access was encountered`), and the mark holds until the replica is gone or a
gateway reports it answering again without a failure: once marked, gateways stop sending it
requests, so the absence of failures says nothing. The control step then writes the replica
`degraded` with those words (`judged`): every surface (the summary, `ctl get`/`describe`,
`explain`, the page, the gateway's 503) says so, and no gateway routes to it. After
`unhealthy_restart_s` marked, the step restarts it by the path that replaces a replica whose
node cannot run it any more: removed (`failed`, `restarted: unhealthy for 60 s: …`) and placed
again (`restart_words`).

A report is read as a hostile gateway identity could write it: its message type bounds every
field (counts, the words' length, the replicas named); here its interval is clamped as a
demand report's is, the words are made one printable line, a replica named by no name a
deployment or replica can have is dropped, and at most `GATEWAYS_MAX` gateways are heard.
Times are this placement's monotonic clock, when a report was heard.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import anyio
import anyio.abc
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.events import Judgement, ReplicaJudgement, ReplicaRecord
from llmgw_core.limits import DEMAND_INTERVAL_MAX_S, TOKEN_PATTERN
from llmgw_core.subjects import ONE, Names

from .demand import GATEWAYS_MAX, INTERVAL_MIN_S

log = logging.getLogger("llmgw.placement")

# The words of a replica marked unhealthy begin so: the mark is told apart from a shard's failure.
UNHEALTHY = "unhealthy: "
_NAME = re.compile(TOKEN_PATTERN)


def one_line(text: str) -> str:
    """`text` as one printable line (a gateway's words may hold anything)."""
    return " ".join("".join(c if c.isprintable() else " " for c in text).split())


def bounded(report: Judgement) -> Judgement:
    """`report` with its interval clamped, its words one line, and the rows that name no
    replica (a bad name, or one named twice) dropped."""
    interval = report.interval_s
    if not math.isfinite(interval) or interval > DEMAND_INTERVAL_MAX_S:
        interval = DEMAND_INTERVAL_MAX_S
    interval = max(interval, INTERVAL_MIN_S)
    rows: list[ReplicaJudgement] = []
    seen: set[tuple[str, str]] = set()
    for r in report.replicas:
        name = (r.deployment, r.replica)
        if name in seen or not _NAME.match(r.deployment) or not _NAME.match(r.replica):
            continue
        seen.add(name)
        words = one_line(r.words)
        rows.append(r if words == r.words else msgspec.structs.replace(r, words=words))
    return msgspec.structs.replace(report, interval_s=interval, replicas=tuple(rows))


@dataclass(frozen=True)
class Verdict:
    """One replica's judgement summed over the fresh reports."""

    requests: int = 0
    failed: int = 0
    failing_for_s: float = 0.0
    failing: bool = False
    status: int = 0
    words: str = ""

    def text(self) -> str:
        """`unhealthy: 12 of 12 requests failed in 8 s: 500 CUDA error: …`"""
        last = f"{self.status} {self.words}" if self.status else f"no answer: {self.words}"
        return (
            f"{UNHEALTHY}{self.failed} of {self.requests} requests failed in "
            f"{self.failing_for_s:.0f} s: {last}"
        )


@dataclass(frozen=True)
class Marked:
    """A replica marked unhealthy: since when (this placement's clock), and in what words."""

    since: float
    words: str


@dataclass
class JudgedBook:
    stale_intervals: float = 3.0
    # Each gateway's latest report, and when it was heard.
    reports: dict[str, tuple[Judgement, float]] = field(default_factory=dict)
    # Replicas marked unhealthy, by key (`<deployment>.<replica>`).
    marked: dict[str, Marked] = field(default_factory=dict)

    def heard(self, report: Judgement, at: float) -> bool:
        """Keep `report`, bounded, as its gateway's latest; False when GATEWAYS_MAX others are
        heard already."""
        gateway = report.gateway
        if gateway not in self.reports and len(self.reports) >= GATEWAYS_MAX:
            self.fresh(at)
            if len(self.reports) >= GATEWAYS_MAX:
                return False
        self.reports[gateway] = (bounded(report), at)
        return True

    def fresh(self, at: float) -> list[Judgement]:
        """The reports not yet stale, by gateway; stale ones are forgotten."""
        for gateway, (report, heard) in list(self.reports.items()):
            if at - heard > self.stale_intervals * report.interval_s:
                del self.reports[gateway]
        return [self.reports[g][0] for g in sorted(self.reports)]

    def verdicts(self, at: float) -> dict[str, Verdict]:
        """Per replica key, the fresh reports summed: counts added, the longest failing time,
        failing where any gateway judges it so, and the words of the latest report's failure."""
        out: dict[str, Verdict] = {}
        latest: dict[str, float] = {}
        for report in self.fresh(at):
            for r in report.replicas:
                k = Names.replica_key(r.deployment, r.replica)
                v = out.get(k, Verdict())
                words, status = v.words, v.status
                if r.failed and (not words or report.at >= latest.get(k, -math.inf)):
                    words, status = r.words, r.status
                    latest[k] = report.at
                out[k] = Verdict(
                    requests=v.requests + r.requests,
                    failed=v.failed + r.failed,
                    failing_for_s=max(v.failing_for_s, r.failing_for_s),
                    failing=v.failing or r.failing,
                    status=status,
                    words=words,
                )
        return out

    def mark(self, at: float, held: Mapping[str, ReplicaRecord]) -> dict[str, Marked]:
        """The replicas marked unhealthy now, of those `held`: a replica serving (`ready`, or
        `unknown` and routed to) that a fresh report judges failing is marked; a mark goes
        with its replica, or when a gateway reports it answering with no failure."""
        verdicts = self.verdicts(at)
        for k in [k for k in self.marked if k not in held]:
            del self.marked[k]
        for k, v in verdicts.items():
            record = held.get(k)
            if record is None:
                continue
            if v.failing and k not in self.marked and record.state in ("ready", "unknown"):
                words = v.text()
                self.marked[k] = Marked(at, words)
                log.warning("replica %s/%s %s", record.deployment, record.replica, words)
            elif k in self.marked and not v.failed and v.requests:
                del self.marked[k]
                log.info(
                    "replica %s/%s answers again: no longer unhealthy", record.deployment, record.replica
                )
        return dict(self.marked)


def ours(record: ReplicaRecord) -> bool:
    """Whether the record is `degraded` by a mark (not by a shard's failure)."""
    return record.state == "degraded" and record.reason.startswith(UNHEALTHY)


def judged(
    record: ReplicaRecord, observed: ReplicaRecord | None, marked: Marked | None, wall: float
) -> ReplicaRecord | None:
    """The replica's record with its mark over what its shards say (`observed`, None where
    they say nothing new): `degraded` in the mark's words where they say `ready`. The record
    to save, or None where it is as held."""
    if marked is None:
        return observed
    base = observed or record
    if base.state != "ready" and not (observed is None and ours(record)):
        return observed  # its shards' own failure says more
    want = msgspec.structs.replace(
        base,
        state="degraded",
        reason=marked.words,
        since=record.since if ours(record) else wall,
        updated_at=record.updated_at,
    )
    if want == record:
        return None
    return msgspec.structs.replace(want, updated_at=wall)


def restart_words(record: ReplicaRecord, marked: Marked | None, after_s: float, now: float) -> str:
    """Why a replica marked unhealthy for `after_s` is restarted now, else ""."""
    if marked is None or not ours(record) or now - marked.since < after_s:
        return ""
    return f"restarted: unhealthy for {after_s:g} s: {marked.words.removeprefix(UNHEALTHY)}"


async def hear(
    bus: Bus,
    book: JudgedBook,
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Hear every gateway's `Judgement` into `book` (a message that does not decode goes to
    the dead-letter subject, as any plain message's)."""

    async def heard(report: Judgement, subject: str) -> None:
        # The gateway is the one the subject names, whatever the payload says.
        gateway = subject.rsplit(".", 1)[-1]
        if report.gateway != gateway:
            report = msgspec.structs.replace(report, gateway=gateway)
        book.heard(report, time.monotonic())

    await bus.subscribe_core(bus.names.judgement(ONE), Judgement, heard, task_status=task_status)
