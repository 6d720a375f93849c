"""The gateway's traces by OpenTelemetry's conventions: a client's `traceparent` continued,
the server span named `POST /v1/chat/completions` with the HTTP and GenAI attributes (token
counts included), and the context passed on to the replica."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
    GEN_AI_OPERATION_NAME,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_USAGE_INPUT_TOKENS,
    GEN_AI_USAGE_OUTPUT_TOKENS,
)
from opentelemetry.semconv.attributes.http_attributes import (
    HTTP_REQUEST_METHOD,
    HTTP_RESPONSE_STATUS_CODE,
    HTTP_ROUTE,
)
from opentelemetry.semconv.attributes.server_attributes import SERVER_ADDRESS, SERVER_PORT
from opentelemetry.semconv.attributes.url_attributes import URL_PATH
from opentelemetry.trace import NoOpTracer, SpanKind
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmgw_core.events import ReplicaRecord
from llmgw_gateway import Proxy, Table
from llmgw_gateway.web import serve_app
from tests.gateway_support import serve_proxy

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def replica_app(seen: list[dict[str, str]]) -> Starlette:
    """An engine at the HTTP seam: records each completion request's headers and answers it
    with a usage object (last chunk of a stream, as OpenAI's `include_usage` asks)."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def chat(request: Request) -> Response:
        seen.append(dict(request.headers))
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"object": "chat.completion", "choices": [], "usage": USAGE})

        async def events() -> AsyncIterator[bytes]:
            delta = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
            yield f"data: {json.dumps(delta)}\n\n".encode()
            yield f"data: {json.dumps({'choices': [], 'usage': USAGE})}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
    )


def one_replica(engine_port: int) -> Table:
    table = Table()
    table.set_replica(
        "chat.r0",
        ReplicaRecord(
            deployment="chat",
            replica="r0",
            profile="tiny",
            profile_fp="x",
            state="ready",
            url=f"http://127.0.0.1:{engine_port}",
            engine="sim",
        ),
    )
    return table


async def test_a_clients_trace_continues_through_the_gateway_to_the_replica() -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    seen: list[dict[str, str]] = []
    async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=30) as client:
        engine_port = await tg.start(serve_app, replica_app(seen), "127.0.0.1", 0)
        async with Proxy(one_replica(engine_port), client, tracer=provider.get_tracer("test")) as proxy:
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
            chat = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
            plain = await client.post(url, json=chat, headers={"traceparent": traceparent})
            assert plain.status_code == 200, plain.text
            async with client.stream(
                "POST", url, json={**chat, "stream": True}, headers={"traceparent": traceparent}
            ) as streamed:
                assert streamed.status_code == 200
                sse = b"".join([chunk async for chunk in streamed.aiter_raw()])
            # Without a traceparent: a trace of its own.
            alone = await client.post(url, json=chat)
            assert alone.status_code == 200
            tg.cancel_scope.cancel()
    # The client did not ask for the usage chunk: it is not passed on, but counted.
    assert b'"usage"' not in sse

    finished = [s for s in spans.get_finished_spans() if s.kind == SpanKind.SERVER]
    assert len(finished) == 3, finished
    for span in finished:
        assert span.name == "POST /v1/chat/completions"
        assert span.attributes is not None
        assert {k: span.attributes.get(k) for k in _EXPECTED} == {
            **_EXPECTED,
            SERVER_PORT: port,
        }
    continued, alone_span = finished[:2], finished[2]
    for span in continued:
        assert format(span.context.trace_id, "032x") == CLIENT_TRACE
        assert span.parent is not None
        assert span.parent.is_remote
        assert format(span.parent.span_id, "016x") == CLIENT_SPAN
    assert format(alone_span.context.trace_id, "032x") != CLIENT_TRACE
    assert alone_span.parent is None

    # Each replica request's parent is the gateway's span for it.
    assert [h["traceparent"].rsplit("-", 1)[0] for h in seen] == [
        f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}" for s in finished
    ]


_EXPECTED: dict[str, object] = {
    HTTP_REQUEST_METHOD: "POST",
    HTTP_ROUTE: "/v1/chat/completions",
    URL_PATH: "/v1/chat/completions",
    SERVER_ADDRESS: "127.0.0.1",
    SERVER_PORT: 0,
    HTTP_RESPONSE_STATUS_CODE: 200,
    GEN_AI_OPERATION_NAME: "chat",
    GEN_AI_REQUEST_MODEL: "chat",
    GEN_AI_USAGE_INPUT_TOKENS: 7,
    GEN_AI_USAGE_OUTPUT_TOKENS: 3,
    "http.status_code": None,
}


async def test_a_gateway_that_keeps_no_traces_passes_a_clients_trace_on_as_it_came() -> None:
    """Without an OTLP endpoint the gateway's tracer is OpenTelemetry's no-op one: the client's
    `traceparent` and `tracestate` reach the replica as the client sent them, and a request that
    came without them gets none. The first request to the replica takes the ASGI path (its model
    name not read yet), the others the express lane."""
    seen: list[dict[str, str]] = []
    traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    sent = [{"traceparent": traceparent, "tracestate": "vendor=1"}, {}, {"traceparent": traceparent}, {}]
    async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=30) as client:
        engine_port = await tg.start(serve_app, replica_app(seen), "127.0.0.1", 0)
        async with Proxy(one_replica(engine_port), client, tracer=NoOpTracer()) as proxy:
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            chat = {"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
            for headers in sent:
                r = await client.post(url, json=chat, headers=headers)
                assert r.status_code == 200, r.text
            tg.cancel_scope.cancel()
    assert [(h.get("traceparent"), h.get("tracestate")) for h in seen] == [
        (traceparent, "vendor=1"),
        (None, None),
        (traceparent, None),
        (None, None),
    ]
