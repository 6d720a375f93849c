"""The relay: a replica's answer passed on to the client once its status line is in (its
headers less the hop-by-hop ones and its `Date`, its body byte for byte, server-sent events
whole events at a time), counted as it goes (time to first byte, tokens), and ended once
however the response goes. Once an answer has begun it is never retried: a chat or completion
stream broken off is continued on another replica from what the client has (`continuation.py`,
at most `routing.continuations` times), else it ends with an SSE error event; any other answer
is cut off (`BrokenAnswer`)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from opentelemetry import trace
from starlette.requests import ClientDisconnect
from starlette.responses import Response, StreamingResponse

from llmgw_core.events import ReplicaRecord

from .answer import FAILED, Answer
from .budgets import Reservation
from .continuation import (
    CONTINUED_PATHS,
    PREFILLS,
    ContinuationError,
    Held,
    Splice,
    continuation_body,
    error_cut,
    partial_of,
)
from .errors import sse_error
from .handover import DRAINED, ErrorEvent, Handover, Seam, cause_of
from .ledger import Ledger
from .metrics import Metrics
from .outliers import words_of
from .routed import Routed
from .routing import Table
from .surface import HOP_OUT_BYTES, NO_BODY
from .tracing import served_by
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


class _Broken(Exception):
    """A replica broke off its answer and it was not continued: the failure, and why it was
    not continued ("" where continuing was not tried)."""


class BrokenAnswer(Exception):
    """A replica's answer broke off after the gateway had begun passing it on."""


# Sends a continuation (its request built for the replica picked: `continuation_body`, which
# may raise ContinuationError) to a ready replica not among those given; the replica's key and
# its streamed answer, or why none took it (`Attempts.resend`).
# Only a replica of profile fingerprint `fingerprint` (the same model and weights) may take it.
Resend = Callable[
    [Routed, Callable[[ReplicaRecord], Routed], str, frozenset[str], str],
    Awaitable["tuple[str, Answer] | str"],
]


class Relays:
    """Passes replicas' answers on, counting each into the ledger."""

    __slots__ = ("ledger", "metrics", "resend", "table", "tracer")

    def __init__(
        self, table: Table, metrics: Metrics, ledger: Ledger, tracer: trace.Tracer | None = None
    ) -> None:
        self.table = table
        self.metrics = metrics
        self.ledger = ledger
        # Each continuation is a span of the request's, from its break to its first event.
        self.tracer = tracer or trace.get_tracer("llmgw.gateway")
        # Set by the attempts: without it, no answer is continued.
        self.resend: Resend | None = None

    def response(
        self, upstream: Answer, chosen_key: str, routed: Routed, path: str, read: bytes | None = None
    ) -> Response:
        """The client's response to a replica's answer whose status line is in; `read`: what
        the attempts read of its body already (`Attempts.read`), the whole of it where it is
        `complete`."""
        deployment, span = routed.deployment, routed.span
        status = upstream.status
        self.ledger.answered(span, deployment, status)
        out_headers = [(k, v) for k, v in upstream.headers if k.lower() not in HOP_OUT_BYTES]
        out_headers.append(served_by(deployment, chosen_key))
        sse = upstream.header(b"content-type").startswith("text/event-stream")
        if upstream.complete and not sse:
            # The whole answer came with its head (an engine sends an answer not streamed once
            # it is done): passed on in one piece, with its length.
            return self.whole(upstream, out_headers, chosen_key, deployment, routed, read)
        # Judged by its status line alone (a whole answer is judged with its words, below).
        self.table.outcome(chosen_key, status)
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
                routed=routed,
                read=read or b"",
            ),
            partial(self.relay_end, upstream, chosen_key, deployment, span, routed.reservation),
        )
        response = (StreamingResponse if sse else PassedResponse)(relay, status_code=status)
        response.raw_headers = out_headers
        return response

    def whole(
        self,
        upstream: Answer,
        headers: list[tuple[bytes, bytes]],
        key: str,
        deployment: str,
        routed: Routed,
        read: bytes | None = None,
    ) -> Response:
        """A replica's answer already read whole (`read`, where the attempts took it from the
        answer), as the client gets it."""
        if read is None:
            body = self.whole_body(upstream, key, deployment, routed)
        else:
            body = read
            self.count_whole(upstream, body, key, deployment, routed, time.monotonic())
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
        status = upstream.status
        self.table.outcome(key, status, words_of(status, body) if status >= 500 else "")
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
        self.ledger.done(key, deployment, routed.span, routed.reservation, meter, routed.adapter)

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
        routed: Routed | None = None,
        read: bytes = b"",
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
        # A chat or completion stream: what its client has, held to continue it from on another
        # replica should this one break it off; the replicas that did; and, once continued, the
        # continuing replica's events cut whole (`whole`) and rewritten (`splice`).
        held = Held() if routed is not None and sse in CONTINUED_PATHS and self.continues() else None
        broken: set[str] = set()
        splice: Splice | None = None
        whole: Events | None = None
        # A continuation goes only to a replica of the same model and weights: its profile's
        # fingerprint, as the replica first relayed from had it (mid-rollout, a deployment has
        # replicas of two). The replicas seen draining, each handed over once at most; and the
        # continuation under way until its first event goes out.
        record = self.table.replicas.get(key)
        fingerprint = record.profile_fp if record is not None else ""
        drained: set[str] = set()
        seam: Seam | None = None
        try:
            while True:
                try:
                    async for chunk in _after(read, upstream.chunks()):
                        read = b""
                        if held is not None and routed and key not in drained and self.draining(key):
                            # Placement drains the replica: the rest of its stream is asked of
                            # another at this event boundary, rather than run to its end here.
                            drained.add(key)
                            handover = Seam(self.tracer, span, self.metrics, deployment, DRAINED, key)
                            try:
                                went = await self.continued(
                                    routed, sse, held, frozenset(broken | {key}), fingerprint
                                )
                            except BaseException:
                                handover.end()
                                raise
                            if not isinstance(went, str):
                                raise Handover(went, handover)
                            # None can take it: it runs to its end (or drain_timeout_s) here.
                            handover.failed(went)
                            log.info("%s: %s is draining; its stream stays: %s", deployment, key, went)
                        if first:
                            first = False
                            self.metrics.of(deployment).ttfb.observe(time.monotonic() - arrived)
                        if events is not None:
                            if splice is not None and whole is not None:
                                chunk = splice.rewrite(whole.feed(chunk))
                            chunk = events.feed(chunk)
                            if not chunk:
                                continue
                            if held is not None:
                                if b'"error"' in chunk and (cut := error_cut(chunk)) is not None:
                                    # The engine gave up on the answer mid-stream: a break, as a
                                    # connection lost, once what came before it is passed on.
                                    chunk, words = cut
                                    if chunk:
                                        held.add(chunk)
                                        yield chunk
                                    raise ErrorEvent(f"it sent an error event mid-answer: {words}")
                                held.add(chunk)
                            if seam is not None:
                                seam.joined()
                                seam = None
                        elif tail is not None:
                            tail.feed(chunk)
                            meter.passed += len(chunk)
                        yield chunk
                    if events is not None:
                        rest = (
                            splice.rewrite(whole.end()) if splice is not None and whole is not None else b""
                        )
                        rest = events.feed(rest) + events.end()
                        if rest:
                            yield rest
                    if tail is not None:
                        tail.read(meter)
                    ended = True
                    return
                except Handover as handover:
                    if seam is not None:
                        seam.end()  # a continuation handed over before its first event
                    went, seam = handover.went, handover.seam
                    log.info("%s: %s is draining; its stream goes on on %s", deployment, key, went[0])
                except FAILED as exc:
                    failure = f"{exc or type(exc).__name__}"
                    log.warning("%s: %s broke off its answer: %s", deployment, key, failure)
                    if held is None or routed is None:
                        raise _Broken(failure, "") from exc
                    broken.add(key)
                    if seam is not None:
                        seam.failed(failure)  # a continuation broken off before its first event
                    seam = Seam(self.tracer, span, self.metrics, deployment, cause_of(exc), key)
                    went = await self.continued(routed, sse, held, frozenset(broken), fingerprint)
                    if isinstance(went, str):
                        seam.failed(went)
                        raise _Broken(failure, went) from exc
                    self.metrics.errors.labels(deployment, "upstream_stream").inc()
                    log.info("%s: continuing the answer %s broke off on %s", deployment, key, went[0])
                broken.add(key)
                seam.taken(went[0], went[2].before)
                upstream.release()
                self.ledger.release(key, deployment)
                key, upstream, splice = went
                # What came after the left replica's last whole event is dropped.
                events, whole = Events(meter, strip=strip), Events(Meter(), strip=False)
        except _Broken as broke:
            ended = True  # by the replica: what it said is charged, as before it failed
            # A streamed answer not continued ends with an error event and [DONE]; any other is
            # cut off without its last chunk (raised to the server, which closes the
            # connection), so the client sees it incomplete rather than taking what came for
            # the whole answer.
            failure, why = broke.args
            span.set_status(trace.StatusCode.ERROR, failure)
            if sse:
                self.metrics.errors.labels(deployment, "upstream_stream").inc()
                record = self.table.replicas.get(key)
                where = f"replica {record.replica} at {record.url}" if record else f"replica {key}"
                outcome = (
                    "the answer is incomplete: continuing it on another replica was tried and could "
                    f"not be: {why}"
                    if why
                    else "the answer is incomplete and was not retried"
                )
                yield sse_error(
                    f"{where} of deployment {deployment} broke off its answer: {failure}; {outcome}", sse
                )
            else:
                self.metrics.errors.labels(deployment, "upstream").inc()
                raise BrokenAnswer(
                    f"{deployment}: {key} broke off its answer: {failure}"
                ) from broke.__cause__
        finally:
            if seam is not None:
                seam.end()
            adapter = routed.adapter if routed is not None else ""
            self.relay_end(
                upstream, key, deployment, span, reservation, meter, tail, ended=ended, adapter=adapter
            )

    def draining(self, key: str) -> bool:
        """Whether placement drains the replica (a node drained, a scale down, a replacement)."""
        record = self.table.replicas.get(key)
        return record is not None and record.state == "draining"

    def continues(self) -> bool:
        """Whether answers broken off are continued on another replica."""
        return self.resend is not None and self.table.routing.continuations > 0

    async def continued(
        self, routed: Routed, path: str, held: Held, broken: frozenset[str], fingerprint: str
    ) -> tuple[str, Answer, Splice] | str:
        """The rest of an answer the replicas in `broken` broke off (or handed over), asked of
        another ready replica of profile fingerprint `fingerprint`: its key, its streamed answer
        and the splice that makes it the rest of the client's; or why it could not be."""
        limit = self.table.routing.continuations
        if len(broken) > limit:
            times = f"{limit} time{'' if limit == 1 else 's'}"
            return f"it was continued {times} already (the gateway's routing: continuations)"
        if held.over or self.resend is None:
            return "the answer passed on is too long to continue"
        chat = CONTINUED_PATHS[path]
        try:
            had = partial_of(held.data(), chat=chat)
        except ContinuationError as exc:
            return str(exc)

        def routed_for(record: ReplicaRecord) -> Routed:
            payload = continuation_body(routed.payload, had, chat=chat, engine=record.engine)
            return dataclasses.replace(routed, payload=payload, body=json.dumps(payload).encode())

        sent = await self.resend(routed, routed_for, path, broken, fingerprint)
        if isinstance(sent, str):
            return sent
        record = self.table.replicas.get(sent[0])
        echoed = chat and record is not None and record.engine in PREFILLS
        return sent[0], sent[1], Splice(had, echoed=echoed)

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
        adapter: str = "",
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
        self.ledger.done(key, deployment, span, reservation, meter, adapter)


async def _after(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`first` (what was read of an answer before its relay began), then the rest of it."""
    if first:
        yield first
    async for chunk in rest:
        yield chunk
