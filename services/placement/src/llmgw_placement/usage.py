"""Tokens spent per key and deployment over the last day, for the page and `/api/usage`.

One ordered consumer follows the usage stream from a day back and adds each `UsageRecord`
to a per-minute tally; the page and the API read the tally, never the stream, so a slow or
unreachable stream never holds a page up. A consumer that cannot be opened is tried again
(the tally rebuilt from the stream) after a pause; until then the rows are empty and `error`
says why. One lost to a reconnect is opened again after the last record taken (`Bus.replay`):
no record is counted twice.
"""

from __future__ import annotations

import contextlib
import logging
import time

import anyio

from llmgw_core.bus import Bus
from llmgw_core.keys import UsageRecord, UsageRow

log = logging.getLogger("llmgw.placement.usage")

WINDOW_S = 24 * 3600.0
BUCKET_S = 60.0
RETRY_S = 5.0


class UsageWindow:
    """Running totals per key and deployment, and the same per minute so that a minute's counts
    leave the totals once it is a day old: reading the rows costs one pass over the key and
    deployment pairs, not over a day of records (the page renders twice a second)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        # minute -> (key, deployment) -> [prompt, completion, requests]
        self._minutes: dict[int, dict[tuple[str, str], list[int]]] = {}
        self._totals: dict[tuple[str, str], list[int]] = {}
        self.error = ""

    def clear(self) -> None:
        self._minutes.clear()
        self._totals.clear()

    def add(self, record: UsageRecord, now: float | None = None) -> None:
        at = record.end or record.start or time.time()
        minute = int(at // BUCKET_S)
        if minute < self._oldest(now):
            return
        pair = (record.key, record.deployment)
        for counts in (
            self._minutes.setdefault(minute, {}).setdefault(pair, [0, 0, 0]),
            self._totals.setdefault(pair, [0, 0, 0]),
        ):
            counts[0] += record.prompt_tokens
            counts[1] += record.completion_tokens
            counts[2] += record.requests

    @staticmethod
    def _oldest(now: float | None) -> int:
        return int(((time.time() if now is None else now) - WINDOW_S) // BUCKET_S)

    def _expire(self, now: float | None) -> None:
        oldest = self._oldest(now)
        for minute in [m for m in self._minutes if m < oldest]:
            for pair, (p, c, n) in self._minutes.pop(minute).items():
                counts = self._totals[pair]
                counts[0] -= p
                counts[1] -= c
                counts[2] -= n
                if counts == [0, 0, 0]:
                    del self._totals[pair]

    def rows(self, by: str = "", now: float | None = None) -> list[UsageRow]:
        """Rows per key and deployment (`by` ""), per key (deployment `*`) or per deployment
        (key `*`), over the last day, sorted as `ctl usage` sorts them."""
        self._expire(now)
        sums: dict[tuple[str, str], list[int]] = {}
        for (key, dep), (p, c, n) in self._totals.items():
            group = (key if by != "deployment" else "*", dep if by != "key" else "*")
            counts = sums.setdefault(group, [0, 0, 0])
            counts[0] += p
            counts[1] += c
            counts[2] += n
        return [
            UsageRow(key=k, deployment=d, prompt_tokens=p, completion_tokens=c, requests=n)
            for (k, d), (p, c, n) in sorted(sums.items())
        ]

    async def follow(self) -> None:
        """Follow the usage stream for ever; a failure costs a pause and a fresh read. A record
        that does not decode goes to the DLQ and is skipped (`Bus.replay`)."""
        bus = self.bus
        stream = bus.names.usage_stream
        while True:
            self.clear()
            records = bus.replay(bus.names.usage_all, UsageRecord, since=time.time() - WINDOW_S, follow=True)
            try:
                async with contextlib.aclosing(records):
                    async for record in records:
                        self.error = ""
                        if record is not None:
                            self.add(record.value)
            except Exception as exc:  # a refusal or an outage costs this try, never placement
                self.error = f"cannot read the usage stream {stream}: {exc or type(exc).__name__}"
                log.warning("%s; trying again in %.0f s", self.error, RETRY_S)
                await anyio.sleep(RETRY_S)
