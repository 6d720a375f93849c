"""Outlier detection: replicas judged by their answers, as Envoy's outlier detection judges hosts.

An engine whose GPU faulted answers `/health` 200 and every completion 500 ("CUDA error: an
illegal memory access was encountered"): its launcher and placement see it `ready`, and only
its answers tell. So the gateway counts each replica's outcomes (`record`): a 5xx answer, a
connection refused or reset, or no first byte within the read timeout is a failure; any other
answer, a 4xx included (the client's fault, not the replica's), a success.

A replica fails out of routing (is ejected) when it failed `consecutive_failures` times in a
row, or when over the last `window_s` it had at least `min_requests` attempts and its share of
successes is below `min_success_rate`. It stays out `base_ejection_s` x n (the n-th ejection
since it last went a whole window in routing without failing), at most `max_ejection_s`, then
gets its requests again (its count in a row starts over). At most `max_ejection_percent` of a
deployment's replicas are out at once, never its last one: the requests keep going to it,
and its own 5xx tells the client why, until placement restarts it.

Whether or not it could eject it, the gateway tells placement (`judgements`, an
`events.Judgement` with each demand report): the counts of each replica that failed in the
window, whether it judges it failing, and the last failure's status and the engine's own
words, cut to `JUDGEMENT_WORDS_MAX`.

Pure but for its clock (`clock`, a seam tests turn by hand): plain data in, decisions out.
Memory is bounded: a replica's window is `BUCKETS` counters, and a replica forgotten when
the routing table drops it (`forget`).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmgw_core.events import JUDGED_COUNT_MAX, JUDGEMENT_WORDS_MAX, ReplicaJudgement

from .config import OutliersConfig

# A replica's window is kept as this many counters, each a slice of window_s.
BUCKETS = 10
# The most of a failed answer's body read for its words: an engine's error is a line or two.
BODY_READ_MAX = 16 << 10


def words_of(status: int, body: bytes) -> str:
    """The engine's own words for a failed answer: its JSON `error.message` (OpenAI's shape),
    `message` or `detail`, else the body's first line; one printable line of at most
    JUDGEMENT_WORDS_MAX characters, whatever the body holds."""
    head = body[:BODY_READ_MAX]
    text = ""
    try:
        value = json.loads(head) if len(body) <= BODY_READ_MAX else None
    except ValueError:
        value = None
    if isinstance(value, dict):
        inner = value.get("error")
        for candidate in (
            inner.get("message") if isinstance(inner, dict) else inner,
            value.get("message"),
            value.get("detail"),
        ):
            if isinstance(candidate, str) and candidate.strip():
                text = candidate
                break
    if not text:
        text = head.decode("utf-8", "replace")
    line = " ".join("".join(c if c.isprintable() else " " for c in text[: JUDGEMENT_WORDS_MAX * 2]).split())
    if not line:
        line = f"HTTP {status}" if status else "no answer"
    return line if len(line) <= JUDGEMENT_WORDS_MAX else line[: JUDGEMENT_WORDS_MAX - 1] + "…"


@dataclass(slots=True)
class _Replica:
    """One replica's outcomes: its window's counters, its failures in a row, its ejections."""

    deployment: str
    replica: str
    # [slice start, attempts, failures], oldest first, at most BUCKETS.
    buckets: list[list[float]] = field(default_factory=list)
    # Failures in a row: since its last success (`streak`, told placement), and since it last
    # came back into routing (`consecutive`, what ejects it).
    streak: int = 0
    consecutive: int = 0
    # When its window's first failure came (None: none in the window).
    first_failure: float | None = None
    status: int = 0
    words: str = ""
    # Ejections since it last went a window without failing, and until when it is out.
    ejections: int = 0
    out_until: float = 0.0
    # When it last failed: a window without one clears its ejections.
    last_failure: float = -math.inf
    # Whether the last report said it failed (one more report, with zeros, says it stopped).
    said: bool = False


class Outliers:
    """Each replica's outcomes and ejections (see the module's docstring)."""

    __slots__ = ("_of", "_replicas", "clock", "config")

    def __init__(
        self, config: OutliersConfig | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or OutliersConfig()
        self.clock = clock
        # `<deployment>.<replica>` -> its outcomes.
        self._replicas: dict[str, _Replica] = {}
        # The same, by deployment: the share out is counted over one deployment's alone.
        self._of: dict[str, dict[str, _Replica]] = {}

    def record(self, key: str, deployment: str, replica: str, status: int, words: str, size: int) -> bool:
        """Count one attempt's outcome at replica `key` of a deployment with `size` replicas
        routed to: `status` its answer's (0: none came), `words` what it said where it
        failed. Whether it was ejected by this outcome."""
        now = self.clock()
        r = self._replicas.get(key)
        if r is None:
            r = self._replicas[key] = _Replica(deployment, replica)
            self._of.setdefault(deployment, {})[key] = r
        self._slide(r, now)
        bucket = self._bucket(r, now)
        bucket[1] = min(bucket[1] + 1, JUDGED_COUNT_MAX)
        if 0 < status < 500:
            r.consecutive = r.streak = 0
            return False
        bucket[2] = min(bucket[2] + 1, JUDGED_COUNT_MAX)
        r.consecutive = min(r.consecutive + 1, JUDGED_COUNT_MAX)
        r.streak = min(r.streak + 1, JUDGED_COUNT_MAX)
        r.status, r.words, r.last_failure = status, words[:JUDGEMENT_WORDS_MAX], now
        if r.first_failure is None:
            r.first_failure = now
        if not self.config.enabled or r.out_until > now or not self.failing(r):
            return False
        limit = self.limit(size)
        if limit == 0 or self.out(deployment, now) >= limit:
            return False
        c = self.config
        r.ejections += 1
        r.out_until = now + min(c.base_ejection_s * r.ejections, c.max_ejection_s)
        # Back in routing, it gets as many tries again before it is taken out once more.
        r.consecutive = 0
        return True

    def failing(self, r: _Replica) -> bool:
        """Whether its outcomes make it an outlier: failures in a row, or its success rate."""
        c = self.config
        if c.consecutive_failures and r.consecutive >= c.consecutive_failures:
            return True
        attempts, failures = self._counts(r)
        return attempts >= c.min_requests and (attempts - failures) < c.min_success_rate * attempts

    def limit(self, size: int) -> int:
        """How many of a deployment's `size` replicas may be out at once: max_ejection_percent
        of them, at least one where there are two or more, never all."""
        if size < 2:
            return 0
        return max(1, min(size - 1, size * self.config.max_ejection_percent // 100))

    def out(self, deployment: str, now: float | None = None) -> int:
        """How many of the deployment's replicas are out of routing now."""
        at = self.clock() if now is None else now
        return sum(1 for r in self._of.get(deployment, {}).values() if r.out_until > at)

    def ejected(self, keys: list[str]) -> frozenset[str]:
        """Those of `keys` out of routing now."""
        now = self.clock()
        found = self._replicas
        return frozenset(k for k in keys if (r := found.get(k)) is not None and r.out_until > now)

    def forget(self, key: str) -> None:
        """A replica gone from the routing table: its outcomes go with it."""
        r = self._replicas.pop(key, None)
        if r is not None:
            group = self._of[r.deployment]
            del group[key]
            if not group:
                del self._of[r.deployment]

    def judgements(self) -> tuple[ReplicaJudgement, ...]:
        """What to tell placement now: each replica that failed in the window, and once more,
        with zeros, each that the last report said failed and that no longer did."""
        now = self.clock()
        rows = []
        for key in sorted(self._replicas):
            r = self._replicas[key]
            self._slide(r, now)
            attempts, failures = self._counts(r)
            if failures == 0:
                if r.said:
                    r.said = False
                    rows.append(
                        ReplicaJudgement(deployment=r.deployment, replica=r.replica, requests=attempts)
                    )
                continue
            r.said = True
            since = r.first_failure if r.first_failure is not None else now
            rows.append(
                ReplicaJudgement(
                    deployment=r.deployment,
                    replica=r.replica,
                    requests=attempts,
                    failed=failures,
                    consecutive=r.streak,
                    failing_for_s=min(86_400.0, max(0.0, now - since)),
                    failing=self.failing(r) or r.out_until > now,
                    ejected=r.out_until > now,
                    status=min(max(r.status, 0), 999),
                    words=r.words,
                )
            )
        return tuple(rows)

    # --- the window ------------------------------------------------------------------

    def _slide(self, r: _Replica, now: float) -> None:
        """Drop the counters older than the window; a window without failures clears the
        replica's first failure, and one back in routing without failures its ejections."""
        window = self.config.window_s
        while r.buckets and r.buckets[0][0] <= now - window:
            del r.buckets[0]
        failed = [b[0] for b in r.buckets if b[2]]
        if not failed:
            r.first_failure = None
        elif r.first_failure is None or r.first_failure < failed[0]:
            r.first_failure = failed[0]
        if now - max(r.last_failure, r.out_until) >= window:
            # A whole window back in routing without a failure: its next ejection is the first.
            r.ejections = 0

    def _bucket(self, r: _Replica, now: float) -> list[float]:
        width = self.config.window_s / BUCKETS
        if r.buckets and now - r.buckets[-1][0] < width:
            return r.buckets[-1]
        bucket = [now, 0.0, 0.0]
        r.buckets.append(bucket)
        if len(r.buckets) > BUCKETS:
            del r.buckets[0]
        return bucket

    @staticmethod
    def _counts(r: _Replica) -> tuple[int, int]:
        attempts = int(sum(b[1] for b in r.buckets))
        failures = int(sum(b[2] for b in r.buckets))
        return min(attempts, JUDGED_COUNT_MAX), min(failures, JUDGED_COUNT_MAX)
