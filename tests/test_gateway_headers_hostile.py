"""Request heads the gateway refuses, over real sockets on loopback: one 1 MiB header, 20,000
headers, a header or a head over its limit, on the express lane and on the ASGI path; heads
held across many connections at once, counted against `http: header_bytes_in_flight`; and a
hypothesis fuzz of the checks (`HeadCount`, and the protocol fed arbitrary header lists)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from uvicorn.config import Config
from uvicorn.server import ServerState

from llmgw_core.bus import Bus
from llmgw_gateway.connections import (
    HEAD_SLACK,
    Connections,
    HeadCount,
    HeaderLimits,
    HeaderTooLarge,
    Lane,
    protocol,
)
from tests.cluster_support import cluster
from tests.test_gateway import metric
from tests.test_gateway_hostile import loaded_gateway, port_of, until_closed
from tests.waiting import eventually

CHAT = b'{"model": "chat", "messages": [{"role": "user", "content": "hello"}]}'


def post(headers: bytes, path: bytes = b"/v1/chat/completions") -> bytes:
    """A POST that the express lane takes (its body's length given, under 64 KiB)."""
    return (
        b"POST %s HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n%s"
        b"Content-Length: %d\r\n\r\n%s" % (path, headers, len(CHAT), CHAT)
    )


def get(headers: bytes, path: bytes = b"/healthz") -> bytes:
    """A GET, which goes to the ASGI app."""
    return b"GET %s HTTP/1.1\r\nHost: gateway\r\n%s\r\n" % (path, headers)


async def exchange(port: int, request: bytes) -> bytes:
    """Send `request` (while reading, as a client that sends a large head does) and return what
    the gateway answered before it closed the connection."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    async with stream, anyio.create_task_group() as tg:

        async def send() -> None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await stream.send(request)

        tg.start_soon(send)
        with anyio.fail_after(20):
            got = await until_closed(stream)
        tg.cancel_scope.cancel()
    return got


def status_and_error(answer: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)["error"] if body.startswith(b"{") else {}


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_huge_header_too_many_headers_or_a_head_over_its_limit_is_a_431_on_both_paths(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        async with loaded_gateway(c) as (url, gw):
            port = port_of(url)
            cases = {
                # One 1 MiB header: refused once its first 65 KiB are in, not held whole.
                "1 MiB header, lane": post(b"X-Pad: " + b"a" * (1 << 20) + b"\r\n"),
                "1 MiB header, ASGI": get(b"X-Pad: " + b"a" * (1 << 20) + b"\r\n"),
                "20,000 headers, lane": post(b"".join(b"X-N%d: 1\r\n" % i for i in range(20_000))),
                "20,000 headers, ASGI": get(b"".join(b"X-N%d: 1\r\n" % i for i in range(20_000))),
                "101 headers, ASGI": get(b"".join(b"X-N%d: 1\r\n" % i for i in range(100))),
                "a 17 KiB header, lane": post(b"X-Big: " + b"b" * (17 << 10) + b"\r\n"),
                "a 17 KiB header, ASGI": get(b"X-Big: " + b"b" * (17 << 10) + b"\r\n", b"/v1/models"),
                "5 headers of 15 KiB, ASGI": get(
                    b"".join(b"X-H%d: %s\r\n" % (i, b"c" * (15 << 10)) for i in range(5))
                ),
            }
            for what, request in cases.items():
                answer = await exchange(port, request)
                status, error = status_and_error(answer)
                assert status == 431, (what, answer[:300])
                assert b"connection: close" in answer.lower(), what
                assert error["type"] == "invalid_request_error", what
                assert error["code"] == "request_header_too_large", what
            # Each names the limit it went past, and how to stay within it.
            said = {
                what: status_and_error(await exchange(port, r))[1]["message"] for what, r in cases.items()
            }
            assert said["101 headers, ASGI"] == (
                "the request has more than 100 headers (the gateway's http: max_header_fields); send fewer"
            )
            assert said["a 17 KiB header, lane"] == (
                "request header 'X-Big' is 17413 bytes, over the gateway's limit of 16384 a header "
                "(http: max_header_field_bytes); send it smaller"
            )
            assert (
                "over the gateway's limit of 65536 (http: max_header_section_bytes)"
                in said["1 MiB header, lane"]
            )
            assert "over the gateway's limit of 65536" in said["5 headers of 15 KiB, ASGI"]

            # Within the limits: 100 headers (Host and 99 more), a 16 KiB one, on both paths.
            ok = [
                get(b"".join(b"X-N%d: 1\r\n" % i for i in range(98)) + b"Connection: close\r\n"),
                get(b"X-Big: " + b"b" * ((16 << 10) - 5) + b"\r\nConnection: close\r\n"),
            ]
            for request in ok:
                answer = await exchange(port, request)
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
            # The lane's answer to a request within the limits: no replica, a 404 for the model.
            lane_ok = post(b"X-Big: " + b"b" * ((16 << 10) - 5) + b"\r\nConnection: close\r\n")
            assert (await exchange(port, lane_ok)).startswith(b"HTTP/1.1 404 "), "within limits on the lane"

            scrape = gw.connections.closed.labels("header_too_large")._value.get()
            assert scrape == 2 * len(cases)
            # Nothing of a refused head is held.
            assert gw.connections.head_bytes == 0


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_heads_held_on_many_connections_are_bounded_and_a_real_request_still_goes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """40 connections each sending 60 KiB of head and then nothing (2.4 MB; the attack held
    240 MB this way): at `header_bytes_in_flight` (1 MiB here) the ones that began longest
    ago are closed, the gateway never holds more, and a client's request is answered."""
    limit = 1 << 20
    with cluster(tmp_path, nats_url, prefix) as c:
        async with (
            loaded_gateway(c, header_bytes_in_flight=limit, header_timeout_s=60) as (url, gw),
            contextlib.AsyncExitStack() as stack,
        ):
            port = port_of(url)
            streams: list[anyio.abc.SocketStream] = []
            most = 0
            for i in range(40):
                stream = await stack.enter_async_context(await anyio.connect_tcp("127.0.0.1", port))
                await stream.send(b"GET /healthz HTTP/1.1\r\nX-Slow-%d: " % i + b"s" * (60 << 10))
                streams.append(stream)

                def counted(n: int = i) -> bool:
                    # Each connection's bytes are in (the evictions among them made).
                    return gw.connections.head_bytes >= min(limit - (60 << 10), (n + 1) * (60 << 10))

                await eventually(counted, timeout=10)
                most = max(most, gw.connections.head_bytes)
            assert most <= limit
            evicted = gw.connections.closed.labels("head_evicted")._value.get()
            # 17 heads of 60 KiB fit in 1 MiB; the last one's may not all be in yet.
            assert evicted >= 40 - 17 - 1, evicted
            # The first ones sent are the ones closed.
            assert await until_closed(streams[0]) == b""

            answer = await exchange(port, get(b"Connection: close\r\n"))
            assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
            async with httpx.AsyncClient(timeout=10) as client:
                scrape = (await client.get(f"{url}/metrics")).text
            assert metric(scrape, "llmgw_gateway_header_bytes") <= limit
            assert metric(scrape, 'llmgw_gateway_connections_closed_total{reason="head_evicted"}') >= evicted


class _Conn:
    """A connection as `Connections.charge` sees it."""

    def __init__(self) -> None:
        self.charged = 0
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True


def test_heads_past_the_bound_close_the_longest_arriving_and_refuse_only_when_none_is_left() -> None:
    connections = Connections(
        10,
        header_timeout_s=20,
        body_timeout_s=60,
        registry=CollectorRegistry(),
        headers=HeaderLimits(in_flight_bytes=100),
    )
    a, b, c, d = (_Conn() for _ in range(4))
    charge: Any = connections.charge
    assert charge(a, 40, arriving=True)
    assert charge(b, 40, arriving=True)
    # a's head grows: within the bound still.
    assert charge(a, 50, arriving=True)
    assert connections.head_bytes == 90
    # c's whole head (a request in progress) takes the bound: a, arriving longest, is closed.
    assert charge(c, 30, arriving=False)
    assert (a.aborted, b.aborted, connections.head_bytes) == (True, False, 70)
    # d arriving past it: b closed; then d grows with only c's whole head left besides: refused.
    assert charge(d, 60, arriving=True)
    assert (b.aborted, connections.head_bytes) == (True, 90)
    assert not charge(d, 80, arriving=True)
    assert (d.charged, connections.head_bytes) == (0, 30)
    assert connections.head_refusal.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b'"code": "too_many_header_bytes"' in connections.head_refusal
    # Shrinking never closes anything; a request's end releases its head.
    assert charge(c, 0, arriving=False)
    assert connections.head_bytes == 0
    assert connections.closed.labels("head_evicted")._value.get() == 2
    assert connections.closed.labels("head_refused")._value.get() == 1


# --- the checks, fuzzed --------------------------------------------------------------------

limits_strategy = st.builds(
    HeaderLimits,
    field_bytes=st.integers(1, 300),
    section_bytes=st.integers(1, 2000),
    fields=st.integers(0, 20),
)
header = st.tuples(st.binary(max_size=400), st.binary(max_size=400))


@settings(max_examples=300, deadline=None)
@given(limits=limits_strategy, headers=st.lists(header, max_size=30), target=st.integers(0, 3000))
def test_head_count_refuses_exactly_what_is_over_a_limit_and_raises_nothing_else(
    limits: HeaderLimits, headers: list[tuple[bytes, bytes]], target: int
) -> None:
    count = HeadCount(limits)
    # The reference: the first piece past any limit, in order.
    size, expected_refused = target, target > limits.section_bytes
    for i, (name, value) in enumerate(headers):
        if expected_refused:
            break
        field = len(name) + len(value)
        size += field + 4
        expected_refused = i + 1 > limits.fields or field > limits.field_bytes or size > limits.section_bytes
    said = ""
    try:
        count.target(target)
        for name, value in headers:
            count.field(name, value)
    except HeaderTooLarge as exc:
        said = str(exc)
    assert bool(said) == expected_refused
    if said:
        assert "http: max_header_" in said
        assert len(said) < 400  # a name is quoted cut short
    count.reset()
    assert (count.bytes, count.fields) == (0, 0)
    with pytest.raises(HeaderTooLarge):
        count.unfinished(limits.section_bytes + HEAD_SLACK + 1)
    count.unfinished(limits.section_bytes + HEAD_SLACK)


class _Transport(asyncio.Transport):
    """What the protocol writes, and whether it closed: a client connection with no socket."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closing = False
        self.eof = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class _Taken:
    """An express lane that takes every request and answers none: the head went through."""

    def __init__(self) -> None:
        self.taken: list[Lane] = []

    def express(self, lane: Lane) -> bool:
        self.taken.append(lane)
        return True


token = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=40)
fuzz_header = st.tuples(
    token.map(lambda t: f"x-{t}".encode()), st.binary(max_size=600).map(lambda b: b.hex().encode())
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    limits=st.builds(
        HeaderLimits,
        field_bytes=st.integers(16, 1500),
        section_bytes=st.integers(64, 6000),
        fields=st.integers(1, 30),
        in_flight_bytes=st.just(1 << 30),
    ),
    headers=st.lists(fuzz_header, max_size=40),
    cuts=st.lists(st.integers(1, 2000), max_size=20),
)
def test_the_protocol_fed_arbitrary_header_lists_takes_the_request_or_answers_431(
    limits: HeaderLimits, headers: list[tuple[bytes, bytes]], cuts: list[int]
) -> None:
    """Arbitrary header lists in arbitrary reads: the request reaches the lane, or it is
    answered 431 and the connection closes; no exception escapes the protocol."""
    loop = asyncio.new_event_loop()
    try:
        connections = Connections(
            100, header_timeout_s=20, body_timeout_s=60, registry=CollectorRegistry(), headers=limits
        )
        lane = _Taken()
        config = Config(app=lambda scope, receive, send: None, log_config=None)
        config.load()
        cls: Any = protocol(connections, lane, ("/v1/chat/completions",))
        proto = cls(config=config, server_state=ServerState(), app_state={}, _loop=loop)
        transport = _Transport()
        proto.connection_made(transport)
        request = post(b"".join(b"%s: %s\r\n" % h for h in headers))
        pieces, at = [], 0
        for cut in cuts:
            pieces.append(request[at : at + cut])
            at += cut
        pieces.append(request[at:])
        for piece in pieces:
            # What comes after a refusal is dropped while the gateway lingers.
            if piece and not transport.closing:
                proto.data_received(piece)
        if lane.taken:
            assert transport.written == b""
            assert len(lane.taken) == 1
            assert len(lane.taken[0].headers) == len(headers) + 3
        else:
            assert transport.written.startswith(b"HTTP/1.1 431 "), transport.written[:200]
            assert transport.written.count(b"HTTP/1.1") == 1
            assert transport.eof  # written, then read until the client is done or LINGER_S passes
        # The head is counted while the request is in progress, nothing once refused.
        assert connections.head_bytes == (proto._head.bytes if lane.taken else 0)
        proto.connection_lost(None)
        assert connections.head_bytes == 0
    finally:
        loop.close()
