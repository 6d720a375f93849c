"""Many writes at once: KV puts, KV deletes and events queued in `Writes` and written by
one `commit`, as atomic batches where the server takes them (nats-server 2.12+), else
pipelined one by one.

Every event carries a `Nats-Msg-Id`, drawn when it is queued, in a batch as alone: a commit
retried after a lost acknowledgement stores it once. nats-server checks a batch's ids against
its duplicate window; one that already holds them refuses the whole batch as a duplicate
(error 10201), which means the batch was stored before, so the commit counts it written.
nats-server 2.12.0 took no ids in a batch (error 10177, "unsupported header"); to such a
server a stream's batches go without them, and events sent that way have none.
KV puts and deletes carry no id: a key's value is its latest revision, not a message to
de-duplicate."""

from __future__ import annotations

import itertools
import logging
import uuid
from dataclasses import dataclass, field

import anyio
import msgspec
import nats.errors
from opentelemetry import trace

from ..errors import BusError, StoreFull
from ..events import encode
from ..retry import CALL_RETRY
from ..store import BATCH_INCOMPLETE, unstaged
from ..subjects import Names
from ..topology import stream_of
from .connection import Connection, transient
from .space import Space
from .tracing import inject_trace, tracer

log = logging.getLogger("llmgw.bus")

# Messages in one atomic batch (nats-server takes up to 1,000).
ATOMIC_MAX = 500
# How long a batch's commit waits for the server's answer before it is tried again.
COMMIT_TIMEOUT_S = 10.0
# nats-server's refusals of an atomic batch: it holds an id already stored (or twice), and
# (2.12.0 only) it holds a header that server does not take in a batch.
BATCH_DUPLICATE = 10201
BATCH_UNSUPPORTED_HEADER = 10177
MSG_ID = "Nats-Msg-Id"
# Events' message ids: a random prefix per process and a counter (as Publisher's).
_ID_PREFIX = uuid.uuid4().hex
_ID_SEQ = itertools.count()


@dataclass(frozen=True)
class _Write:
    subject: str
    data: bytes
    headers: dict[str, str]


@dataclass
class Writes:
    """KV puts, KV deletes and events queued for one `Bus.commit`."""

    items: list[_Write] = field(default_factory=list)

    def put(self, bucket: str, key: str, value: msgspec.Struct) -> None:
        self.items.append(_Write(Names.kv_subject(bucket, key), encode(value), {}))

    def delete(self, bucket: str, key: str) -> None:
        self.items.append(_Write(Names.kv_subject(bucket, key), b"", {"KV-Operation": "DEL"}))

    def publish(self, subject: str, msg: msgspec.Struct, *, traceparent: str = "") -> None:
        """An event; it carries a `Nats-Msg-Id` of its own and `traceparent` (else the
        current trace context's, where there is one)."""
        headers: dict[str, str] = {MSG_ID: f"{_ID_PREFIX}{next(_ID_SEQ):x}"}
        if traceparent:
            headers["traceparent"] = traceparent
        else:
            inject_trace(headers)
        self.items.append(_Write(subject, encode(msg), headers))

    def __len__(self) -> int:
        return len(self.items)


class Batches:
    def __init__(self, conn: Connection, space: Space) -> None:
        self.conn = conn
        self.space = space
        # Per stream, whether it takes atomic batches (see `commit`); `streams.ensure` fills it.
        self.atomic: dict[str, bool] = {}
        # Streams whose server refused message ids in a batch (nats-server 2.12.0).
        self.no_ids: set[str] = set()

    async def atomic_allowed(self, stream: str) -> bool:
        """Whether `stream` takes atomic batches (nats-server 2.12 and later, with the stream's
        allow_atomic set by `ensure`); asked once per stream."""
        found = self.atomic.get(stream)
        if found is None:
            try:
                info = await self.conn.js.stream_info(stream)
                found = bool(info.config.allow_atomic)
            except (nats.errors.Error, OSError):
                found = False
            self.atomic[stream] = found
        return found

    async def commit(self, writes: Writes) -> None:
        """Write every queued put, delete and event: one atomic batch per stream and up to
        ATOMIC_MAX messages where the server allows it (one commit, not one per message),
        else pipelined one by one. Streams are written in the order they were first queued.
        Raises BusError when a write did not land; what an atomic batch held is then not
        written at all, and a retry writes it whole. A subject too long to send refuses the
        whole commit before anything is written."""
        for w in writes.items:
            self.conn.check(w.subject)
        by_stream: dict[str, list[_Write]] = {}
        for w in writes.items:
            by_stream.setdefault(stream_of(self.conn.names, w.subject), []).append(w)
        for stream, items in by_stream.items():
            subjects = {w.subject for w in items}
            attributes: dict[str, str | int] = {
                "messaging.system": "nats",
                "messaging.destination.name": subjects.pop() if len(subjects) == 1 else stream,
                "messaging.operation.type": "send",
                "messaging.operation.name": "commit",
                "messaging.batch.message_count": len(items),
            }
            with tracer.start_as_current_span(
                f"commit {len(items)} to {stream}", kind=trace.SpanKind.PRODUCER, attributes=attributes
            ):
                # An event queued outside any trace takes the commit's: where tracing is on,
                # every event carries a traceparent.
                items = [_traced(w) for w in items]
                if await self.atomic_allowed(stream):
                    for start in range(0, len(items), ATOMIC_MAX):
                        await self._atomic_batch(stream, items[start : start + ATOMIC_MAX])
                else:
                    await self._pipelined(items)

    async def _atomic_batch(self, stream: str, items: list[_Write]) -> None:
        attempts = 3
        what = (
            f"a batch of {len(items)} writes to {stream}"
            if len(items) > 1
            else f"a write to {items[0].subject}"
        )
        for attempt in range(1, attempts + 1):
            batch = uuid.uuid4().hex[:20]
            strip = stream in self.no_ids
            try:
                for i, w in enumerate(items[:-1], start=1):
                    headers = {**_sent(w, strip), "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
                    await self.conn.nc.publish(w.subject, w.data, headers=headers)
                last = items[-1]
                headers = {
                    **_sent(last, strip),
                    "Nats-Batch-Id": batch,
                    "Nats-Batch-Sequence": str(len(items)),
                    "Nats-Batch-Commit": "1",
                }
                reply = await self.conn.nc.request(
                    last.subject, last.data, headers=headers, timeout=COMMIT_TIMEOUT_S
                )
            except (nats.errors.Error, OSError) as exc:
                self.conn.raise_if_final(exc)
                full = await self.space.refusal(stream, what, exc, unanswered=attempt == attempts)
                if full is not None:
                    raise full from exc
                if attempt == attempts or not transient(exc):
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                error = msgspec.json.decode(reply.data).get("error") if reply.data else None
                if not error:
                    self.space.note_write(stream)
                    return
                code, description = error.get("err_code"), str(error.get("description", ""))
                if code == BATCH_DUPLICATE:
                    # Every id is drawn once per event, so the server holds this batch already:
                    # an earlier try (whose acknowledgement was lost) stored it whole.
                    log.debug("%s was stored before (%s)", what, description)
                    self.space.note_write(stream)
                    return
                if (
                    code == BATCH_UNSUPPORTED_HEADER
                    and MSG_ID in description
                    and not strip
                    and attempt < attempts
                ):
                    log.info("%s takes no message ids in atomic batches: its events go without", stream)
                    self.no_ids.add(stream)
                    continue
                refusal = await self.space.space(stream, code, description)
                if refusal is None and code == BATCH_INCOMPLETE and (attempt == attempts or len(items) == 1):
                    # A batch whose every message was sent, or a batch of one, that nats-server
                    # calls incomplete: it could not stage it (on its store's disk).
                    refusal = unstaged(description, code)
                if refusal is not None:
                    raise self.space.refused(stream, refusal, what)
                if attempt == attempts or (error.get("code") not in (503, 504) and code != BATCH_INCOMPLETE):
                    raise BusError(f"{what} was refused: {description or error} (error {code or '?'})")
            await anyio.sleep(CALL_RETRY.wait(attempt))

    async def _pipelined(self, items: list[_Write]) -> None:
        """One write at a time on the wire, many in flight: for servers without atomic batches."""
        failures: list[BaseException] = []
        limiter = anyio.CapacityLimiter(64)

        async def one(w: _Write) -> None:
            stream = stream_of(self.conn.names, w.subject)
            async with limiter:
                for attempt in range(1, 4):
                    try:
                        await self.conn.js.publish(w.subject, w.data, headers=w.headers or None)
                    except (nats.errors.Error, OSError) as exc:
                        full = await self.space.refusal(stream, f"a write to {w.subject}", exc)
                        if full is not None or attempt == 3 or not transient(exc):
                            failures.append(full or exc)
                            return
                    else:
                        self.space.note_write(stream)
                        return
                    await anyio.sleep(CALL_RETRY.wait(attempt))

        async with anyio.create_task_group() as tg:
            for w in items:
                tg.start_soon(one, w)
        if failures:
            self.conn.raise_if_final(failures[0])
            full = next((f for f in failures if isinstance(f, StoreFull)), None)
            first = full or failures[0]
            text = f"{len(failures)} of {len(items)} writes failed: {first or type(first).__name__}"
            if full is not None:
                raise StoreFull(text, stream=full.stream, banner=full.banner)
            raise BusError(text)


def _sent(w: _Write, strip: bool) -> dict[str, str]:
    """`w`'s headers as sent in a batch: without its message id where the server takes none."""
    if strip and MSG_ID in w.headers:
        return {k: v for k, v in w.headers.items() if k != MSG_ID}
    return w.headers


def _traced(w: _Write) -> _Write:
    """An event `w` with the current trace context where it has none (KV writes as they are)."""
    if MSG_ID not in w.headers or "traceparent" in w.headers:
        return w
    headers = dict(w.headers)
    inject_trace(headers)
    return w if len(headers) == len(w.headers) else _Write(w.subject, w.data, headers)
