"""A continuation as the relay counts, times and traces it: why the replica's stream ended
(`cause_of`: the connection lost, an error event, a read timeout, or the replica draining), and
the seam (`Seam`) from that break to the continuing replica's first event passed on, a span of
the request and an observation of `llmgw_gateway_continuation_seam_seconds`.

A draining replica's stream is handed over (`Handover`, raised at an event boundary once
another replica took the rest): placement stops a draining replica once the gateways report
nothing in flight on it, so a drain takes as long as the handover, not the longest answer."""

from __future__ import annotations

import time

from opentelemetry import trace

from .answer import Answer, Broken, ReadTimeout
from .continuation import Splice
from .metrics import Metrics

# The causes of a continuation (`llmgw_gateway_continued_total{cause}`).
CONNECTION_LOST = "connection_lost"
ERROR_EVENT = "error_event"
TIMEOUT = "timeout"
DRAINED = "drained"


class ErrorEvent(Broken):
    """The engine sent an error event mid-stream: it gave up on the answer."""


class Handover(Exception):
    """The replica relayed from began draining, and another took the rest of its stream: the
    continuing replica's key, its streamed answer and its splice (`Relays.continued`)."""

    def __init__(self, went: tuple[str, Answer, Splice], seam: Seam) -> None:
        super().__init__("the replica is draining")
        self.went = went
        self.seam = seam


def cause_of(exc: BaseException) -> str:
    """The kind of a replica's break, as the continued counter names it."""
    if isinstance(exc, ErrorEvent):
        return ERROR_EVENT
    if isinstance(exc, ReadTimeout):
        return TIMEOUT
    return CONNECTION_LOST


class Seam:
    """One continuation from the break (`__init__`) to its first event passed on (`joined`),
    or to why none took it (`failed`): a span of the request, child of its span, and the seam's
    time observed. Ended once; `end` ends it where neither came (the client left)."""

    __slots__ = ("at", "cause", "deployment", "metrics", "span")

    def __init__(
        self,
        tracer: trace.Tracer,
        request: trace.Span,
        metrics: Metrics,
        deployment: str,
        cause: str,
        key: str,
    ) -> None:
        self.at = time.monotonic()
        self.metrics = metrics
        self.deployment = deployment
        self.cause = cause
        self.span: trace.Span | None = tracer.start_span(
            "continuation",
            context=trace.set_span_in_context(request),
            attributes={
                "llmgw.deployment": deployment,
                "llmgw.continuation.cause": cause,
                "llmgw.replica": key,
            },
        )

    def taken(self, key: str, tokens: int) -> None:
        """Another replica took the rest: counted, and named on the span."""
        self.metrics.continued.labels(self.deployment, self.cause).inc()
        if self.span is not None:
            self.span.set_attributes(
                {"llmgw.continuation.replica": key, "llmgw.continuation.tokens_before": tokens}
            )

    def joined(self) -> None:
        """The continuing replica's first event went out: the seam, observed."""
        if self.span is None:
            return
        seam = time.monotonic() - self.at
        self.metrics.seam.labels(self.deployment).observe(seam)
        self.span.set_attribute("llmgw.continuation.seam_s", seam)
        self.span.end()
        self.span = None

    def failed(self, why: str) -> None:
        """No replica took the rest: why, on the span."""
        if self.span is not None:
            self.span.set_status(trace.StatusCode.ERROR, why)
            self.span.end()
            self.span = None

    def end(self) -> None:
        if self.span is not None:
            self.span.end()
            self.span = None
