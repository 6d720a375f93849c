"""The gateway's client for replica calls: HTTP/1.1 over pooled keep-alive connections, one
asyncio protocol per connection and httptools (llhttp, uvicorn's parser) reading the answers.

Not a client library: in front of the same sim engine, with 32 requests in flight, the
gateway spent 0.36 ms of CPU per request with aiohttp's client and 0.23 ms with this
(`python -m bench --only gateway`, both in one run); httpx's pool (httpcore 1.0) walks
every pooled connection on each request and each answer's end, so that at 256 requests in
flight it was most of the gateway's CPU. A request here is one write; an answer not
streamed usually arrives whole in one read, and its connection goes back to the pool as
soon as its last byte is in.

- Connections are kept per replica (host and port), the most recently used taken first, at
  most `limit` open in all; at the limit an idle one of another replica is closed to make room,
  else the request waits up to `pool_timeout_s` for one.
- Answers pass byte for byte: bodies are neither decompressed nor re-encoded (a chunked answer
  is read as its chunks' data; the gateway's server frames what it passes on). Reading stops
  while `HIGH_WATER` bytes wait for the client, so a slow client never makes the gateway hold
  a whole answer.
- A failure says whether the replica had the request: `Refused` (no connection, or none in
  time) and `Closed` (the connection closed or reset before the answer's status line) mean it
  never answered; `ReadTimeout` and `Broken` (cut off, or not HTTP) come after it had it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httptools

from .answer import FAILED as FAILED
from .answer import HIGH_WATER as HIGH_WATER
from .answer import REFUSED as REFUSED
from .answer import Answer as Answer
from .answer import Broken as Broken
from .answer import Closed as Closed
from .answer import ReadTimeout as ReadTimeout
from .answer import Refused as Refused
from .answer import UpstreamError as UpstreamError
from .answer import before_answer as before_answer

# A request body at least this long is written after its head, not copied onto it.
COPY_BELOW = 64 * 1024


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a replica, reading at most one answer at a time."""

    __slots__ = ("_status", "answer", "closed", "key", "parser", "pool", "transport")

    def __init__(self, pool: Upstream, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.answer: Answer | None = None
        self.closed = False
        self._status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        answer = self.answer
        if answer is None:
            # Bytes no request asked for: the connection cannot be trusted with another.
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.answer is not None:
                self.answer._fail(Broken(f"the replica's answer is not HTTP/1.1: {exc}"))
            self.close()
        answer._tell()

    def eof_received(self) -> None:
        if self.answer is None:
            self.close()  # an idle connection the replica closed: out of the pool at once
        # Otherwise the transport closes, and `connection_lost` ends the answer.

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        answer, self.answer = self.answer, None
        if answer is not None and not answer.complete:
            why = f": {exc}" if exc else ""
            if not answer._head.done():
                answer._fail(Closed(f"the replica closed the connection before answering{why}"))
            elif not answer.framed and exc is None:
                answer._done()  # a body that ends where the connection does
            else:
                answer._fail(Broken(f"the replica closed the connection mid-answer{why}"))
        self.pool._drop(self)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()
            self.pool._drop(self)

    # --- httptools callbacks ----------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        answer = self.answer
        if answer is None:
            return
        if 100 <= status < 200:
            answer.headers.clear()  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._status = status
            return
        self._status = 0
        for name, value in answer.headers:
            lower = name.lower()
            if lower == b"content-length" or (lower == b"transfer-encoding" and b"chunked" in value.lower()):
                answer.framed = True
        answer._started(status)

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._data(body)

    def on_message_complete(self) -> None:
        answer = self.answer
        if answer is None or self._status:
            self._status = 0
            return
        self.answer = None
        answer._done()
        if self.parser.should_keep_alive():
            self.pool._idle_again(self)
        else:
            self.close()


def _send(
    conn: _Connection,
    host: bytes,
    method: str,
    path: str,
    body: bytes,
    headers: Iterable[tuple[bytes, bytes]],
) -> None:
    head = b"".join(
        [
            b"%s %s HTTP/1.1\r\nHost: %s\r\n" % (method.encode(), path.encode(), host),
            *(b"%s: %s\r\n" % header for header in headers),
            b"Content-Length: %d\r\n\r\n" % len(body),
        ]
    )
    if len(body) < COPY_BELOW:
        conn.transport.write(head + body)
    else:
        conn.transport.write(head)
        conn.transport.write(body)


class Upstream:
    """The pooled replica connections, made in the running event loop, closed by `aclose`."""

    def __init__(
        self,
        *,
        limit: int = 100,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float | None = None,
        pool_timeout_s: float = 60.0,
    ) -> None:
        self.limit = limit
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.pool_timeout_s = pool_timeout_s
        # Idle connections per replica, the most recently used last.
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        # Every connection open or being opened, idle or not.
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._room: deque[asyncio.Future[None]] = deque()
        self._where: dict[str, tuple[tuple[str, int], bytes]] = {}

    def _address(self, url: str) -> tuple[tuple[str, int], bytes]:
        """(host, port) and the Host header of a replica's base URL."""
        where = self._where.get(url)
        if where is None:
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise Refused(f"cannot call {url!r}: the gateway calls replicas over http://host:port")
            where = (parts.hostname, parts.port or 80), parts.netloc.encode("latin-1")
            if len(self._where) >= 4096:
                self._where.clear()  # replicas come and go on new ports; forget the old ones
            self._where[url] = where
        return where

    async def request(
        self, method: str, url: str, path: str, body: bytes, headers: Iterable[tuple[bytes, bytes]]
    ) -> Answer:
        """Send `method path` with `body` and `headers` (no hop-by-hop ones: Host and
        Content-Length are set here) to the replica at `url`; its answer once its status
        line and headers are in."""
        key, host = self._address(url)
        conn = await self._connection(key)
        answer = conn.answer = Answer(conn, asyncio.get_running_loop(), self.read_timeout_s)
        try:
            _send(conn, host, method, path, body, headers)
            await answer._head
        except BaseException:
            answer.release()
            raise
        return answer

    def send_idle(
        self,
        method: str,
        url: str,
        path: str,
        body: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        watcher: Callable[[], None],
        loop: asyncio.AbstractEventLoop,
    ) -> Answer | None:
        """As `request`, without waiting: sent at once on an idle connection to the replica,
        if there is one (else None, nothing sent). `watcher` is called after each read of the
        replica's bytes (what came is in the answer: its status line, its body, its end) and
        when it fails (its status line not in within the read timeout included); `release`
        the answer as `request`'s."""
        key, host = self._address(url)
        conn = self._take_idle(key)
        if conn is None:
            return None
        answer = conn.answer = Answer(conn, loop, self.read_timeout_s)
        answer._watcher = watcher
        _send(conn, host, method, path, body, headers)
        return answer

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        """The replica's most recently used idle connection, if any. The idle lists hold only
        open connections (a closed one is dropped at once) and no empty list (replicas come
        and go on new ports)."""
        idle = self._idle.get(key)
        if idle is None:
            return None
        conn = idle.pop()
        if not idle:
            del self._idle[key]
        return conn

    async def _connection(self, key: tuple[str, int]) -> _Connection:
        conn = self._take_idle(key)
        if conn is not None:
            return conn
        try:
            async with asyncio.timeout(self.pool_timeout_s):
                while len(self._open) + self._connecting >= self.limit:
                    if not self._close_an_idle_one():
                        room = asyncio.get_running_loop().create_future()
                        self._room.append(room)
                        try:
                            await room
                        finally:
                            if room in self._room:
                                self._room.remove(room)
                    conn = self._take_idle(key)
                    if conn is not None:
                        return conn
        except TimeoutError:
            raise Refused(
                f"no connection free within {self.pool_timeout_s:g}s: the gateway holds its limit of "
                f"{self.limit} replica connections"
            ) from None
        host, port = key
        self._connecting += 1
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await asyncio.get_running_loop().create_connection(
                    lambda: _Connection(self, key), host, port
                )
        except TimeoutError:
            raise Refused(f"cannot connect to {host}:{port} within {self.connect_timeout_s:g}s") from None
        except OSError as exc:
            raise Refused(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from exc
        finally:
            self._connecting -= 1
            self._wake_one()
        if conn.closed:
            # Reset as it opened, before this task ran again: never counted, never written to.
            raise Closed(f"{host}:{port} closed the connection as it opened")
        self._open.add(conn)
        return conn

    def _close_an_idle_one(self) -> bool:
        """Close an idle connection (the one of its replica's that waited longest; closing drops
        it from the idle lists); whether there was one."""
        key = next(iter(self._idle), None)
        if key is None:
            return False
        self._idle[key][0].close()
        return True

    def _wake_one(self) -> None:
        while self._room:
            room = self._room.popleft()
            if not room.done():
                room.set_result(None)
                return

    def _idle_again(self, conn: _Connection) -> None:
        if conn.closed:
            return
        self._idle.setdefault(conn.key, []).append(conn)
        self._wake_one()

    def _drop(self, conn: _Connection) -> None:
        """A connection closed: no longer counted, and out of the idle lists."""
        if conn in self._open:
            self._open.discard(conn)
            idle = self._idle.get(conn.key)
            if idle and conn in idle:
                idle.remove(conn)
                if not idle:
                    del self._idle[conn.key]
            self._wake_one()

    async def aclose(self) -> None:
        for conn in list(self._open):
            conn.close()
