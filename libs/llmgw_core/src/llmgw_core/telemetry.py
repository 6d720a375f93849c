"""Traces and logs for every llmgw process.

Traces go over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (Jaeger in
compose.yaml listens on :4318); the trace context crosses services in message
headers (see bus/tracing.py). Log lines carry the current trace id so a log line and
a span can be matched.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .version import llmgw_version


class _TraceIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else "-"
        return True


def setup(service: str, *, node: str = "", level: str | None = None) -> None:
    """Configure logging and, when an OTLP endpoint is set, trace export for `service`.

    `service` names the kind of process (`llmgw-launcher`), the same on every node, so a
    trace viewer shows one service per kind; `node` tells the instances apart
    (`service.instance.id`, and `llmgw.node` to search by)."""
    handler = logging.StreamHandler()
    handler.addFilter(_TraceIdFilter())
    who = f"{service}/{node}" if node else service
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {who} %(name)s trace=%(trace_id)s %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level or os.environ.get("LLMGW_LOG_LEVEL", "INFO"))
    # One line per health probe would drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create(resource_attributes(service, node)))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)


def resource_attributes(service: str, node: str = "") -> dict[str, str]:
    attributes = {"service.name": service, "service.namespace": "llmgw", "service.version": llmgw_version()}
    if node:
        attributes |= {"service.instance.id": node, "llmgw.node": node}
    return attributes


_propagator = TraceContextTextMapPropagator()


def current_traceparent() -> str:
    """The current span's W3C traceparent, to store in a KV value that headers cannot reach."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier.get("traceparent", "")


def context_from(traceparent: str) -> otel_context.Context:
    """A context whose parent is `traceparent` (the current one if empty)."""
    if not traceparent:
        return otel_context.get_current()
    return _propagator.extract({"traceparent": traceparent})


def links(traceparents: Iterable[str]) -> list[trace.Link]:
    """Span links to each distinct, valid `traceparent`, in order: for a span that does the
    work of many traces at once (one commit of many deployments' placements), so that each
    deployment's trace leads to it. Empty and malformed ones are skipped."""
    found: list[trace.Link] = []
    seen: set[tuple[int, int]] = set()
    for traceparent in traceparents:
        if not traceparent:
            continue
        ctx = trace.get_current_span(_propagator.extract({"traceparent": traceparent})).get_span_context()
        if ctx.is_valid and (ctx.trace_id, ctx.span_id) not in seen:
            seen.add((ctx.trace_id, ctx.span_id))
            found.append(trace.Link(ctx))
    return found
