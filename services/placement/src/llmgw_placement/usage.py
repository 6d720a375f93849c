"""Tokens spent per key and deployment over the last day, for the page and `/api/usage`.

One ordered consumer follows the usage stream from a day back and adds each `UsageRecord`
to a per-minute tally; the page and the API read the tally, never the stream, so a slow or
unreachable stream never holds a page up. A consumer that cannot be opened is tried again
(the tally rebuilt from the stream) after a pause; until then the rows are empty and `error`
says why.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import time
from collections import defaultdict

import anyio
import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.js import api

from llmgw_core.bus import Bus
from llmgw_core.events import decoder
from llmgw_core.keys import UsageRecord

log = logging.getLogger("llmgw.placement.usage")

WINDOW_S = 24 * 3600.0
BUCKET_S = 60.0
RETRY_S = 5.0


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """One row, as `llmgw ctl usage -o json` writes it (`*` where the rows are summed over it)."""

    key: str
    deployment: str
    prompt_tokens: int
    completion_tokens: int
    requests: int


class UsageWindow:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        # (minute, key, deployment) -> [prompt, completion, requests]
        self._tally: dict[tuple[int, str, str], list[int]] = defaultdict(lambda: [0, 0, 0])
        self.error = ""
        self._decode = decoder(UsageRecord)

    def add(self, record: UsageRecord) -> None:
        at = record.end or record.start or time.time()
        counts = self._tally[(int(at // BUCKET_S), record.key, record.deployment)]
        counts[0] += record.prompt_tokens
        counts[1] += record.completion_tokens
        counts[2] += record.requests

    def rows(self, by: str = "", now: float | None = None) -> list[UsageRow]:
        """Rows per key and deployment (`by` ""), per key (deployment `*`) or per deployment
        (key `*`), over the last day, sorted as `ctl usage` sorts them."""
        oldest = int(((time.time() if now is None else now) - WINDOW_S) // BUCKET_S)
        for stale in [k for k in self._tally if k[0] < oldest]:
            del self._tally[stale]
        sums: dict[tuple[str, str], list[int]] = {}
        for (_, key, dep), (p, c, n) in self._tally.items():
            group = (key if by != "deployment" else "*", dep if by != "key" else "*")
            counts = sums.setdefault(group, [0, 0, 0])
            counts[0] += p
            counts[1] += c
            counts[2] += n
        return [
            UsageRow(key=k, deployment=d, prompt_tokens=p, completion_tokens=c, requests=n)
            for (k, d), (p, c, n) in sorted(sums.items())
        ]

    async def _on_msg(self, msg: Msg) -> None:
        try:
            self.add(self._decode.decode(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("usage stream: a record on %s cannot be read (%s); skipped", msg.subject, exc)

    async def follow(self) -> None:
        """Follow the usage stream for ever; a failure costs a pause and a fresh read."""
        bus = self.bus
        stream = bus.names.usage_stream
        while True:
            start = datetime.datetime.fromtimestamp(time.time() - WINDOW_S, tz=datetime.UTC)
            self._tally.clear()
            try:
                sub = await bus.js.subscribe(
                    bus.names.usage_all,
                    stream=stream,
                    ordered_consumer=True,
                    deliver_policy=api.DeliverPolicy.BY_START_TIME,
                    config=api.ConsumerConfig(opt_start_time=start),
                    cb=self._on_msg,
                )
            except Exception as exc:  # a refusal or an outage costs this try, never placement
                self.error = f"cannot read the usage stream {stream}: {exc or type(exc).__name__}"
                log.warning("%s; trying again in %.0f s", self.error, RETRY_S)
                await anyio.sleep(RETRY_S)
                continue
            self.error = ""
            try:
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()
