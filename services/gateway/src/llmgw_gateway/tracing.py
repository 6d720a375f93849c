"""A routed request's server span: the client's trace continued (its `traceparent`, if any),
the span's attributes by OpenTelemetry's HTTP and GenAI conventions, and the headers a
replica gets, the trace's carried on in them."""

from __future__ import annotations

from urllib.parse import urlsplit

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from starlette.types import Scope

from .surface import HOP_BYTES, OPERATION, first


def server_span(tracer: trace.Tracer, scope: Scope, model: str, deployment: str) -> trace.Span:
    span = tracer.start_span(
        f"{scope['method']} {scope['path']}",
        # The client's trace continues here (its `traceparent`, if any), on to the engine.
        context=client_context(scope["headers"]),
        kind=trace.SpanKind.SERVER,
    )
    if span.is_recording():
        # Read only where traces are kept (OTEL_EXPORTER_OTLP_ENDPOINT set).
        span.set_attributes(server_attributes(scope, model, deployment))
    return span


# The answer's header naming the replica that served it (`<deployment>/<replica>`): with several
# gateways behind a balancer, an operator (or a test) sees where each answer came from.
SERVED_BY = b"x-llmgw-replica"
# The span's attribute saying why that replica was chosen (`Table.reason`).
ROUTE_ATTRIBUTE = "llmgw.route"


def served_by(deployment: str, key: str) -> tuple[bytes, bytes]:
    """The `x-llmgw-replica` header of an answer from replica `key` (`<deployment>.<replica>`)."""
    return SERVED_BY, f"{deployment}/{key[len(deployment) + 1 :]}".encode()


def chose(span: trace.Span, reason: str) -> None:
    """The routing choice's reason on the request's span (the last choice's, after a retry)."""
    if span.is_recording():
        span.set_attribute(ROUTE_ATTRIBUTE, reason)


def replica_headers(raw: list[tuple[bytes, bytes]], span: trace.Span) -> list[tuple[bytes, bytes]]:
    """The request's headers as the server read them (names in lower case), less the
    hop-by-hop ones, the trace's continued in the gateway's span."""
    if not span.get_span_context().is_valid:
        # No trace to continue (none kept here, and the client sent none): nothing to add.
        return [(k, v) for k, v in raw if k not in HOP_BYTES]
    context: dict[str, str] = {}
    propagate.inject(context, context=trace.set_span_in_context(span))
    traced = {k.encode() for k in context}
    headers = [(k, v) for k, v in raw if k not in HOP_BYTES and k not in traced]
    headers += [(k.encode(), v.encode("latin-1")) for k, v in context.items()]
    return headers


def server_attributes(scope: Scope, model: str, deployment: str) -> dict[str, str | int]:
    """A routed request's server span attributes, by OpenTelemetry's HTTP and GenAI semantic
    conventions (the stable names: `http.request.method`, `url.path`, `server.address`…;
    the response's status and the token counts are added when they are known). Read from the
    ASGI scope and the `Host` header, not a whole URL built: that cost more than the rest."""
    path: str = scope["path"]
    attributes: dict[str, str | int] = {
        "http.request.method": scope["method"],
        "http.route": path,
        "url.path": path,
        "url.scheme": scope["scheme"],
        "gen_ai.operation.name": OPERATION.get(path, "chat"),
        "gen_ai.request.model": model[:256],
        "llmgw.deployment": deployment,
    }
    headers = scope["headers"]
    host = first(headers, b"host")
    if host:
        try:
            where = urlsplit(f"//{host}")
            hostname, port = where.hostname, where.port
        except ValueError:  # a Host header that names no host and port: no attribute from it
            hostname, port = None, None
        if hostname:
            attributes["server.address"] = hostname
        if port:
            attributes["server.port"] = port
    client = scope.get("client")
    if client:
        attributes["client.address"] = client[0]
    agent = first(headers, b"user-agent")
    if agent:
        attributes["user_agent.original"] = agent[:256]
    return attributes


class _RawHeadersGetter(Getter[list[tuple[bytes, bytes]]]):
    """The trace propagators' reader of the request's headers as the server read them."""

    def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.lower().encode("latin-1")
        values = [v.decode("latin-1") for n, v in carrier if n == name]
        return values or None

    def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [n.decode("latin-1") for n, _ in carrier]


_RAW_HEADERS = _RawHeadersGetter()


class _TraceFields:
    """The headers the trace propagators read (their `fields`; W3C trace context and baggage:
    `traceparent`, `tracestate`, `baggage`), as the server reads names: looked up again only
    when another propagator is set."""

    __slots__ = ("names", "textmap")

    def __init__(self) -> None:
        self.textmap: object = None
        self.names: frozenset[bytes] = frozenset()

    def of(self, textmap: TextMapPropagator) -> frozenset[bytes]:
        if textmap is not self.textmap:
            self.names = frozenset(f.lower().encode("latin-1") for f in textmap.fields)
            self.textmap = textmap
        return self.names


_TRACE_FIELDS = _TraceFields()
# What a request without trace headers continues: nothing (as the propagators make of it).
_NO_TRACE = Context()


def client_context(headers: list[tuple[bytes, bytes]]) -> Context:
    """The trace context the client sent in `headers`; the propagators are not asked where
    none of their headers came (most requests)."""
    textmap = propagate.get_global_textmap()
    names = _TRACE_FIELDS.of(textmap)
    for name, _ in headers:
        if name in names:
            return propagate.extract(headers, getter=_RAW_HEADERS)
    return _NO_TRACE
