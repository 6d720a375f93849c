"""Trace context on the bus: W3C headers on what is sent, spans where a provider records them."""

from __future__ import annotations

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

tracer = trace.get_tracer("llmgw.bus")


def tracing() -> bool:
    """Whether spans go anywhere: a tracer provider was set (`telemetry.setup` sets one only
    when an OTLP endpoint is configured; tests set their own)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def inject_trace(headers: dict[str, str]) -> None:
    """Add the current trace context's headers (`traceparent`, `tracestate`, baggage).
    An empty context (no span, no baggage) has nothing to propagate: asking every
    configured propagator to say so costs more than the rest of a publish's headers."""
    if otel_context.get_current():
        propagate.inject(headers)


def messaging(subject: str, operation: str, data: bytes) -> dict[str, str | int]:
    """OpenTelemetry's messaging attributes for a span that sends or handles one NATS message."""
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.message.body.size": len(data),
    }
