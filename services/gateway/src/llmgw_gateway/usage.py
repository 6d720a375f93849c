"""Tokens spent per key and deployment: read from each answer, counted for `/metrics`, and
written to the usage stream once a second (`UsageRecord`, one per key and deployment).

Reading an answer's usage: a JSON answer's last `usage` object (only the answer's last
TAIL_BYTES are kept as it passes through, and only that object is parsed); a streamed one's
events that carry a `usage` (OpenAI's last chunk with `stream_options.include_usage`,
Anthropic's `message_start` and `message_delta`, the Responses API's `response.completed`).
Prompt tokens are `prompt_tokens` or `input_tokens`, plus Anthropic's
`cache_read_input_tokens` and `cache_creation_input_tokens` (which its `input_tokens` leaves
out), completion tokens `completion_tokens` or `output_tokens`; where one answer says them
more than once, the largest counts. An answer the engine gzip- or deflate-encoded is inflated
up to MAX_INFLATED_BYTES, a tail's worth at a time, and left unread past that. A count
that is not an integer from 0 to MAX_TOKENS is not read (a 4,000-digit count would make every
later usage record and limits write fail to encode).

An answer the client cut off (it closed the connection before the end, and with it the usage
the engine says last) is charged an estimate of what was passed on (`Meter.estimate`): for its
prompt, the request's (its body's bytes / 4), and for what it generated, one token per event of
a stream passed on, or a token per 4 bytes of an answer not streamed. A count the answer did
say is kept where it is the larger.

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
import re
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
# The largest count of an answer's usage that is read: no answer spends 4 billion tokens, and a
# larger count would not fit the usage records' and limits' 64-bit integers.
MAX_TOKENS = 1 << 32
# An event of a stream longer than this is passed on as it comes, unread (counted as one event):
# a replica that never ends an event must not make the gateway keep all of it.
MAX_EVENT_BYTES = 1 << 20
# Where an engine encodes its answer, at most this much of it is inflated to find its usage: a
# gzip body inflates up to 1,032 times its size, so a 256 KiB read could have been 256 MiB at once.
MAX_INFLATED_BYTES = 64 << 20
# The prompt tokens Anthropic counts apart from `input_tokens` (its cache's reads and writes).
_CACHED_INPUT = ("cache_read_input_tokens", "cache_creation_input_tokens")
_USAGE_KEY = b'"usage"'
_DECODER = json.JSONDecoder()
# Where one server-sent event ends: a blank line, its line ends LF or CRLF.
_EVENT_END = re.compile(rb"(\r?\n\r?\n)")


@dataclass
class Meter:
    """What one answer spent, as read so far, and what of it was passed on."""

    prompt: int = 0
    completion: int = 0
    # What was passed on: a stream's events, an answer's bytes not streamed.
    events: int = 0
    passed: int = 0

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
            prompt = max(_count(usage, "prompt_tokens"), _count(usage, "input_tokens"))
            if prompt or any(name in usage for name in _CACHED_INPUT):
                # Anthropic's `input_tokens` leaves out the prompt tokens read from or written to
                # its cache, which it counts apart (llama-server's /v1/messages too: 153 of a
                # 322-token prompt it had cached were charged). OpenAI's `prompt_tokens` and the
                # Responses API's `input_tokens` already hold their `cached_tokens`, which are
                # not added again.
                prompt += sum(_count(usage, name) for name in _CACHED_INPUT)
                self.prompt = max(self.prompt, min(prompt, MAX_TOKENS))
            completion = max(_count(usage, "completion_tokens"), _count(usage, "output_tokens"))
            self.completion = max(self.completion, completion)
        return found

    def estimate(self, prompt: int, *, generates: bool = True) -> None:
        """What was passed on of an answer the client cut off, charged: `prompt`, the request's
        estimate, where the answer said no prompt tokens, and where it `generates` (not
        embeddings) a token per event passed on (per 4 bytes, for an answer not streamed) where
        that is more than it said it generated."""
        if not self.prompt:
            self.prompt = max(0, prompt)
        if generates:
            passed = self.events if self.events else -(-self.passed // 4)
            self.completion = max(self.completion, passed)


def _count(usage: dict[str, Any], name: str) -> int:
    """`usage[name]` where it is an integer from 0 to MAX_TOKENS, else 0."""
    value = usage.get(name)
    return value if type(value) is int and 0 <= value <= MAX_TOKENS else 0


class JsonTail:
    """The end of a JSON answer as it passes through (decoded where the engine gzip- or
    deflate-encoded it), and the usage object in it once it has ended."""

    def __init__(self, encoding: str) -> None:
        self._tail = b""
        self._inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if encoding in ("gzip", "deflate") else None
        # What was inflated so far; past MAX_INFLATED_BYTES the answer is left unread.
        self._inflated = 0
        # The answer could not be read for its usage (not inflated, or past the bound).
        self.unread = False

    def feed(self, chunk: bytes) -> None:
        if self.unread:
            return
        if self._inflate is None:
            self._tail = (self._tail + chunk)[-TAIL_BYTES:]
            return
        # Inflated a tail's worth at a time, so one read never holds more than TAIL_BYTES of it
        # (until its output is short of that, zlib may hold more for the next call).
        while True:
            try:
                out = self._inflate.decompress(chunk, TAIL_BYTES)
            except zlib.error:
                self._give_up()
                return
            self._inflated += len(out)
            if self._inflated > MAX_INFLATED_BYTES:
                self._give_up()
                return
            self._tail = (self._tail + out)[-TAIL_BYTES:]
            chunk = self._inflate.unconsumed_tail
            if self._inflate.eof or (not chunk and len(out) < TAIL_BYTES):
                return

    def _give_up(self) -> None:
        self._inflate, self._tail, self.unread = None, b"", True

    def read(self, meter: Meter) -> None:
        at = self._tail.rfind(_USAGE_KEY)
        if at < 0:
            return
        rest = self._tail[at + len(_USAGE_KEY) :].lstrip()
        if not rest.startswith(b":"):
            return
        try:
            usage, _ = _DECODER.raw_decode(rest[1:].lstrip().decode(errors="replace"))
        except (ValueError, RecursionError):
            return
        meter.take({"usage": usage})


def _event_data(event: bytes) -> Any:
    """The JSON of one event's `data:` lines, or None where it is not JSON."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's stack
        return None


def read_events(chunk: bytes, meter: Meter, *, strip: bool) -> bytes:
    """Read the usage in whole SSE events, and count them passed on; with `strip`, drop the
    events that are only usage (OpenAI's last chunk, `choices: []`), which a client that did
    not ask for them never sees."""
    # A JSON string holds no raw line end: every blank line ends an event (LF or CRLF).
    meter.events += chunk.count(b"\n\n") + chunk.count(b"\n\r\n")
    if _USAGE_KEY not in chunk:
        return chunk
    parts = _EVENT_END.split(chunk)  # event, its end, event, its end, …, what follows the last
    kept = []
    for i in range(0, len(parts), 2):
        event = parts[i]
        if _USAGE_KEY in event:
            obj = _event_data(event)
            if meter.take(obj) and strip and isinstance(obj, dict) and obj.get("choices") == []:
                continue
        kept.append(event + parts[i + 1] if i + 1 < len(parts) else event)
    return b"".join(kept)


class Events:
    """A stream of server-sent events as it passes through: handed on up to the end of its last
    whole event (so that a stream broken off mid-event can still end with a well-formed error
    event), each event read and counted into `meter` (`read_events`), an event longer than
    MAX_EVENT_BYTES passed on unread as it comes."""

    def __init__(self, meter: Meter, *, strip: bool) -> None:
        self.meter = meter
        self.strip = strip
        # What came after the last whole event, in pieces (joined once an event ends in them:
        # an event trickled a byte at a time is not copied again at each byte).
        self._pending: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> bytes:
        """What of the stream so far goes on now."""
        if not chunk:
            return b""
        # An event's end may straddle the pieces: the last 3 bytes before `chunk` count too.
        before = b"".join(self._pending[-3:])[-3:]
        if _EVENT_END.search(before + chunk) is None:
            self._pending.append(chunk)
            self._size += len(chunk)
            if self._size <= MAX_EVENT_BYTES:
                return b""
            self.meter.events += 1
            return self._take()
        data = self._take() + chunk
        end = max(data.rfind(b"\n\n") + 2, data.rfind(b"\n\r\n") + 3)
        if end < len(data):
            self._pending, self._size = [data[end:]], len(data) - end
        return read_events(data[:end], self.meter, strip=self.strip)

    def end(self) -> bytes:
        """What is left once the stream has ended."""
        rest = self._take()
        return read_events(rest, self.meter, strip=self.strip) if rest else b""

    def _take(self) -> bytes:
        data = b"".join(self._pending)
        self._pending, self._size = [], 0
        return data


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
