"""The APIs clients call through the gateway, and what a client sees when a replica fails
mid-request: the official `openai` and `anthropic` clients against sim engine replicas."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import anyio
import anyio.abc
import httpx
import openai
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import Deployment
from llmgw_gateway.config import RoutingConfig
from tests.cluster_support import cluster, sim_catalog
from tests.gateway_support import proxy_over
from tests.test_gateway import metric, ready, running_gateway
from tests.test_gateway_upstream import answer, read_request, server
from tests.test_sim_engine import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

CHAT = [{"role": "user", "content": "hello"}]


@contextlib.contextmanager
def sim_engines(*argsets: list[str]) -> Iterator[list[str]]:
    """Sim engine processes, one per argument list; yields their base URLs."""
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    try:
        for args in argsets:
            port = free_port()
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "llmgw_core.sim", "--port", str(port), "--model", "tiny", *args],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            _wait_healthy(url, proc)
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """Until the sim engine at `url` answers its /health: on a loaded machine its start takes
    seconds, and a request sent before then is refused at connect."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the sim engine for {url} exited with {proc.returncode} before it answered")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sim engine at {url} did not answer /health within {timeout_s:g} s")
        time.sleep(0.05)


async def test_models_embeddings_messages_and_responses_through_placement(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Placement names each replica's engine: the gateway sends a sim replica what the sim
    engine serves, and answers what it does not with a 400 naming it."""
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement(
            "p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1, "aliases": ["gpt-4o"]}]
        )
        c.start_node("n1", gpus=1)
        async with contextlib.AsyncExitStack() as stack, running_gateway(c) as (url, _):
            record = await ready(bus, "chat.r0")
            assert record.engine == "sim"
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            await stack.enter_async_context(client)

            # One model, by name or alias.
            model = await client.models.retrieve("chat")
            assert (model.id, model.object, model.owned_by) == ("chat", "model", "llmgw")
            assert (await client.models.retrieve("gpt-4o")).id == "chat"
            with pytest.raises(openai.NotFoundError) as missing:
                await client.models.retrieve("nope")
            assert missing.value.body == {
                "message": "model 'nope' is not served here; known models: chat (aliases: gpt-4o)",
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }

            # Embeddings, routed by `model` as completions are (the client asks for base64).
            emb = await client.embeddings.create(model="gpt-4o", input=["a", "b"])
            assert [len(d.embedding) for d in emb.data] == [16, 16]
            assert emb.data[0].embedding != emb.data[1].embedding
            again = await client.embeddings.create(model="chat", input="a", encoding_format="float")
            assert again.data[0].embedding == pytest.approx(emb.data[0].embedding)

            # Anthropic's Messages API, with the official client.
            claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
            await stack.enter_async_context(claude)
            message = await claude.messages.create(
                model="chat",
                max_tokens=4,
                messages=[{"role": "user", "content": "hello"}],
            )
            assert message.type == "message"
            assert message.content[0].type == "text"
            assert len(message.content[0].text.split()) == 4

            # The Responses API: the sim engine does not serve it.
            with pytest.raises(openai.BadRequestError) as unserved:
                await client.responses.create(model="chat", input="hello")
            assert unserved.value.body == {
                "message": "deployment chat runs on engine sim, which does not serve /v1/responses; "
                "it serves /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/messages",
                "type": "invalid_request_error",
                "param": None,
                "code": "unsupported_endpoint",
            }


async def test_every_error_is_openais_error_object_and_answers_carry_one_date() -> None:
    with sim_engines([]) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            r = await raw.get(f"{gw.url}/v1/nothing-here")
            assert r.status_code == 404
            assert r.json() == {
                "error": {
                    "message": "unknown path '/v1/nothing-here': the gateway serves /v1/models, "
                    "/v1/models/{model}, /v1/chat/completions, /v1/completions, /v1/embeddings, "
                    "/v1/responses, /v1/messages",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "unknown_path",
                }
            }
            r = await raw.get(f"{gw.url}/v1/chat/completions")
            assert r.status_code == 405
            assert r.headers["allow"] == "POST"
            assert r.json()["error"] == {
                "message": "method GET is not allowed on '/v1/chat/completions': use POST",
                "type": "invalid_request_error",
                "param": None,
                "code": "method_not_allowed",
            }
            # A proxied answer, streamed or not: one Date, the gateway's.
            for stream in (False, True):
                body = {"model": "chat", "messages": CHAT, "max_tokens": 2, "stream": stream}
                r = await raw.post(f"{gw.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert len(r.headers.get_list("date")) == 1, r.headers


async def test_a_replica_that_dies_before_answering_costs_a_retry_on_another() -> None:
    """r0 exits on reading the request, before any byte of answer: the client gets r1's answer."""
    with sim_engines(["--die-after-chunks", "0"], []) as urls:
        async with (
            proxy_over(urls) as gw,
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            done = await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
            assert done.choices[0].message.content is not None
            assert len(done.choices[0].message.content.split()) == 3
            async with httpx.AsyncClient(timeout=10) as raw:
                scrape = (await raw.get(f"{gw.url}/metrics")).text
                served = metric((await raw.get(f"{urls[1]}/metrics")).text, "llmgw_sim_requests_total")
            # r0 asked once more on a connection of its own (refused, or reset by a process on
            # its way out), then r1.
            reset = metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="reset"}', 0)
            connect = metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="connect"}', 0)
            assert reset >= 1
            assert reset + connect == 2
            assert served == 1


@contextlib.asynccontextmanager
async def closing_after_one_answer() -> AsyncIterator[str]:
    """A replica on loopback that answers the first request of each connection (keep-alive) and
    closes the connection, answering nothing, when a second request comes on it: llama-server's
    close after a streamed answer, met by a request sent on the connection at that instant.
    Yields its URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answered = 0
        while True:
            head = await read_request(reader)
            if answered:
                return
            body = b'{"object":"list","data":[{"id":"chat","object":"model"}]}'
            if head.startswith(b"POST"):
                body = json.dumps(
                    {
                        "id": "c",
                        "object": "chat.completion",
                        "model": "chat",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "hi"},
                                "finish_reason": "stop",
                            }
                        ],
                    }
                ).encode()
            writer.write(answer(body))
            await writer.drain()
            answered += 1

    async with server(serve) as (url, _):
        yield url


async def test_a_replica_that_closed_a_pooled_connection_is_asked_again_on_a_new_one() -> None:
    """Its only replica closed the kept-alive connection the request was sent on: with no other
    replica to try, the request is still answered, by that replica, on a connection of its own."""
    async with closing_after_one_answer() as url, proxy_over([url]) as gw:
        async with httpx.AsyncClient(timeout=10) as raw:
            body = {"model": "chat", "messages": CHAT, "max_tokens": 2}
            for _ in range(3):
                r = await raw.post(f"{gw.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "hi"
            scrape = (await raw.get(f"{gw.url}/metrics")).text
        # The first on a new connection; the second and third each on the connection the one
        # before was answered on (closed unanswered), then again on a new one.
        assert metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="reset"}') == 2
        assert 'reason="connect"' not in scrape


async def test_a_stream_broken_off_ends_with_an_error_event_and_done_never_retried() -> None:
    """r0 exits after 3 chunks, and continuing answers is off (`routing: continuations: 0`;
    tests/test_gateway_continuation.py has it on): the client gets those 3, an error event and
    [DONE]; r1 never sees the request."""
    with sim_engines(["--die-after-chunks", "3"], []) as urls:
        async with (
            proxy_over(urls, routing=RoutingConfig(continuations=0)) as gw,
            httpx.AsyncClient(timeout=30) as raw,
        ):
            body = {"model": "chat", "messages": CHAT, "max_tokens": 20, "stream": True}
            async with raw.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                sse = b"".join([chunk async for chunk in r.aiter_raw()])
            events = sse.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""], sse
            data = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
            assert [d["choices"][0]["delta"]["content"] != "" for d in data[:3]] == [True] * 3
            assert len(data) == 4, data
            error = data[3]["error"]
            assert error["type"] == "upstream_error"
            assert error["code"] == "replica_failed"
            assert error["message"].startswith(
                f"replica r0 at {urls[0]} of deployment chat broke off its answer: "
            ), error
            assert error["message"].endswith("the answer is incomplete and was not retried")

            # The official client raises on the error event instead of ending as if complete.
            gw.table.set_replica("chat.r0", None)
            async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client:
                whole = await client.chat.completions.create(
                    model="chat",
                    messages=CHAT,  # type: ignore[arg-type]
                    max_tokens=5,
                    stream=True,
                )
                assert len([c async for c in whole if c.choices and c.choices[0].delta.content]) == 5
            served = metric((await raw.get(f"{urls[1]}/metrics")).text, "llmgw_sim_requests_total")
            assert served == 1  # only the second request: the broken one was not retried
            scrape = (await raw.get(f"{gw.url}/metrics")).text
            assert (
                metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="upstream_stream"}') == 1
            )


async def test_the_openai_client_raises_on_a_stream_broken_off() -> None:
    with sim_engines(["--die-after-chunks", "2"]) as urls:
        async with (
            proxy_over(urls) as gw,
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            stream = await client.chat.completions.create(
                model="chat",
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=20,
                stream=True,
            )
            got: list[str] = []

            async def read_all() -> None:
                async for chunk in stream:
                    got.append(chunk.choices[0].delta.content or "")

            with pytest.raises(openai.APIError) as broken:
                await read_all()
            assert len(got) == 2
            assert "broke off its answer" in broken.value.message


async def test_a_deployment_with_no_replica_placed_names_the_command_that_says_why() -> None:
    async with proxy_over([]) as gw, httpx.AsyncClient(timeout=30) as raw:
        gw.table.set_deployment("big", Deployment(name="big", profile="huge", replicas=2))
        gw.proxy.holds.timeout_s = 0.2
        r = await raw.post(f"{gw.url}/v1/embeddings", json={"model": "big", "input": "hi"})
        assert r.status_code == 503
        error = r.json()["error"]
        held = re.search(r"; the request was held (0\.\d)s ", error["message"])
        assert held, error
        assert error == {
            "message": "deployment big has 0 ready replicas: none placed yet "
            "(`llmgw ctl explain big` shows placement's reason); the request was held "
            f"{held.group(1)}s (the gateway's hold_timeout_s: 0.2s) and no replica became ready",
            "type": "service_unavailable",
            "param": None,
            "code": "no_ready_replica",
        }


@contextlib.asynccontextmanager
async def breaking_engine(
    events: list[bytes], tail: bytes, content_type: bytes = b"text/event-stream"
) -> AsyncIterator[str]:
    """An HTTP server that answers any POST with a chunked body (an event stream by default):
    each of `events` in a chunk of its own, then `tail` (a partial event) and the connection
    closed mid-body."""

    async def answer(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            head = b""
            while b"\r\n\r\n" not in head:
                head += await stream.receive()
            headers, _, body = head.partition(b"\r\n\r\n")
            if headers.startswith(b"GET"):
                await stream.send(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                return
            length = int(re.search(rb"content-length: *(\d+)", headers, re.IGNORECASE)[1])  # type: ignore[index]
            while len(body) < length:
                body += await stream.receive()
            await stream.send(
                b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n" % content_type
            )
            for part in [*events, tail]:
                await stream.send(b"%x\r\n%s\r\n" % (len(part), part))
                await anyio.sleep(0.05)  # each in a packet of its own

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, answer)
        yield f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}"
        tg.cancel_scope.cancel()


async def test_an_event_cut_in_half_is_dropped_and_the_stream_still_ends_well_formed() -> None:
    first = b'data: {"id": "1", "object": "chat.completion.chunk", "created": 0, "model": "tiny", '
    first += b'"choices": [{"index": 0, "delta": {"content": "hel"}, "finish_reason": null}]}\n\n'
    async with (
        breaking_engine([first], b'data: {"id": "1", "obj') as engine,
        proxy_over([engine], engine="vllm") as gw,
    ):
        async with httpx.AsyncClient(timeout=30) as raw:
            body = {"model": "chat", "messages": CHAT, "stream": True}
            async with raw.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
                sse = b"".join([chunk async for chunk in r.aiter_raw()])
        events = sse.split(b"\n\n")
        assert events[0] + b"\n\n" == first
        assert json.loads(events[1].removeprefix(b"data: "))["error"]["code"] == "replica_failed"
        assert events[2:] == [b"data: [DONE]", b""]


async def test_an_anthropic_stream_broken_off_ends_with_its_error_event() -> None:
    start = {
        "type": "message_start",
        "message": {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "tiny",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 0},
        },
    }
    started = b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n"
    async with (
        breaking_engine([started], b"event: content_block_start\nda") as engine,
        proxy_over([engine], engine="vllm") as gw,
        anthropic.AsyncAnthropic(base_url=gw.url, api_key="unused", max_retries=0) as claude,
    ):
        stream = await claude.messages.create(
            model="chat", max_tokens=8, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        seen: list[str] = []

        async def read_all() -> None:
            async for event in stream:
                seen.append(event.type)

        with pytest.raises(anthropic.APIError) as broken:
            await read_all()
        assert seen == ["message_start"]
        assert "broke off its answer" in broken.value.message


async def test_an_answer_not_streamed_broken_off_is_seen_incomplete_by_the_client() -> None:
    """With continuing answers off (`routing: continuations: 0`; else it is read whole first and
    asked of another replica: tests/test_gateway_continuation.py)."""
    first, tail = b'{"id": "1", "object": "chat.completion", ', b'"choices": ['
    async with (
        breaking_engine([first], tail, b"application/json") as engine,
        proxy_over([engine], engine="vllm", routing=RoutingConfig(continuations=0)) as gw,
        httpx.AsyncClient(timeout=30) as raw,
    ):
        body = {"model": "chat", "messages": CHAT}
        with pytest.raises(httpx.RemoteProtocolError):
            await raw.post(f"{gw.url}/v1/chat/completions", json=body)
