"""The gateway against hostile clients, over real sockets on loopback: clients that trickle
their headers or body, floods of idle connections under a low open-file limit, JSON nested
100,000 deep, 100 KB model names, and probes without a key where keys are required."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.errors import ConfigError
from llmgw_core.events import Deployment
from llmgw_gateway import Gateway
from llmgw_gateway.connections import CorkedTransport, connection_limit
from llmgw_gateway.limits import json_nests_deeper, shown
from tests.cluster_support import Cluster, cluster
from tests.gateway_support import gateway_process
from tests.test_gateway import metric, running_gateway
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n"
CLOSED = (anyio.EndOfStream, anyio.BrokenResourceError)


@contextlib.asynccontextmanager
async def loaded_gateway(c: Cluster, **http: object) -> AsyncIterator[tuple[str, Gateway]]:
    """`running_gateway`, once it has read the buckets (until then `/healthz` says loading)."""
    async with running_gateway(c, **http) as (url, gateway):
        with anyio.fail_after(30):
            await gateway.proxy.loaded.wait()
        yield url, gateway


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def until_closed(stream: anyio.abc.SocketStream) -> bytes:
    """Everything the gateway sends on `stream` until it closes the connection."""
    got = b""
    while True:
        try:
            got += await stream.receive()
        except CLOSED:
            return got


@dataclass
class Trickle:
    """A client that sends `first`, then `more(i)` every `every` seconds until the gateway
    closes the connection: how long that took, and how much it had sent by then."""

    first: bytes
    more: Callable[[int], bytes]
    every: float
    after: bytes = b""  # a whole request sent (and its answer read) before `first`
    sent: int = 0
    closed_after_s: float = 0.0
    got: bytes = b""  # what the gateway sent before it closed

    async def run(self, port: int) -> None:
        stream = await anyio.connect_tcp("127.0.0.1", port)
        async with stream, anyio.create_task_group() as tg:
            if self.after:
                await stream.send(self.after)
                answer = b""
                while not answer.endswith(b"}"):
                    answer += await stream.receive()
                assert answer.startswith(b"HTTP/1.1 200 "), answer
            started = time.monotonic()
            await stream.send(self.first)
            tg.start_soon(self._send_more, stream)
            self.got = await until_closed(stream)
            self.closed_after_s = time.monotonic() - started
            tg.cancel_scope.cancel()

    async def _send_more(self, stream: anyio.abc.SocketStream) -> None:
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            while True:
                # The client's own pace: what is being tested, not a wait for something.
                await anyio.sleep(self.every)
                await stream.send(self.more(self.sent))
                self.sent += 1


def header_line(i: int) -> bytes:
    return b"X-Trickle-%d: 1\r\n" % i


async def test_clients_that_trickle_headers_or_a_body_are_closed_at_their_deadline(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    header_s, body_s = 2.0, 3.0
    with cluster(tmp_path, nats_url, prefix) as c:
        async with loaded_gateway(c, header_timeout_s=header_s, body_timeout_s=body_s) as (url, _):
            port = port_of(url)
            # A header every 0.5 s: each byte would have restarted uvicorn's keep-alive timer.
            start = b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n"
            headers = [Trickle(start, header_line, 0.5) for _ in range(20)]
            silent = Trickle(b"", lambda i: b"", 3600)
            kept_alive = Trickle(b"GET /healthz HTTP/1.1\r\n", header_line, 0.5, after=HEALTHZ)
            body = Trickle(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n"
                b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
                lambda i: b" ",
                0.5,
            )
            # Answered before its body is in (`/healthz` reads none), which goes on trickling.
            answered = Trickle(
                b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nContent-Length: 1000\r\n\r\n", lambda i: b" ", 0.5
            )
            # Its body's last byte after the answer, then nothing: uvicorn has no timer left.
            finished = Trickle(
                b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nContent-Length: 2\r\n\r\nx",
                lambda i: b"y" if i == 0 else b"",
                0.5,
            )
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg, httpx.AsyncClient(timeout=10) as client:
                    for t in [*headers, silent, kept_alive, body, answered, finished]:
                        tg.start_soon(t.run, port)
                    # Meanwhile a client that sends its request at once is answered.
                    r = await client.get(f"{url}/healthz")
                    assert r.status_code == 200, r.text
            async with httpx.AsyncClient(timeout=10) as client:
                scrape = (await client.get(f"{url}/metrics")).text
    for t in [*headers, silent, kept_alive]:
        assert header_s - 0.1 <= t.closed_after_s < header_s + 10, t
    assert all(t.sent >= 2 for t in headers), [t.sent for t in headers]
    # The body is due body_timeout_s after the headers, which came at once.
    assert body_s - 0.1 <= body.closed_after_s < body_s + 10, body
    assert body.sent >= 3, body
    assert body_s - 0.1 <= answered.closed_after_s < body_s + 10, answered
    assert answered.got.startswith(b"HTTP/1.1 200 "), answered
    assert finished.got.startswith(b"HTTP/1.1 200 "), finished
    assert [t.got for t in [*headers, silent, kept_alive, body]] == [b""] * 23
    # Due header_timeout_s after the body ended (0.5 s in), as the next request's headers.
    assert header_s + 0.4 <= finished.closed_after_s < header_s + 10, finished
    closed = 'llmgw_gateway_connections_closed_total{reason="%s"}'
    assert metric(scrape, closed % "header_timeout") == 23
    assert metric(scrape, closed % "body_timeout") == 2
    # The completion whose body never came ended quietly: no traceback from the ASGI app.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_at_the_connection_limit_the_longest_waiting_connection_makes_room(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        async with (
            loaded_gateway(c, max_connections=4) as (url, gateway),
            httpx.AsyncClient(timeout=10, headers={"Connection": "close"}) as client,
        ):
            port = port_of(url)
            held = gateway.connections
            with anyio.fail_after(60):
                idle = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(4)]
                await eventually(lambda: held.held == 4, timeout=10)
                # A fifth connection: the one that has waited longest is closed to make room.
                r = await client.get(f"{url}/healthz")
                assert r.status_code == 200, r.text
                assert await until_closed(idle[0]) == b""
                for s in idle:
                    await s.aclose()
                await eventually(lambda: held.held == 0, timeout=10)

                # Four requests in progress (their bodies not yet in): nothing to make room with.
                start = (
                    b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 15\r\n\r\n"
                )
                busy = [await anyio.connect_tcp("127.0.0.1", port) for _ in range(4)]
                for s in busy:
                    await s.send(start)
                await eventually(lambda: (held.held, held.waiting) == (4, 0), timeout=10)
                refused = await anyio.connect_tcp("127.0.0.1", port)
                async with refused:
                    answer = await until_closed(refused)
                head, _, payload = answer.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
                assert json.loads(payload)["error"] == {
                    "message": "the gateway holds its limit of 4 client connections (http: max_connections), "
                    "each with a request in progress; retry shortly",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "too_many_connections",
                }
                # One request finishes: its connection waits for the next, and makes room.
                await busy[0].send(b'{"model": "no"}')
                assert (await busy[0].receive()).startswith(b"HTTP/1.1 404 ")
                r = await client.get(f"{url}/metrics")
                assert r.status_code == 200
                for s in busy:
                    await s.aclose()
    closed = 'llmgw_gateway_connections_closed_total{reason="%s"}'
    assert metric(r.text, closed % "evicted") == 2
    assert metric(r.text, closed % "refused") == 1
    assert metric(r.text, "llmgw_gateway_connection_limit") == 4


@contextlib.contextmanager
def open_files_at_least(n: int) -> Iterator[None]:
    """This process's own open-file limit raised to `n` for the flood it opens (skip if it cannot)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < n:
        if hard != resource.RLIM_INFINITY and hard < n:
            pytest.skip(f"this test opens {n} sockets; the open-file hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.timeout(300)
async def test_under_ulimit_1024_a_flood_of_idle_connections_leaves_room_for_a_request(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: with 1,100 connections held, accept failed with `Too many open files` and
    normal requests timed out."""
    flood = 1100
    # (1024 - reserved_fds 256) / 2: half the descriptors for clients, half for their replicas.
    limit = 384
    # Headers due only after a minute: it is the limit that makes room here.
    http = {"require_api_key": False, "header_timeout_s": 60.0}
    with (
        cluster(tmp_path, nats_url, prefix) as c,
        open_files_at_least(flood + 256),
        gateway_process(c, tmp_path, open_files=1024, http=http) as gateway,
    ):
        proc, log = gateway.proc, gateway.log
        socks: list[socket.socket] = []
        try:
            url = await gateway.endpoint(timeout=30)
            async with httpx.AsyncClient(timeout=30, headers={"Connection": "close"}) as client:

                async def loaded() -> bool:
                    return (await client.get(f"{url}/healthz")).status_code == 200

                await eventually(loaded, timeout=30, interval=0.2)

                def connect_all() -> None:
                    for _ in range(flood):
                        sock = socket.create_connection(("127.0.0.1", port_of(url)), timeout=30)
                        sock.setblocking(False)
                        socks.append(sock)

                with anyio.fail_after(120):
                    await anyio.to_thread.run_sync(connect_all)
                    # Every connection beyond the limit closed one that had waited longer.
                    await eventually(
                        lambda: sum(map(closed_by_peer, socks)) >= flood - limit, timeout=30, interval=0.2
                    )
                    descriptors = len(os.listdir(f"/proc/{proc.pid}/fd"))
                    assert descriptors < 1024 - 128, descriptors
                    started = time.monotonic()
                    r = await client.get(f"{url}/v1/models")
                    assert r.status_code == 200, r.text
                    assert r.json() == {"object": "list", "data": []}
                    assert time.monotonic() - started < 10
                    scrape = (await client.get(f"{url}/metrics")).text
            assert metric(scrape, "llmgw_gateway_connection_limit") == limit
            evicted = metric(scrape, 'llmgw_gateway_connections_closed_total{reason="evicted"}')
            assert evicted >= flood - limit + 1, scrape
            assert metric(scrape, 'llmgw_gateway_connections_closed_total{reason="refused"}') == 0
            assert proc.poll() is None
        finally:
            for s in socks:
                s.close()
        text = log.read_text()
        assert "Too many open files" not in text, text
        assert "out of system resource" not in text, text
        assert f"holding up to {limit} client connections (open-file limit 1024" in text, text


async def test_a_connection_limit_the_open_file_limit_cannot_hold_is_refused_at_start(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    http = {"require_api_key": False, "max_connections": 1000}
    with (
        cluster(tmp_path, nats_url, prefix) as c,
        gateway_process(c, tmp_path, open_files=1024, http=http) as gateway,
    ):
        assert await anyio.to_thread.run_sync(lambda: gateway.proc.wait(timeout=60)) == 2
    assert (
        (tmp_path / "gateway.log")
        .read_text()
        .endswith(
            "llmgw-gateway: http: max_connections 1000 needs 2256 open files (one per client connection, "
            "one per replica connection its request holds, and http: reserved_fds 256) but the open-file "
            "limit (ulimit -n) is 1024; raise that limit, or set max_connections to 384 or less "
            "(0 takes what it allows)\n"
        )
    )


def test_the_connection_limit_from_the_open_file_limit() -> None:
    assert connection_limit(0, 256, 1024) == 384
    assert connection_limit(100, 256, 1024) == 100
    assert connection_limit(0, 256, 1 << 20) == 524160
    with pytest.raises(ConfigError) as err:
        connection_limit(0, 256, 256)
    assert str(err.value) == (
        "the open-file limit (ulimit -n) is 256, which leaves no room for client connections after "
        "http: reserved_fds 256; raise it (ulimit -n, LimitNOFILE= in a systemd unit, --ulimit nofile= "
        "for docker)"
    )


async def test_json_nested_100000_deep_is_a_400_naming_the_limit(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    too_deep = {
        "message": "the body's JSON nests arrays and objects more than 128 deep "
        "(the gateway's max_json_depth)",
        "type": "invalid_request_error",
        "param": None,
        "code": "json_too_deep",
    }
    with cluster(tmp_path, nats_url, prefix) as c:
        async with loaded_gateway(c) as (url, _), httpx.AsyncClient(timeout=30) as client:
            chat = f"{url}/v1/chat/completions"
            for body in (
                b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                b"[" * 100_000,
                b'{"a": ' * 129 + b"1" + b"}" * 129,
            ):
                r = await client.post(chat, content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, r.text
                assert r.json() == {"error": too_deep}
            # 128 deep is allowed, and brackets inside strings nest nothing.
            inner: object = 1
            for _ in range(127):
                inner = [inner]
            nested = {"model": "nope", "x": "[[[[" * 1000, "deep": inner}
            r = await client.post(chat, json=nested)
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
    assert "RecursionError" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_100_kb_model_name_is_not_echoed_back(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    model = "m" * 100_000
    with cluster(tmp_path, nats_url, prefix) as c:
        async with loaded_gateway(c) as (url, _), httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi"})
    assert r.status_code == 404
    assert len(r.content) < 500
    assert r.json()["error"]["message"] == (
        f"model {'m' * 64!r}… (100000 characters) is not served here; "
        "known models: none (no deployment exists yet)"
    )


async def test_with_keys_required_metrics_need_one_and_healthz_names_nothing_without(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("secret-1\n")
    key = {"Authorization": "Bearer secret-1"}
    await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
    with cluster(tmp_path, nats_url, prefix) as c:
        async with (
            loaded_gateway(c, require_api_key=True, api_keys_file=str(keys)) as (url, _),
            httpx.AsyncClient(timeout=10) as client,
        ):

            async def named() -> bool:
                r = await client.get(f"{url}/healthz", headers=key)
                assert r.json() == {"status": "ok", "deployments": ["chat"]}
                return True

            await eventually(named, timeout=20)
            # A load balancer's probe, without a key (or with a wrong one): alive, nothing more.
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await client.get(f"{url}/healthz", headers=headers)
                assert (r.status_code, r.json()) == (200, {"status": "ok"})
                r = await client.get(f"{url}/metrics", headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert "chat" not in r.text
            r = await client.get(f"{url}/metrics", headers=key)
            assert r.status_code == 200
            unauthorized = 'llmgw_gateway_errors_total{deployment="(unknown)",reason="unauthorized"}'
            assert metric(r.text, unauthorized) == 2


def test_json_depth_is_counted_outside_strings() -> None:
    assert not json_nests_deeper(b'{"a": [1, {"b": "]]]]"}]}', 3)
    assert json_nests_deeper(b'{"a": [1, {"b": [2]}]}', 3)
    assert not json_nests_deeper(b'{"a": "\\"[[[[[[", "b": [[]]}', 3)
    assert json_nests_deeper(b"[" * 5, 4)
    assert not json_nests_deeper(b"[]" * 1000, 1)


def test_long_strings_are_shown_cut_short() -> None:
    assert shown("chat") == "'chat'"
    assert shown("x" * 64) == repr("x" * 64)
    assert shown("x" * 65) == f"{'x' * 64!r}… (65 characters)"


class _Recording:
    """A transport that records what is written to it (the seam `CorkedTransport` wraps)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.state = "open"

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.state != "open"

    def close(self) -> None:
        self.state = "closed"

    def abort(self) -> None:
        self.state = "aborted"

    def get_extra_info(self, name: str, default: object = None) -> object:
        return {"peername": ("127.0.0.1", 1)}.get(name, default)


async def test_a_connections_writes_in_one_pass_of_the_loop_go_out_as_one_system_call() -> None:
    loop = asyncio.get_running_loop()
    raw = _Recording()
    corked = CorkedTransport(raw, loop)  # type: ignore[arg-type]
    # uvicorn's three writes of an answer not streamed: headers, the body, the chunked end.
    corked.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
    corked.write(b"5\r\nhello\r\n")
    corked.write(b"")
    corked.write(b"0\r\n\r\n")
    assert raw.writes == []
    # Other attributes are the transport's own.
    assert corked.get_extra_info("peername") == ("127.0.0.1", 1)
    await asyncio.sleep(0)  # one pass of the event loop: what was written goes out, as one
    assert raw.writes == [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"]
    # The next pass's writes are sent in the next pass, never held for more.
    corked.write(b"data: 1\n\n")
    await asyncio.sleep(0)
    assert raw.writes[1:] == [b"data: 1\n\n"]
    # A close sends what is held first; nothing is written to a closed connection.
    corked.write(b"last")
    corked.close()
    assert (raw.writes[2:], raw.state) == ([b"last"], "closed")
    corked.write(b"after the close")
    await asyncio.sleep(0)
    assert raw.writes[3:] == []
    # An abort drops what is held (a client that does not read holds nothing open).
    aborted = _Recording()
    corked = CorkedTransport(aborted, loop)  # type: ignore[arg-type]
    corked.write(b"unsent")
    corked.abort()
    await asyncio.sleep(0)
    assert (aborted.writes, aborted.state) == ([], "aborted")
