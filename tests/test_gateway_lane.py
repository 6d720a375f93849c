"""The gateway's express lane (`GuardedProtocol` and `Proxy.express`): a routed POST whose
body is in and whose replica's answer gives its length is answered from the protocol's
callbacks, without the ASGI app; every other case is the ASGI path's, handed over before any
byte of answer went out. Against a replica on loopback scripted per request (its prompt says how it
answers), and clients on raw sockets where httpx would hide what is checked."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from opentelemetry.trace import Tracer
from starlette.types import Receive, Scope, Send

from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import ANONYMOUS
from llmgw_gateway import Proxy, Table
from llmgw_gateway.proxy import ROUTED
from llmgw_gateway.upstream import Upstream
from tests.gateway_support import serve_proxy
from tests.test_gateway import metric
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@dataclass
class Replica:
    """An engine on loopback: `/v1/models` names `tiny`; a completion answers by its prompt
    (`close-first`: the connection closed unanswered the first time; `slow-body`: half the
    body, then the rest 0.3 s later; `chunked`: the same without a length, in chunks; `stall`:
    half the body, then nothing; `events`: server-sent events; `late`: after 0.5 s; any other:
    the prompt back, whole at once)."""

    url: str = ""
    # Each completion request's headers (names in lower case) and body, in order, and the
    # connections they came on (numbered from 1; `/v1/models` is asked on one of its own).
    requests: list[tuple[dict[str, str], dict[str, Any]]] = field(default_factory=list)
    on: list[int] = field(default_factory=list)
    connections: int = 0
    closed_once: set[str] = field(default_factory=set)

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if path == "/v1/models":
                    writer.write(_answer(b'{"object": "list", "data": [{"id": "tiny"}]}'))
                    continue
                payload = json.loads(body)
                self.requests.append((headers, payload))
                self.on.append(number)
                prompt = payload.get("prompt", "")
                if prompt == "close-first" and prompt not in self.closed_once:
                    self.closed_once.add(prompt)
                    return
                text = json.dumps({"model": "tiny", "choices": [{"text": prompt}], "usage": USAGE}).encode()
                if prompt == "slow-body":
                    whole = _answer(text)
                    writer.write(whole[: len(whole) - len(text) // 2])
                    await writer.drain()
                    await asyncio.sleep(0.3)
                    writer.write(whole[len(whole) - len(text) // 2 :])
                elif prompt == "chunked":
                    writer.write(_answer(b"", chunked=True) + b"%x\r\n%s\r\n" % (10, text[:10]))
                    await writer.drain()
                    await asyncio.sleep(0.3)
                    writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(text) - 10, text[10:]))
                elif prompt == "stall":
                    whole = _answer(text)
                    writer.write(whole[: len(whole) - len(text) // 2])
                    await writer.drain()
                    await reader.read()  # until the gateway closes the connection
                    return
                elif prompt == "events":
                    events = b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
                    writer.write(_answer(events, b"text/event-stream"))
                elif prompt == "late":
                    await asyncio.sleep(0.5)
                    writer.write(_answer(text))
                else:
                    writer.write(_answer(text))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def _answer(body: bytes, kind: bytes = b"application/json", chunked: bool = False) -> bytes:
    framing = b"transfer-encoding: chunked" if chunked else b"content-length: %d" % len(body)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\nx-replica: r0\r\ndate: Thu, 01 Jan 1970 00:00:00 GMT\r\n"
        b"connection: keep-alive\r\n%s\r\n\r\n%s" % (kind, framing, body)
    )


@dataclass
class Lane:
    url: str
    proxy: Proxy
    replica: Replica
    # Routed requests the ASGI app saw (the express lane's own never reach it), by path.
    asgi: list[str]
    port: int


@contextlib.asynccontextmanager
async def lane(
    read_timeout_s: float | None = None, replicas: tuple[str, ...] = ("r0",), tracer: Tracer | None = None
) -> AsyncIterator[Lane]:
    """The proxy over `replicas` of `chat` (one engine on loopback behind them all), served as
    `llmgw-gateway` serves it, with the requests that reach its ASGI app counted."""
    replica = Replica()
    listener = await asyncio.start_server(replica.serve, "127.0.0.1", 0)
    replica.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}"
    table = Table()
    for name in replicas:
        record = ReplicaRecord(
            deployment="chat", replica=name, profile="tiny", profile_fp="x", state="ready", url=replica.url
        )
        table.set_replica(f"chat.{name}", record)
    asgi: list[str] = []
    upstream = Upstream(read_timeout_s=read_timeout_s)
    async with (
        listener,
        httpx.AsyncClient() as client,
        Proxy(table, client, upstream=upstream, tracer=tracer) as proxy,
    ):
        proxy.loaded.set()

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] in ROUTED:
                asgi.append(scope["path"])
            await proxy.app(scope, receive, send)

        async with anyio.create_task_group() as tg:
            port = await tg.start(serve_proxy, proxy, app)
            yield Lane(f"http://127.0.0.1:{port}", proxy, replica, asgi, port)
            tg.cancel_scope.cancel()


def post(prompt: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"model": "chat", "prompt": prompt}).encode()
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\n%s"
        b"content-length: %d\r\n\r\n%s" % (extra, len(body), body)
    )


async def read_answer(stream: anyio.abc.ByteStream, buffered: bytearray) -> tuple[bytes, bytes]:
    """One answer's head and body (by Content-Length) from `stream`; what came after it stays in
    `buffered`."""
    while b"\r\n\r\n" not in buffered:
        buffered += await stream.receive()
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length: *(\d+)", head)
    assert length, head
    while len(rest) < int(length.group(1)):
        rest += await stream.receive()
    body, after = rest[: int(length.group(1))], rest[int(length.group(1)) :]
    buffered[:] = after
    return head, body


async def scrape(served: Lane) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(f"{served.url}/metrics")).text


async def usage(served: Lane) -> tuple[float, float]:
    """The requests and prompt tokens counted for deployment `chat` (keys are not required)."""
    text = await scrape(served)
    labels = f'{{deployment="chat",key="{ANONYMOUS}"}}'
    return (
        metric(text, f"llmgw_gateway_key_requests_total{labels}"),
        metric(text, f"llmgw_gateway_prompt_tokens_total{labels}"),
    )


async def test_a_whole_answer_on_the_lane_is_the_one_the_asgi_path_gives() -> None:
    async with lane() as served, httpx.AsyncClient(base_url=served.url) as client:
        chat = {"model": "chat", "prompt": "hello"}
        # The first request to a replica asks its model name and opens a connection to it:
        # the ASGI path's. The next is the lane's.
        first = await client.post("/v1/completions", json=chat)
        assert first.status_code == 200
        assert served.asgi == ["/v1/completions"]
        express = await client.post("/v1/completions", json=chat)
        assert served.asgi == ["/v1/completions"]

        async def chunks() -> AsyncIterator[bytes]:
            yield json.dumps(chat).encode()

        # A body without a length (chunked) is not the lane's.
        asgi = await client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert served.asgi == ["/v1/completions"] * 2

        for r in (express, asgi):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == "hello"
            assert r.headers.get_list("date") != ["Thu, 01 Jan 1970 00:00:00 GMT"]
            assert len(r.headers.get_list("date")) == 1
        same = {k: v for k, v in express.headers.items() if k != "date"}
        assert same == {k: v for k, v in asgi.headers.items() if k != "date"}
        assert same["x-replica"] == "r0"
        assert same["content-length"] == str(len(express.content))
        assert "connection" not in same
        # The replica got the same request both ways, on the one connection.
        _, (lane_headers, lane_body), (asgi_headers, asgi_body) = served.replica.requests
        assert lane_body == asgi_body == {"model": "tiny", "prompt": "hello"}
        assert lane_headers == asgi_headers
        assert len(set(served.replica.on)) == 1
        # Counted once each, their tokens too.
        text = await scrape(served)
        assert metric(text, 'llmgw_gateway_requests_total{deployment="chat"}') == 3
        assert metric(text, 'llmgw_gateway_outstanding_requests{deployment="chat"}') == 0
        assert await usage(served) == (3, 9)


async def test_a_replica_that_closes_the_kept_alive_connection_is_asked_again_on_a_new_one() -> None:
    async with lane() as served, httpx.AsyncClient(base_url=served.url) as client:
        first = await client.post("/v1/completions", json={"model": "chat", "prompt": "hello"})
        assert first.status_code == 200
        assert served.asgi == ["/v1/completions"]
        # Sent by the lane on the kept-alive connection, which the replica closes unanswered:
        # asked again on a new one, from the ASGI path.
        again = await client.post("/v1/completions", json={"model": "chat", "prompt": "close-first"})
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"] == "close-first"
        assert served.asgi == ["/v1/completions"] * 2
        # Sent on the first one, then on another.
        first_on, closed_on, again_on = served.replica.on
        assert first_on == closed_on != again_on
        text = await scrape(served)
        assert metric(text, 'llmgw_gateway_requests_total{deployment="chat"}') == 2
        assert metric(text, 'llmgw_gateway_errors_total{deployment="chat",reason="reset"}') == 1
        assert metric(text, 'llmgw_gateway_outstanding_requests{deployment="chat"}') == 0
        assert served.proxy.table.outstanding == {}


async def test_an_answer_whose_body_comes_after_its_head_is_waited_for_on_the_lane() -> None:
    """As engines served by uvicorn send an answer: its head, then its body in another write.
    With its length given the lane waits for the rest; a replica that stops sending fails it at
    the read timeout, as the ASGI path would: nothing of it was passed on, and with no other
    replica to ask for it again (docs/gateway.md, "Continuation") the client is answered 503,
    never taking it whole."""
    async with lane(read_timeout_s=0.5) as served, httpx.AsyncClient(base_url=served.url) as client:
        warm = await client.post("/v1/completions", json={"model": "chat", "prompt": "hello"})
        assert warm.status_code == 200
        slow = await client.post("/v1/completions", json={"model": "chat", "prompt": "slow-body"})
        assert slow.status_code == 200
        assert slow.json()["choices"][0]["text"] == "slow-body"
        assert (slow.headers["x-replica"], slow.headers["content-length"]) == ("r0", str(len(slow.content)))
        assert served.asgi == ["/v1/completions"]
        stalled = await client.post("/v1/completions", json={"model": "chat", "prompt": "stall"})
        assert stalled.status_code == 503, stalled.text
        assert stalled.json()["error"]["message"] == (
            "deployment chat has 1 ready replica but none accepted the request: "
            f"r0 at {served.replica.url} broke off its answer: no byte from the replica for 0.5s"
        )
        # Handed to the ASGI path once failed, which reads what came and finds it broken off.
        assert served.asgi == ["/v1/completions"] * 2
        text = await scrape(served)
        assert metric(text, 'llmgw_gateway_errors_total{deployment="chat",reason="upstream"}') == 1
        assert served.proxy.table.outstanding == {}
        # The stalled connection was closed, not pooled: the next request opens another.
        after = await client.post("/v1/completions", json={"model": "chat", "prompt": "after"})
        assert after.json()["choices"][0]["text"] == "after"
        first, *same, other = served.replica.on
        assert same == [first, first], served.replica.on
        assert other != first, served.replica.on
        # The three requests answered, and their tokens (the one broken off was answered by the
        # gateway, and charged nothing, as one refused).
        assert await usage(served) == (3, 9)


async def test_an_answer_without_a_length_or_streamed_goes_on_from_the_asgi_path() -> None:
    async with lane() as served, httpx.AsyncClient(base_url=served.url) as client:
        warm = await client.post("/v1/completions", json={"model": "chat", "prompt": "hello"})
        assert warm.status_code == 200
        chunked = await client.post("/v1/completions", json={"model": "chat", "prompt": "chunked"})
        assert chunked.status_code == 200
        assert chunked.json()["choices"][0]["text"] == "chunked"
        assert chunked.headers["x-replica"] == "r0"
        events = await client.post("/v1/completions", json={"model": "chat", "prompt": "events"})
        assert events.status_code == 200
        assert events.headers["content-type"] == "text/event-stream"
        assert events.text == 'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n'
        assert served.asgi == ["/v1/completions"] * 3
        # Each on the replica connection the lane sent it on.
        assert len(set(served.replica.on)) == 1
        # The streamed answer's events carry no usage.
        assert await usage(served) == (3, 6)
        assert served.proxy.table.outstanding == {}


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with lane() as served:
        async with httpx.AsyncClient(base_url=served.url) as client:
            warm = await client.post("/v1/completions", json={"model": "chat", "prompt": "warm"})
            assert warm.status_code == 200
        async with await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            # The first on the lane; the two after it queued by uvicorn until it is answered.
            await stream.send(post("late") + post("second") + post("third"))
            buffered = bytearray()
            texts = []
            for _ in range(3):
                head, body = await read_answer(stream, buffered)
                assert head.startswith(b"HTTP/1.1 200 "), head
                texts.append(json.loads(body)["choices"][0]["text"])
        assert texts == ["late", "second", "third"]
        assert served.asgi == ["/v1/completions"] * 3
        assert served.proxy.table.outstanding == {}


async def test_a_client_gone_while_the_lane_waits_costs_nothing_and_its_tokens_count() -> None:
    async with lane() as served:
        async with await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            await stream.send(post("warm"))
            await read_answer(stream, bytearray())
        sock = socket.create_connection(("127.0.0.1", served.port))
        sock.sendall(post("late"))
        sock.close()
        # The replica's answer came to no one: counted, its replica's count released.

        async def late_counted() -> bool:
            assert await usage(served) == (2, 6)
            assert served.proxy.table.outstanding == {}
            return True

        await eventually(late_counted, timeout=10, interval=0.05)
        assert served.asgi == ["/v1/completions"]
        async with httpx.AsyncClient(base_url=served.url) as client:
            r = await client.post("/v1/completions", json={"model": "chat", "prompt": "after"})
            assert r.status_code == 200
            assert r.json()["choices"][0]["text"] == "after"


async def test_what_the_lane_declines_is_answered_by_the_asgi_path() -> None:
    async with lane() as served, httpx.AsyncClient(base_url=served.url) as client:
        # Not JSON; no model; an unknown model; a streamed request; a request with Expect.
        bad = await client.post("/v1/completions", content=b"{", headers={"content-type": "application/json"})
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_json"
        none = await client.post("/v1/completions", json={"prompt": "x"})
        assert none.json()["error"]["code"] == "missing_model"
        unknown = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert unknown.status_code == 404
        streamed = await client.post(
            "/v1/completions", json={"model": "chat", "prompt": "events", "stream": True}
        )
        assert streamed.status_code == 200
        assert streamed.text.endswith("data: [DONE]\n\n")
        assert served.asgi == ["/v1/completions"] * 4
        # The lane's (the streamed request asked the replica's model name).
        taken = await client.post("/v1/completions", json={"model": "chat", "prompt": "x"})
        assert taken.status_code == 200
        assert served.asgi == ["/v1/completions"] * 4
        async with await anyio.connect_tcp("127.0.0.1", served.port) as stream:
            await stream.send(post("expecting", b"expect: 100-continue\r\n"))
            buffered = bytearray()
            head, body = await read_answer_after_continue(stream, buffered)
            assert head.startswith(b"HTTP/1.1 200 "), head
            assert json.loads(body)["choices"][0]["text"] == "expecting"
        assert served.asgi == ["/v1/completions"] * 5


async def read_answer_after_continue(
    stream: anyio.abc.ByteStream, buffered: bytearray
) -> tuple[bytes, bytes]:
    """The answer after an interim `100 Continue`, if one comes first."""
    while b"\r\n\r\n" not in buffered:
        buffered += await stream.receive()
    if bytes(buffered).startswith(b"HTTP/1.1 100 "):
        del buffered[: bytes(buffered).index(b"\r\n\r\n") + 4]
    return await read_answer(stream, buffered)
