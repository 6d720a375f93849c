"""The relay: a replica's answer passed on to the client once its status line is in (its
headers less the hop-by-hop ones and its `Date`, its body byte for byte, server-sent events
whole events at a time), counted as it goes (time to first byte, tokens), and ended once
however the response goes. Once an answer has begun it is never retried: a stream broken off
ends with an SSE error event, any other answer is cut off (`BrokenAnswer`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any

from opentelemetry import trace
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from .answer import FAILED, Answer
from .budgets import Reservation
from .errors import sse_error
from .ledger import Ledger
from .metrics import Metrics
from .routed import Routed
from .routing import Table
from .surface import HOP_OUT_BYTES, NO_BODY
from .usage import Events, JsonTail, Meter

log = logging.getLogger("llmgw.gateway")


class PassedResponse(StreamingResponse):
    """A replica's answer not streamed as events, passed on chunk by chunk in the request's own
    task. Starlette's `StreamingResponse` also watches for the client leaving, in a task group of
    two tasks per answer; such an answer's body follows its headers at once (the engine sends
    them when it is done), so nothing is left to stop by then, and the watch cost more than the
    rest of the response. Streamed answers (SSE) keep it: they run as long as the generation."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        except OSError as exc:
            raise ClientDisconnect() from exc


class Relay:
    """A replica's answer as the server passes it on (`Relays.relay`'s chunks), ended once
    however the response goes: where the server never asked for a chunk (its client had left),
    `aclose` ends it with `unstarted` (the replica's count released, the reservation settled,
    the span ended), which the relay's own end would have done."""

    __slots__ = ("_chunks", "_unstarted", "started")

    def __init__(self, chunks: AsyncGenerator[bytes, None], unstarted: Callable[[], None]) -> None:
        self._chunks = chunks
        self._unstarted = unstarted
        self.started = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        # `relay` enters its `try` before its first await: once asked, its end is its own.
        self.started = True
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.started = True
            self._unstarted()
        await self._chunks.aclose()


class BrokenAnswer(Exception):
    """A replica's answer broke off after the gateway had begun passing it on."""


class Relays:
    """Passes replicas' answers on, counting each into the ledger."""

    __slots__ = ("ledger", "metrics", "table")

    def __init__(self, table: Table, metrics: Metrics, ledger: Ledger) -> None:
        self.table = table
        self.metrics = metrics
        self.ledger = ledger

    def response(self, upstream: Answer, chosen_key: str, routed: Routed, path: str) -> Response:
        """The client's response to a replica's answer whose status line is in."""
        deployment, span = routed.deployment, routed.span
        status = upstream.status
        self.ledger.answered(span, deployment, status)
        out_headers = [(k, v) for k, v in upstream.headers if k.lower() not in HOP_OUT_BYTES]
        sse = upstream.header(b"content-type").startswith("text/event-stream")
        if upstream.complete and not sse:
            # The whole answer came with its head (an engine sends an answer not streamed once
            # it is done): passed on in one piece, with its length.
            return self.whole(upstream, out_headers, chosen_key, deployment, routed)
        relay = Relay(
            self.relay(
                upstream,
                chosen_key,
                deployment,
                span,
                routed.arrived,
                sse=path if sse else "",
                reservation=routed.reservation,
                strip=routed.strip,
            ),
            partial(self.relay_end, upstream, chosen_key, deployment, span, routed.reservation),
        )
        response = (StreamingResponse if sse else PassedResponse)(relay, status_code=status)
        response.raw_headers = out_headers
        return response

    def whole(
        self, upstream: Answer, headers: list[tuple[bytes, bytes]], key: str, deployment: str, routed: Routed
    ) -> Response:
        """A replica's answer already read whole, as the client gets it."""
        body = self.whole_body(upstream, key, deployment, routed)
        response = Response(status_code=upstream.status)
        if upstream.status >= 200 and upstream.status not in NO_BODY:
            headers.append((b"content-length", b"%d" % len(body)))
        response.raw_headers = headers
        response.body = body
        return response

    def whole_body(self, upstream: Answer, key: str, deployment: str, routed: Routed) -> bytes:
        """The body of a replica's answer read whole, counted as `relay` counts one passed on
        in pieces."""
        body = upstream.body()
        self.count_whole(upstream, body, key, deployment, routed, time.monotonic())
        return body

    def count_whole(
        self, upstream: Answer, body: bytes, key: str, deployment: str, routed: Routed, first_byte: float
    ) -> None:
        """The answer read whole, `body`, counted: its time to first byte (`first_byte`, when it
        was ready to go out), its connection back to the pool, its tokens and its span."""
        self.metrics.of(deployment).ttfb.observe(first_byte - routed.arrived)
        upstream.release()
        meter = Meter()
        tail = JsonTail(upstream.header(b"content-encoding"))
        tail.feed(body)
        tail.read(meter)
        if tail.unread:
            # Encoded past what is inflated to read it: charged for its bytes, as one cut off.
            meter.passed = len(body)
            estimate = routed.reservation.estimate
            meter.estimate(estimate.prompt, generates=estimate.generates)
        self.ledger.done(key, deployment, routed.span, routed.reservation, meter)

    async def relay(
        self,
        upstream: Answer,
        key: str,
        deployment: str,
        span: trace.Span,
        arrived: float,
        *,
        sse: str = "",
        reservation: Reservation,
        strip: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        first = True
        meter = Meter()
        # A JSON answer: its end, read for its usage once whole.
        tail = JsonTail(upstream.header(b"content-encoding")) if not sse else None
        # Server-sent events (`sse` is the request's path): passed on whole events at a time, so
        # that a stream broken off mid-event can still end with a well-formed error event.
        events = Events(meter, strip=strip) if sse else None
        # Whether the answer came to its end, or the replica broke it off: else the client left
        # before its end (and its usage), and it is charged for what was passed on.
        ended = False
        try:
            async for chunk in upstream.chunks():
                if first:
                    first = False
                    self.metrics.of(deployment).ttfb.observe(time.monotonic() - arrived)
                if events is not None:
                    chunk = events.feed(chunk)
                    if not chunk:
                        continue
                elif tail is not None:
                    tail.feed(chunk)
                    meter.passed += len(chunk)
                yield chunk
            if events is not None:
                rest = events.end()
                if rest:
                    yield rest
            if tail is not None:
                tail.read(meter)
            ended = True
        except FAILED as exc:
            ended = True  # by the replica: what it said is charged, as before it failed
            # Mid-answer: never retried (the replica had the request). A streamed answer ends
            # with an error event and [DONE]; any other is cut off without its last chunk
            # (raised to the server, which closes the connection), so the client sees it
            # incomplete rather than taking what came for the whole answer.
            failure = f"{exc or type(exc).__name__}"
            span.set_status(trace.StatusCode.ERROR, failure)
            log.warning("%s: %s broke off its answer: %s", deployment, key, failure)
            if sse:
                self.metrics.errors.labels(deployment, "upstream_stream").inc()
                record = self.table.replicas.get(key)
                where = f"replica {record.replica} at {record.url}" if record else f"replica {key}"
                yield sse_error(
                    f"{where} of deployment {deployment} broke off its answer: {failure}; "
                    "the answer is incomplete and was not retried",
                    sse,
                )
            else:
                self.metrics.errors.labels(deployment, "upstream").inc()
                raise BrokenAnswer(f"{deployment}: {key} broke off its answer: {failure}") from exc
        finally:
            self.relay_end(upstream, key, deployment, span, reservation, meter, tail, ended=ended)

    def relay_end(
        self,
        upstream: Answer,
        key: str,
        deployment: str,
        span: trace.Span,
        reservation: Reservation,
        meter: Meter | None = None,
        tail: JsonTail | None = None,
        *,
        ended: bool = False,
    ) -> None:
        """The end of a replica's answer passed on (`relay`), or never begun: its client left
        before the server asked for its first chunk (`Relay.aclose`), and the replica's count
        was held for ever."""
        meter = meter or Meter()
        # Read to its end, the connection is back in the pool already; else it is closed.
        upstream.release()
        if tail is not None and tail.unread:
            # An encoded answer past what is inflated to read it: charged as one cut off.
            ended = False
        if not ended and 200 <= upstream.status < 300:
            # A successful answer the client cut off: what was passed on, charged.
            if tail is not None:
                tail.read(meter)  # its usage, where what was passed on holds it
            meter.estimate(reservation.estimate.prompt, generates=reservation.estimate.generates)
        self.ledger.done(key, deployment, span, reservation, meter)
