"""Tokens spent per key and deployment: read from each answer, counted for `/metrics`, and
written to the usage stream once a second (`UsageRecord`, one per key and deployment).

Reading an answer's usage: a JSON answer's last `usage` object (only the answer's last
TAIL_BYTES are kept as it passes through, and only that object is parsed); a streamed one's
events that carry a `usage` (OpenAI's last chunk with `stream_options.include_usage`,
Anthropic's `message_start` and `message_delta`, the Responses API's `response.completed`).
Prompt tokens are `prompt_tokens` or `input_tokens`, completion tokens `completion_tokens`
or `output_tokens`; where one answer says them more than once, the largest counts.

A record is written with a message id of its own, so one retried after a reconnect is
stored once; records a write could not store are kept and sent with the next. While the
bus cannot store them, a key and deployment's records never tried are summed into one (its
interval the union of theirs), so an outage of any length keeps at most two records per key
and deployment in memory, and the bus's return costs that many writes, not one per second
of outage; the record being written keeps its id and counts, so a retry of it that lands
twice is still stored once. What a gateway killed had not written yet (up to FLUSH_S of its
usage, and what an outage kept) is lost.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import msgspec
from prometheus_client import CollectorRegistry, Counter

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.keys import UsageRecord

log = logging.getLogger("llmgw.gateway")

FLUSH_S = 1.0
# How much of a JSON answer's end is kept to find its usage in (OpenAI's, vLLM's, llama.cpp's
# and Anthropic's answers put it last, after the choices).
TAIL_BYTES = 64 << 10
_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()


@dataclass
class Meter:
    """What one answer spent, as read so far."""

    prompt: int = 0
    completion: int = 0

    def take(self, obj: Any) -> bool:
        """Read the usage in one parsed answer or event; whether it held one."""
        if not isinstance(obj, dict):
            return False
        found = False
        for holder in (obj, obj.get("message"), obj.get("response")):
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if not isinstance(usage, dict):
                continue
            found = True
            for names, attr in (
                (("prompt_tokens", "input_tokens"), "prompt"),
                (("completion_tokens", "output_tokens"), "completion"),
            ):
                for name in names:
                    value = usage.get(name)
                    if isinstance(value, int) and value > getattr(self, attr):
                        setattr(self, attr, value)
        return found


class JsonTail:
    """The end of a JSON answer as it passes through (decoded where the engine gzip- or
    deflate-encoded it), and the usage object in it once it has ended."""

    def __init__(self, encoding: str) -> None:
        self._tail = b""
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if encoding in ("gzip", "deflate") else None

    def feed(self, chunk: bytes) -> None:
        if self._inflate is not None:
            try:
                chunk = self._inflate.decompress(chunk)
            except zlib.error:
                self._inflate, self._tail = None, b""
                return
        self._tail = (self._tail + chunk)[-TAIL_BYTES:]

    def read(self, meter: Meter) -> None:
        at = self._tail.rfind(_USAGE_KEY)
        if at < 0:
            return
        rest = self._tail[at + len(_USAGE_KEY) :].lstrip()
        if not rest.startswith(b":"):
            return
        try:
            usage, _ = _DECODER.raw_decode(rest[1:].lstrip().decode(errors="replace"))
        except ValueError:
            return
        meter.take({"usage": usage})


def read_events(chunk: bytes, meter: Meter, *, strip: bool) -> bytes:
    """Read the usage in whole SSE events; with `strip`, drop the events that are only usage
    (OpenAI's last chunk, `choices: []`), which a client that did not ask for them never sees."""
    if b'"usage"' not in chunk:
        return chunk
    kept = []
    for event in chunk.split(b"\n\n"):
        if b'"usage"' in event:
            data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if meter.take(obj) and strip and isinstance(obj, dict) and obj.get("choices") == []:
                continue
        kept.append(event)
    return b"\n\n".join(kept)


class Usage:
    def __init__(self, bus: Bus | None, registry: CollectorRegistry) -> None:
        self.bus = bus
        self.gateway = uuid.uuid4().hex[:12]
        self._ids = itertools.count()
        self._counts: dict[tuple[str, str], list[int]] = {}
        self._since = time.time()
        # Each with its message id, kept across tries.
        self._unsent: list[tuple[str, UsageRecord]] = []
        # The id of the record handed to the bus last: it may be stored, so it is never changed.
        self._tried = ""
        self.prompt_tokens = Counter(
            "llmgw_gateway_prompt_tokens",
            "Prompt tokens per API key and deployment, as the engines answered them.",
            ["key", "deployment"],
            registry=registry,
        )
        self.completion_tokens = Counter(
            "llmgw_gateway_completion_tokens",
            "Completion tokens per API key and deployment, as the engines answered them.",
            ["key", "deployment"],
            registry=registry,
        )
        self.key_requests = Counter(
            "llmgw_gateway_key_requests",
            "Requests sent to a replica, per API key and deployment.",
            ["key", "deployment"],
            registry=registry,
        )
        self._series: dict[tuple[str, str], tuple[Counter, Counter, Counter]] = {}

    def add(self, key: str, deployment: str, meter: Meter) -> None:
        pair = (key, deployment)
        counts = self._counts.setdefault(pair, [0, 0, 0])
        counts[0] += meter.prompt
        counts[1] += meter.completion
        counts[2] += 1
        series = self._series.get(pair)
        if series is None:
            # Looked up once per key and deployment: `labels()` takes a lock and checks its
            # arguments at each call.
            series = self._series[pair] = (
                self.prompt_tokens.labels(key, deployment),
                self.completion_tokens.labels(key, deployment),
                self.key_requests.labels(key, deployment),
            )
        prompt, completion, requests = series
        prompt.inc(meter.prompt)
        completion.inc(meter.completion)
        requests.inc()

    def _records(self) -> list[UsageRecord]:
        now = time.time()
        counts, self._counts = self._counts, {}
        start, self._since = self._since, now
        return [
            UsageRecord(
                key=k,
                deployment=d,
                prompt_tokens=p,
                completion_tokens=c,
                requests=n,
                start=start,
                end=now,
                gateway=self.gateway,
            )
            for (k, d), (p, c, n) in sorted(counts.items())
        ]

    def _keep(self, records: list[UsageRecord]) -> None:
        """Queue `records`, each summed into its key and deployment's record not yet tried."""
        open_ = {
            (r.key, r.deployment): i for i, (msg_id, r) in enumerate(self._unsent) if msg_id != self._tried
        }
        for record in records:
            at = open_.get((record.key, record.deployment))
            if at is None:
                open_[(record.key, record.deployment)] = len(self._unsent)
                self._unsent.append((f"usage-{self.gateway}-{next(self._ids)}", record))
                continue
            msg_id, old = self._unsent[at]
            self._unsent[at] = (
                msg_id,
                msgspec.structs.replace(
                    old,
                    prompt_tokens=old.prompt_tokens + record.prompt_tokens,
                    completion_tokens=old.completion_tokens + record.completion_tokens,
                    requests=old.requests + record.requests,
                    start=min(old.start, record.start),
                    end=max(old.end, record.end),
                ),
            )

    async def flush(self) -> None:
        """Write what was counted since the last flush, and what an earlier one could not."""
        assert self.bus is not None
        self._keep(self._records())
        while self._unsent:
            msg_id, record = self._unsent[0]
            self._tried = msg_id
            await self.bus.publish(self.bus.names.usage(record.deployment, record.key), record, msg_id=msg_id)
            self._unsent.pop(0)
            self._tried = ""

    async def run(self) -> None:
        """Flush every FLUSH_S until cancelled; a failed write is kept for the next."""
        try:
            while True:
                await anyio.sleep(FLUSH_S)
                try:
                    await self.flush()
                except BusError as exc:
                    log.warning(
                        "cannot write usage (%d records kept for the next try): %s", len(self._unsent), exc
                    )
                except Exception:
                    log.exception(
                        "writing usage failed (%d records kept for the next try)", len(self._unsent)
                    )
        finally:
            with anyio.move_on_after(2, shield=True):
                try:
                    await self.flush()
                except Exception as exc:
                    log.warning("usage not written at stop (%d records): %s", len(self._unsent), exc)
