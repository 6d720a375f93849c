"""The gateway's replica connections (`llmgw_gateway.upstream`) against HTTP servers on
loopback that answer as engines and broken servers do: the pool's limit and reuse, a slow
client's answer read no further ahead than the high-water mark, and each failure said as
before or after the replica had the request."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from llmgw_gateway.upstream import HIGH_WATER, Broken, Closed, ReadTimeout, Refused, Upstream, before_answer
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (by Content-Length); its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    await reader.readexactly(int(length.group(1)) if length else 0)
    return head


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s" % (
        extra,
        len(body),
        body,
    )


@contextlib.asynccontextmanager
async def server(handle: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A loopback server running `handle` per connection; yields its URL and a list that
    counts its connections."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handle(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with listener:
        yield f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}", connections


async def keep_answering(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while True:
        head = await read_request(reader)
        path = head.split(b" ")[1]
        writer.write(answer(b'{"path": "%s"}' % path))
        await writer.drain()


async def test_answers_are_read_whole_and_their_connection_is_reused() -> None:
    async with server(keep_answering) as (url, connections):
        pool = Upstream(limit=4)
        try:
            for n in range(3):
                got = await pool.request("POST", url, f"/v1/x{n}", b"{}", [(b"x-n", b"%d" % n)])
                assert got.status == 200
                assert got.complete
                assert got.header(b"content-type") == "application/json"
                assert got.body() == b'{"path": "/v1/x%d"}' % n
                got.release()
            assert len(connections) == 1
        finally:
            await pool.aclose()


async def test_at_the_limit_a_request_waits_for_a_connection_and_is_refused_past_the_pool_timeout() -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            await release.wait()
            writer.write(answer(b"{}"))
            await writer.drain()

    async with server(slow) as (url, connections):
        pool = Upstream(limit=1, pool_timeout_s=0.3)
        try:
            first = asyncio.ensure_future(pool.request("POST", url, "/", b"{}", []))
            await eventually(lambda: bool(connections))
            with pytest.raises(Refused, match="limit of 1 replica connections") as refused:
                await pool.request("POST", url, "/", b"{}", [])
            assert before_answer(refused.value)
            # One waiting when the first answer comes takes its connection.
            second = asyncio.ensure_future(pool.request("POST", url, "/", b"{}", []))
            release.set()
            for done in (await first, await second):
                assert done.status == 200
                done.release()
            assert len(connections) == 1
        finally:
            await pool.aclose()


async def test_at_the_limit_an_idle_connection_of_another_replica_makes_room() -> None:
    async with server(keep_answering) as (a, on_a), server(keep_answering) as (b, on_b):
        pool = Upstream(limit=1, pool_timeout_s=0.5)
        try:
            for url in (a, b, a):
                got = await pool.request("POST", url, "/", b"{}", [])
                assert got.status == 200
                got.release()
            assert (len(on_a), len(on_b)) == (2, 1)
            assert [len(idle) for idle in pool._idle.values()] == [1]  # a's second connection
        finally:
            await pool.aclose()


async def test_a_connection_the_replica_closed_while_idle_is_not_used_again() -> None:
    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()

    async with server(one_answer) as (url, connections):
        pool = Upstream(limit=4)
        try:
            for _ in range(3):
                got = await pool.request("POST", url, "/", b"{}", [])
                assert got.status == 200
                got.release()
                await eventually(lambda: not pool._open)  # the replica's close has reached the pool
            assert len(connections) == 3
            assert not pool._idle  # nothing kept of a replica with no connection left
        finally:
            await pool.aclose()


async def test_a_slow_client_makes_the_replica_wait_not_the_gateway_buffer() -> None:
    size = 64 << 20  # more than the sockets between them hold
    sent = asyncio.Event()

    async def big(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        sent.set()

    async with server(big) as (url, _):
        pool = Upstream(limit=4)
        try:
            got = await pool.request("POST", url, "/", b"{}", [])
            chunks = got.chunks()
            received = len(await anext(chunks))
            # The client reads nothing meanwhile: the gateway stops reading at the high-water mark.
            await eventually(lambda: got._paused)
            assert not sent.is_set()
            assert got._buffered <= HIGH_WATER + 65536 * 4
            async for chunk in chunks:
                received += len(chunk)
            assert received == size
            assert got.complete
            got.release()
        finally:
            await pool.aclose()


async def test_each_failure_says_whether_the_replica_had_the_request() -> None:
    async def close_at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def cut_off(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.Event().wait()  # held open, answering nothing

    async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()
        await asyncio.Event().wait()  # held open, answering nothing

    pool = Upstream(limit=4, read_timeout_s=0.3, connect_timeout_s=2)
    try:
        async with server(close_at_once) as (url, _):
            with pytest.raises(Closed, match="closed the connection before answering") as closed:
                await pool.request("POST", url, "/", b"{}", [])
            assert before_answer(closed.value)
        async with server(cut_off) as (url, _):
            got = await pool.request("POST", url, "/", b"{}", [])
            with pytest.raises(Broken, match="mid-answer") as broken:
                _ = [chunk async for chunk in got.chunks()]
            got.release()
            assert not before_answer(broken.value)
        async with server(silent) as (url, _):
            with pytest.raises(ReadTimeout, match=r"within 0\.3s") as timed_out:
                await pool.request("POST", url, "/", b"{}", [])
            assert not before_answer(timed_out.value)
        async with server(not_http) as (url, _):
            with pytest.raises(Broken, match=r"not HTTP/1\.1"):
                await pool.request("POST", url, "/", b"{}", [])
        async with server(keep_answering) as (url, _):
            pass
        with pytest.raises(Refused, match=r"cannot connect to 127\.0\.0\.1") as refused:
            await pool.request("POST", url, "/", b"{}", [])
        assert before_answer(refused.value)
        assert not pool._open  # every failed connection closed
    finally:
        await pool.aclose()


async def test_an_interim_answer_is_skipped_and_a_body_without_length_ends_with_the_connection() -> None:
    async def early_hints(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\nto the end")
        await writer.drain()

    async with server(early_hints) as (url, _):
        pool = Upstream(limit=4)
        try:
            got = await pool.request("POST", url, "/", b"{}", [])
            assert got.status == 200
            assert got.header(b"link") == ""
            assert b"".join([chunk async for chunk in got.chunks()]) == b"to the end"
            got.release()
        finally:
            await pool.aclose()
