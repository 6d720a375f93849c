"""The gateway as clients find it: the official `openai` and `anthropic` clients, curl's
`x-api-key`, a load generator's `GET /health`, against a stand-in llama-server (a real HTTP
server on loopback answering as llama-server does: Anthropic's usage with its cache counts,
the Responses API, no embeddings without `--embeddings`). Also what the gateway's parsers of
an engine's bytes and of placement's refusal make of anything (hypothesis)."""

from __future__ import annotations

import contextlib
import gzip
import json
import time
import tracemalloc
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmgw_core.engines import LlamaCpp, default_registry
from llmgw_core.events import Autoscale, Deployment, DeploymentStatus, NodeReason, ReplicaRecord
from llmgw_gateway import Proxy, Table
from llmgw_gateway.keyring import Keyring, Refused, file_keys
from llmgw_gateway.routing import REFUSAL_CHARS, refusal_text
from llmgw_gateway.usage import MAX_INFLATED_BYTES, MAX_TOKENS, TAIL_BYTES, JsonTail, Meter
from llmgw_gateway.web import serve_app
from tests.gateway_support import serve_proxy
from tests.waiting import eventually

pytestmark = [pytest.mark.timeout(120)]

SECRET = "sk-llmgw-clients-test"
CHAT = [{"role": "user", "content": "hello"}]
# llama-server's Anthropic usage for a 322-token prompt of which it had 169 cached.
CACHED_USAGE = {"input_tokens": 153, "cache_read_input_tokens": 169, "output_tokens": 5}


@dataclass
class Engine:
    """A stand-in llama-server: what it was sent, and a gate on its streamed answers."""

    url: str = ""
    seen: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    # Set to let a streamed chat answer's head go out.
    go: anyio.Event = field(default_factory=anyio.Event)
    # Answer a chat not streamed in chunks of no given length (as a proxy in front may).
    chunked: bool = False


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events)


def _message(usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "tiny.gguf",
        "content": [{"type": "text", "text": "hi"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": usage,
    }


def llama_server(engine: Engine) -> Starlette:
    """As llama-server answers: the model it serves, Anthropic's Messages API (its `input_tokens`
    without the prompt tokens it had cached, counted in `cache_read_input_tokens`), OpenAI's chat
    (its `prompt_tokens` with them, `cached_tokens` a part of it), the Responses API, and 501
    on embeddings (no `--embeddings`)."""

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny.gguf", "object": "model"}]})

    async def messages(request: Request) -> Response:
        body = await request.json()
        engine.seen.append((request.url.path, dict(request.headers)))
        if not body.get("stream"):
            return JSONResponse(_message({**CACHED_USAGE, "cache_creation_input_tokens": 0}))
        start = {**_message({**CACHED_USAGE, "output_tokens": 1}), "content": []}
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"type": "message_start", "message": start}),
            (
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            ),
            (
                "content_block_delta",
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
            ),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": {"output_tokens": 5},
                },
            ),
            ("message_stop", {"type": "message_stop"}),
        ]
        return Response(_sse(events), media_type="text/event-stream")

    async def chat(request: Request) -> Response:
        body = await request.json()
        engine.seen.append((request.url.path, dict(request.headers)))
        usage = {
            "prompt_tokens": 322,
            "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 169},
        }
        if engine.chunked:

            async def pieces() -> AsyncIterator[bytes]:
                yield b'{"id": "c1", "choices": [], '
                await anyio.sleep(0.1)  # the rest after the head: the gateway passes it on in pieces
                yield json.dumps({"usage": usage}).encode()[1:]

            return StreamingResponse(pieces(), media_type="application/json")
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "c1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "tiny.gguf",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                }
            )
        await engine.go.wait()

        async def chunks() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def responses(request: Request) -> Response:
        engine.seen.append((request.url.path, dict(request.headers)))
        return JSONResponse(
            {
                "id": "resp_1",
                "object": "response",
                "created_at": 0,
                "status": "completed",
                "model": "tiny.gguf",
                "output": [
                    {
                        "type": "message",
                        "id": "msg_1",
                        "status": "completed",
                        "role": "assistant",
                        "content": [{"type": "output_text", "text": "hi", "annotations": []}],
                    }
                ],
                "parallel_tool_calls": False,
                "tool_choice": "auto",
                "tools": [],
                "usage": {
                    "input_tokens": 10,
                    "input_tokens_details": {"cached_tokens": 4},
                    "output_tokens": 2,
                    "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": 12,
                },
            }
        )

    async def embeddings(request: Request) -> Response:
        engine.seen.append((request.url.path, dict(request.headers)))
        error = {
            "code": 501,
            "message": "This server does not support embeddings.",
            "type": "not_supported_error",
        }
        return JSONResponse({"error": error}, status_code=501)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/models", models),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/embeddings", embeddings, methods=["POST"]),
        ]
    )


@dataclass
class Setup:
    url: str
    proxy: Proxy
    table: Table
    engine: Engine


@contextlib.asynccontextmanager
async def gateway(*, replica: bool = True, keys: bool = True) -> AsyncIterator[Setup]:
    """The gateway's proxy, served as `llmgw-gateway` serves it, over one ready llama.cpp replica
    of deployment `chat` (the stand-in llama-server), keys required (SECRET) unless `keys` is
    false."""
    engine = Engine()
    table = Table()
    table.set_deployment("chat", Deployment(name="chat", profile="tiny", replicas=1))
    async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=10) as client:
        port = await tg.start(serve_app, llama_server(engine), "127.0.0.1", 0)
        engine.url = f"http://127.0.0.1:{port}"
        if replica:
            table.set_replica(
                "chat.r0",
                ReplicaRecord(
                    deployment="chat",
                    replica="r0",
                    profile="tiny",
                    profile_fp="x",
                    state="ready",
                    url=engine.url,
                    engine="llamacpp",
                ),
            )
        api_keys = frozenset({SECRET}) if keys else frozenset()
        async with Proxy(table, client, api_keys=api_keys) as proxy:
            proxy.loaded.set()
            gw_port = await tg.start(serve_proxy, proxy)
            yield Setup(f"http://127.0.0.1:{gw_port}", proxy, table, engine)
            tg.cancel_scope.cancel()


def _prompt_tokens(proxy: Proxy) -> float:
    key = next(iter(file_keys(frozenset({SECRET})).values())).name
    value = proxy.metrics.registry.get_sample_value(
        "llmgw_gateway_prompt_tokens_total", {"key": key, "deployment": "chat"}
    )
    return value or 0.0


# --- placement's refusal: answered at once ------------------------------------------------


def _unplaceable(nodes: int) -> DeploymentStatus:
    reasons = [NodeReason(node=f"n{i}", reason="no GPU of class H100-80G") for i in range(nodes - 1)]
    reasons.append(NodeReason(node="big-1", reason="0 of 8 GPUs free"))
    return DeploymentStatus(
        deployment="chat",
        desired=1,
        unplaceable=1,
        summary="chat: 0 of 1 ready; 1 cannot be placed: …",
        reasons=tuple(reasons),
    )


REFUSED = (
    "deployment chat cannot be placed on any node, so no replica will serve it until the cluster "
    "changes: no GPU of class H100-80G on n0, n1, n2 and 3 more; 0 of 8 GPUs free on big-1. "
    "`llmgw ctl explain chat` shows every node's reason"
)


@pytest.mark.anyio
async def test_a_deployment_placement_refused_everywhere_is_answered_at_once_and_not_retried() -> None:
    """Held 120 s and answered 503 `Retry-After: 10`, the openai client's default retries took
    381 s to show the reason. Now: 422 at once, placement's reasons grouped, nothing inviting
    a retry, and the client (its default 2 retries) raises within a second."""
    async with gateway(replica=False) as gw:
        gw.table.set_status(_unplaceable(7))
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET) as client:
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(openai.UnprocessableEntityError) as refused:
                await client.chat.completions.create(model="chat", messages=CHAT)  # type: ignore[arg-type]
            assert time.monotonic() - started < 1.5
        assert refused.value.status_code == 422
        assert refused.value.body == {
            "message": REFUSED,
            "type": "invalid_request_error",
            "param": "model",
            "code": "deployment_unplaceable",
        }
        assert "retry-after" not in refused.value.response.headers
        assert refused.value.response.headers["x-should-retry"] == "false"
        errors = gw.proxy.metrics.registry.get_sample_value(
            "llmgw_gateway_errors_total", {"deployment": "chat", "reason": "unplaceable"}
        )
        assert errors == 1  # one request: the client did not retry

        # A deployment at zero that is scaling (no refusal) is still held for a replica: here
        # until placement refuses it, then answered at once with placement's reasons.
        gw.table.set_deployment(
            "chat", Deployment(name="chat", profile="tiny", replicas=0, autoscale=Autoscale(max_replicas=2))
        )
        gw.table.set_status(DeploymentStatus(deployment="chat", desired=0))
        async with httpx.AsyncClient(timeout=30) as raw:
            answers: list[httpx.Response] = []

            async def ask() -> None:
                headers = {"authorization": f"Bearer {SECRET}"}
                body = {"model": "chat", "messages": CHAT}
                answers.append(await raw.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers))

            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await eventually(lambda: gw.proxy.holds.queued("chat") == 1, timeout=5)
                gw.table.set_status(_unplaceable(2))
                gw.proxy.replicas_changed("chat")  # as the service does on each status
                with anyio.fail_after(2):
                    await eventually(lambda: answers, timeout=2)
        (held,) = answers
        assert held.status_code == 422, held.text
        assert held.json()["error"]["message"].startswith(
            "deployment chat cannot be placed on any node, so no replica will serve it until the "
            "cluster changes: 0 of 8 GPUs free on big-1; no GPU of class H100-80G on n0."
        ), held.text


def test_placements_refusal_is_grouped_and_bounded() -> None:
    status = _unplaceable(7)
    assert refusal_text("chat", status) == REFUSED
    # A thousand nodes, each with a reason of its own and a long one: still one short message.
    many = DeploymentStatus(
        deployment="chat",
        desired=1,
        unplaceable=1,
        reasons=tuple(NodeReason(node=f"node-{i}", reason=f"reason {i} " + "x" * 5000) for i in range(1000)),
    )
    text = refusal_text("chat", many)
    assert len(text) == REFUSAL_CHARS
    assert text.endswith("…")
    assert text.startswith("deployment chat cannot be placed on any node, so no replica will serve it "), text
    # Without node reasons, placement's summary.
    bare = DeploymentStatus(deployment="chat", desired=1, unplaceable=1, summary="chat: 0 of 1 ready")
    assert refusal_text("chat", bare).endswith(
        ": chat: 0 of 1 ready. `llmgw ctl explain chat` shows every node's reason"
    )


def test_only_a_deployment_nothing_can_serve_is_refused() -> None:
    """Held while something can still serve it: a replica placed (loading, staging), or no
    refusal; refused only where none is placed and placement placed none."""
    table = Table()
    table.set_deployment("chat", Deployment(name="chat", profile="tiny", replicas=1))
    assert table.refused("chat") is None  # placement has not spoken
    table.set_status(_unplaceable(2))
    assert table.refused("chat") is not None
    table.set_replica(
        "chat.r0",
        ReplicaRecord(deployment="chat", replica="r0", profile="tiny", profile_fp="x", state="starting"),
    )
    assert table.refused("chat") is None  # a replica staging on a node: held for it
    table.set_replica("chat.r0", None)
    table.set_status(DeploymentStatus(deployment="chat", desired=2, pending=1, unplaceable=1))
    assert table.refused("chat") is None  # one placed, not yet seen here
    table.set_status(DeploymentStatus(deployment="chat", desired=1))
    assert table.refused("chat") is None  # placed since
    # No node known yet (a cluster starting), or one installing the engine: held for it.
    for reasons in [
        (),
        (NodeReason(node="n1", reason="engine llamacpp installing: downloading 40%"),),
        (NodeReason(node="n1", reason="installing: llamacpp b11434"),),
        (NodeReason(node="n1", reason="engine vllm not installed"), NodeReason(node="n2", reason="lost")),
    ]:
        status = DeploymentStatus(deployment="chat", desired=1, unplaceable=1, reasons=reasons)
        table.set_status(status)
        assert table.refused("chat") is None, reasons
    table.set_status(
        DeploymentStatus(
            deployment="chat",
            desired=1,
            unplaceable=1,
            reasons=(NodeReason(node="n1", reason="engine vllm broken"),),
        )
    )
    assert table.refused("chat") is not None


@given(
    st.lists(st.tuples(st.text(max_size=300), st.text(max_size=300)), max_size=60),
    st.text(max_size=3000),
)
@settings(max_examples=150, deadline=None)
def test_fuzz_refusal_text_is_bounded(reasons: list[tuple[str, str]], summary: str) -> None:
    status = DeploymentStatus(
        deployment="chat",
        desired=1,
        unplaceable=1,
        summary=summary,
        reasons=tuple(NodeReason(node=n, reason=r) for n, r in reasons),
    )
    assert len(refusal_text("chat", status)) <= REFUSAL_CHARS


# --- usage: every token the engine reports --------------------------------------------------


@pytest.mark.anyio
async def test_messages_usage_counts_the_prompt_tokens_llama_server_had_cached() -> None:
    """llama-server's /v1/messages says 153 `input_tokens` and 169 `cache_read_input_tokens` for a
    322-token prompt: 322 are charged, whole or streamed; OpenAI's `prompt_tokens` already hold
    their `cached_tokens`, which are not added again. The key comes in `x-api-key`, as the
    anthropic client sends it, and is not passed to the replica."""
    async with gateway() as gw:
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=SECRET, max_retries=0) as claude:
            message = await claude.messages.create(model="chat", max_tokens=8, messages=CHAT)  # type: ignore[arg-type]
            assert message.content[0].type == "text"
            assert _prompt_tokens(gw.proxy) == 322
            stream = await claude.messages.create(model="chat", max_tokens=8, messages=CHAT, stream=True)  # type: ignore[arg-type]
            kinds = [event.type async for event in stream]
            assert (kinds[0], kinds[-1]) == ("message_start", "message_stop"), kinds
            await eventually(lambda: _prompt_tokens(gw.proxy) == 644, timeout=5)
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as client:
            await client.chat.completions.create(model="chat", messages=CHAT)  # type: ignore[arg-type]
            await eventually(lambda: _prompt_tokens(gw.proxy) == 966, timeout=5)
        for path, headers in gw.engine.seen:
            assert not {"x-api-key", "authorization"} & set(headers), (path, headers)


def test_meter_adds_anthropics_cache_counts_and_not_openais() -> None:
    meter = Meter()
    meter.take({"usage": {**CACHED_USAGE, "cache_creation_input_tokens": 20}})
    assert (meter.prompt, meter.completion) == (342, 5)
    # An Anthropic stream: message_start says the prompt, message_delta the output only.
    meter = Meter()
    meter.take({"type": "message_start", "message": {"usage": {**CACHED_USAGE, "output_tokens": 1}}})
    meter.take({"type": "message_delta", "usage": {"output_tokens": 9}})
    assert (meter.prompt, meter.completion) == (322, 9)
    # OpenAI's chat and the Responses API: the cached tokens are a part of the prompt's.
    meter = Meter()
    meter.take({"usage": {"prompt_tokens": 322, "prompt_tokens_details": {"cached_tokens": 169}}})
    assert meter.prompt == 322
    meter = Meter()
    meter.take({"response": {"usage": {"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}}}})
    assert meter.prompt == 10
    # A count out of range is not read; the sum is held to MAX_TOKENS.
    meter = Meter()
    meter.take(
        {"usage": {"input_tokens": MAX_TOKENS, "cache_read_input_tokens": MAX_TOKENS, "output_tokens": -3}}
    )
    assert (meter.prompt, meter.completion) == (MAX_TOKENS, 0)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=30), inner, max_size=6),
    max_leaves=30,
)
_USAGE_NAMES = st.sampled_from(
    [
        "prompt_tokens",
        "input_tokens",
        "completion_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ]
)


@given(
    st.dictionaries(_USAGE_NAMES, _JSON | st.integers(min_value=-(2**70), max_value=2**70), max_size=6),
    st.sampled_from([None, "message", "response"]),
)
@settings(max_examples=300, deadline=None)
def test_fuzz_meter_reads_any_usage_within_bounds(usage: dict[str, Any], holder: str | None) -> None:
    meter = Meter()
    meter.take({holder: {"usage": usage}} if holder else {"usage": usage})
    assert 0 <= meter.prompt <= MAX_TOKENS
    assert 0 <= meter.completion <= MAX_TOKENS


# --- an encoded answer: inflated within a bound -----------------------------------------------


def test_a_gzip_bomb_from_a_replica_is_inflated_within_a_bound() -> None:
    """`JsonTail` inflated a gzip body whole: 96 MiB of zeros, 80 KB on the wire, read 64 KiB
    at a time, held 149 MB at its peak. Now a tail's worth at a time (0.5 MB), and the answer
    is left unread past the bound."""
    squeeze = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    block = bytes(1 << 20)
    bomb = b"".join(squeeze.compress(block) for _ in range((MAX_INFLATED_BYTES >> 20) + 16)) + squeeze.flush()
    assert len(bomb) < 200 << 10
    tail = JsonTail("gzip")
    tracemalloc.start()
    try:
        for at in range(0, len(bomb), 64 << 10):
            tail.feed(bomb[at : at + (64 << 10)])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * TAIL_BYTES + (1 << 20), peak
    assert tail.unread
    meter = Meter()
    tail.read(meter)
    assert (meter.prompt, meter.completion) == (0, 0)

    # An honest gzip answer, in any pieces, is read: its usage is at its end.
    body = gzip.compress(json.dumps({"choices": ["x" * 200_000], "usage": {"prompt_tokens": 7}}).encode())
    tail = JsonTail("gzip")
    for at in range(0, len(body), 1000):
        tail.feed(body[at : at + 1000])
    meter = Meter()
    tail.read(meter)
    assert meter.prompt == 7
    assert not tail.unread


@given(st.binary(max_size=4096), st.sampled_from(["gzip", "deflate", ""]), st.integers(1, 512))
@settings(max_examples=300, deadline=None)
def test_fuzz_json_tail_takes_any_bytes(data: bytes, encoding: str, piece: int) -> None:
    tail = JsonTail(encoding)
    for at in range(0, len(data), piece):
        tail.feed(data[at : at + piece])
    meter = Meter()
    tail.read(meter)
    assert 0 <= meter.prompt <= MAX_TOKENS
    assert 0 <= meter.completion <= MAX_TOKENS


# --- the endpoints llama.cpp serves --------------------------------------------------------


def test_llamacpp_serves_responses_and_is_not_advertised_for_embeddings() -> None:
    """llama-server serves /v1/responses; it answers embeddings only with `--embeddings`, which
    makes it refuse every completion, so llmgw neither passes it nor advertises embeddings."""
    paths = default_registry().api_paths("llamacpp")
    assert paths is not None
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"} <= paths
    assert "/v1/embeddings" not in paths
    assert LlamaCpp.api_paths == paths


@pytest.mark.anyio
async def test_responses_reach_llama_server_and_embeddings_are_answered_by_the_gateway() -> None:
    async with gateway() as gw:
        async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=SECRET, max_retries=0) as client:
            response = await client.responses.create(model="chat", input="hello")
            assert response.output_text == "hi"
            with pytest.raises(openai.BadRequestError) as unserved:
                await client.embeddings.create(model="chat", input="a")
        assert unserved.value.body == {
            "message": "deployment chat runs on engine llamacpp, which does not serve /v1/embeddings; "
            "it serves /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses",
            "type": "invalid_request_error",
            "param": None,
            "code": "unsupported_endpoint",
        }
        assert [path for path, _ in gw.engine.seen] == ["/v1/responses"]


# --- keys where Anthropic's clients send them; /health ------------------------------------


@pytest.mark.anyio
async def test_x_api_key_is_a_key_as_anthropics_clients_send_it() -> None:
    async with gateway() as gw, httpx.AsyncClient(timeout=10) as raw:
        body = {"model": "chat", "max_tokens": 8, "messages": CHAT}
        for headers in ({"x-api-key": SECRET}, {"authorization": f"Bearer {SECRET}"}):
            r = await raw.post(f"{gw.url}/v1/messages", json=body, headers=headers)
            assert r.status_code == 200, (headers, r.text)
        for headers, what in (({}, "missing"), ({"x-api-key": "sk-wrong"}, "unknown")):
            r = await raw.post(f"{gw.url}/v1/messages", json=body, headers=headers)
            assert r.status_code == 401
            assert r.json()["error"] == {
                "message": f"{what} API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`) "
                "with a key that `llmgw ctl keys create` made (or one of the gateway's api_keys_file)",
                "type": "authentication_error",
                "param": None,
                "code": "invalid_api_key",
            }
        async with anthropic.AsyncAnthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0) as claude:
            with pytest.raises(anthropic.AuthenticationError):
                await claude.messages.create(model="chat", max_tokens=8, messages=CHAT)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_health_is_answered_as_healthz() -> None:
    """guidellm, and other clients, ask `GET /health` before they start: it was 404."""
    async with gateway() as gw, httpx.AsyncClient(timeout=10) as raw:
        for path in ("/health", "/healthz"):
            r = await raw.get(f"{gw.url}{path}")
            assert (r.status_code, r.json()) == (200, {"status": "ok"}), path
            r = await raw.get(f"{gw.url}{path}", headers={"x-api-key": SECRET})
            assert r.json() == {"status": "ok", "deployments": ["chat"]}, path
        gw.proxy.loaded = anyio.Event()
        r = await raw.get(f"{gw.url}/health")
        assert r.status_code == 503
        assert r.json()["status"] == "loading"


def test_fuzz_keyring_takes_any_headers() -> None:
    keyring = Keyring(required=True, file=file_keys(frozenset({SECRET})))

    @given(st.text(max_size=200), st.text(max_size=200))
    @settings(max_examples=300, deadline=None)
    def check(authorization: str, api_key: str) -> None:
        found = keyring.identify(authorization, api_key=api_key)
        assert isinstance(found, Refused) or found.name.startswith("file-")

    check()
    assert not isinstance(keyring.identify("", api_key=f" {SECRET} "), Refused)
    assert not isinstance(keyring.identify(f"Bearer {SECRET}", api_key="sk-other"), Refused)
    assert isinstance(keyring.identify(f"Basic {SECRET}"), Refused)


# --- a client gone before its stream began -------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_gone_before_its_answer_began_releases_the_replica(stream: bool) -> None:
    """The replica's head came, and the server, its client gone, failed the answer's first send
    (an ASGI 2.4 server raises OSError there): the relay was never asked for a chunk, so its
    end never ran, and the replica stayed counted busy for good (`table.outstanding`), every
    later choice skewed by it. Now it is released, streamed (SSE) or passed on in pieces."""
    async with gateway() as gw:
        gw.engine.go.set()
        body = json.dumps({"model": "chat", "messages": CHAT, "stream": stream}).encode()
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "root_path": "",
            "headers": [
                (b"authorization", b"Bearer " + SECRET.encode()),
                (b"content-type", b"application/json"),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            raise OSError("the client closed the connection")

        if not stream:
            gw.engine.chunked = True
        # An answer not streamed is read whole before it goes (so that one broken off can be
        # asked of another replica: docs/gateway.md, "Continuation"), then sent as one
        # response, whose failed send is the server's OSError as it raised it.
        with pytest.raises(ClientDisconnect if stream else OSError):
            await gw.proxy.app(scope, receive, send)
        assert [m["type"] for m in sent] == ["http.response.start"]
        assert gw.table.outstanding == {}
        outstanding = gw.proxy.metrics.registry.get_sample_value(
            "llmgw_gateway_outstanding_requests", {"deployment": "chat"}
        )
        assert outstanding == 0
