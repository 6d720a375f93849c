"""A replica's answer as the gateway's replica client reads it (`Answer`): its status and
headers, its body as it comes, read no further ahead of the client than `HIGH_WATER`; and
the failures of a call to a replica, each saying whether the replica had the request
(`before_answer`)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Protocol

# Bytes of answer read ahead of the client: reading from the replica pauses above HIGH_WATER
# and resumes below LOW_WATER.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class Carrier(Protocol):
    """The connection an answer is read from (`upstream`'s): paused and resumed as the client
    reads, closed where the answer is let go before its end."""

    transport: asyncio.Transport

    def close(self) -> None: ...


class UpstreamError(Exception):
    """A replica call that failed."""


class Refused(UpstreamError):
    """No connection to the replica: it refused or did not accept in time, or the pool had no
    room for one within its timeout. The replica never had the request."""


class Closed(UpstreamError):
    """The replica closed or reset the connection before its answer's status line."""


class ReadTimeout(UpstreamError):
    """The replica sent nothing for the read timeout, with the request in its hands."""


class Broken(UpstreamError):
    """The answer was cut off, or was not HTTP, after the replica had the request."""


# Failures of a replica before any byte of its answer: the request goes to another.
REFUSED = (Refused,)
# Any failure of a replica call.
FAILED = (UpstreamError,)


def before_answer(exc: BaseException) -> bool:
    """Whether `exc`, raised sending a request, means the replica never answered it: it
    refused the connection, or closed or reset it before its status line."""
    return isinstance(exc, (Refused, Closed))


class Answer:
    """A replica's answer: its status and headers once `Upstream.request` returns, its body as
    it comes (`chunks`, or `body` where `complete` already). `release` when done with it: a
    connection whose answer was read to its end is already back in the pool; any other is
    closed."""

    __slots__ = (
        "_buffered",
        "_chunks",
        "_conn",
        "_error",
        "_head",
        "_head_timer",
        "_loop",
        "_paused",
        "_read_timeout_s",
        "_waiter",
        "_watcher",
        "complete",
        "framed",
        "headers",
        "status",
    )

    def __init__(self, conn: Carrier, loop: asyncio.AbstractEventLoop, read_timeout_s: float | None) -> None:
        self._conn: Carrier | None = conn
        self._loop = loop
        self._read_timeout_s = read_timeout_s
        self._head: asyncio.Future[None] = loop.create_future()
        self._waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._error: UpstreamError | None = None
        # Sent without a task to wait for it (`Upstream.send_idle`): told after each read of the
        # replica's bytes and when it fails.
        self._watcher: Callable[[], None] | None = None
        # The status line is due within the read timeout.
        self._head_timer = (
            loop.call_later(read_timeout_s, self._head_timed_out) if read_timeout_s is not None else None
        )
        self.status = 0
        # As received: names in the replica's own case.
        self.headers: list[tuple[bytes, bytes]] = []
        # Whether the body's end is marked (Content-Length or chunked), not the connection's close.
        self.framed = False
        self.complete = False

    def header(self, name: bytes) -> str:
        """The first value of header `name` (lower case), or ""."""
        for n, v in self.headers:
            if n.lower() == name:
                return v.decode("latin-1")
        return ""

    def body(self) -> bytes:
        """The whole body of a `complete` answer."""
        data = b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; raises `ReadTimeout` or `Broken` where the replica
        stops sending or cuts it off."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= LOW_WATER and self._conn is not None:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield chunk
            if self.complete:
                return
            if self._error is not None:
                raise self._error
            await self._wait()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        if self._read_timeout_s is None:
            await waiter
            return
        timer = self._loop.call_later(self._read_timeout_s, self._timed_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            self._error = ReadTimeout(f"no byte from the replica for {self._read_timeout_s:g}s")
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _tell(self) -> None:
        if self._watcher is not None:
            self._watcher()

    @property
    def head_in(self) -> bool:
        """Whether its status line and headers are in, or it failed before them."""
        return self._head.done()

    def unwatch(self) -> None:
        """Tell `send_idle`'s watcher nothing more: the answer is read as `request`'s is."""
        self._watcher = None

    @property
    def failed(self) -> bool:
        """Whether it failed, before its status line or after."""
        return self._error is not None

    def time_out(self) -> None:
        """Fail it as a read that waited the read timeout does: for a watcher, which keeps its
        own deadline for the reads after the status line."""
        self._fail(ReadTimeout(f"no byte from the replica for {self._read_timeout_s:g}s"))

    @property
    def failed_before_answer(self) -> UpstreamError | None:
        """The failure that ended the answer before its status line, if it did."""
        if self._head.done() and self._head.exception() is not None:
            return self._error
        return None

    # --- from the connection --------------------------------------------------------

    def _started(self, status: int) -> None:
        self.status = status
        self._head_due()
        if not self._head.done():
            self._head.set_result(None)

    def _data(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered > HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _done(self) -> None:
        self.complete = True
        if self._paused and self._conn is not None:
            # Paused on this answer's last read: the connection goes back to the pool reading.
            self._paused = False
            self._conn.transport.resume_reading()
        self._conn = None
        self._wake()

    def _head_timed_out(self) -> None:
        if not self._head.done():
            self._fail(ReadTimeout(f"no answer from the replica within {self._read_timeout_s:g}s"))

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        if not self._head.done():
            self._head.set_exception(error)
            # Retrieved or not, it is said by the request that awaits it.
            self._head.exception()
        self._head_due()
        self._wake()
        self._tell()

    def _head_due(self) -> None:
        """The status line's deadline is over: it came, or the answer failed or was let go."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def release(self) -> None:
        """Done with the answer: its connection is closed unless the answer was read whole."""
        self._head_due()
        conn, self._conn = self._conn, None
        if conn is not None and not self.complete:
            conn.close()
