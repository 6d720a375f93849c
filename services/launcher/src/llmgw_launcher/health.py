"""Health probes of every engine on the node, through one client that keeps its connections.

One prober per launcher, not one HTTP client per shard: building an
`httpx.AsyncClient` builds an SSL context (about 16 ms of CPU, on the event
loop), and a general-purpose client spends over a millisecond of CPU per
request on this kind of machine, so a hundred shards probed every second
would take a fifth of a core. A probe here is one `GET` over a kept-alive
connection, spoken with h11 (the HTTP/1.1 state machine httpx itself is
built on): a few hundred microseconds.

A probe answers one question, "did the engine say 200 in time?", and never
raises: a refused connection, a reset, a timeout or a malformed answer is
"not healthy". vLLM binds its port before the model is loaded, so a
connection that gets no answer within the timeout is still loading, not ready.
"""

from __future__ import annotations

import contextlib
from urllib.parse import urlsplit

import anyio
import anyio.abc
import h11

# An engine's health answer is a few bytes; one that goes on past this is not
# a health endpoint, and its connection is not kept.
MAX_BODY = 64 * 1024
# At most this many idle connections are kept per engine address.
IDLE_PER_ADDRESS = 2


class _Conn:
    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=16 * 1024)


class HealthProber:
    """`await prober.healthy(url)`: True only for a 200 within `timeout_s`."""

    def __init__(self, timeout_s: float = 2.0) -> None:
        self.timeout_s = timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._closed = False
        # Counters for /metrics and the benchmarks: connections opened against probes sent
        # shows whether connections are kept.
        self.probes = 0
        self.connections_opened = 0
        self.failures = 0

    async def healthy(self, url: str) -> bool:
        parts = urlsplit(url)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.probes += 1
        ok = False
        with anyio.move_on_after(self.timeout_s):
            ok = await self._probe((host, port), target)
        if not ok:
            self.failures += 1
        return ok

    async def _probe(self, addr: tuple[str, int], target: str) -> bool:
        conn = self._take(addr)
        if conn is not None:
            status = await self._use(conn, addr, target)
            if status is not None:
                return status == 200
            # A kept connection the engine had closed (it restarted, or timed
            # the connection out) is not a failed check: one fresh try.
        conn = await self._connect(addr)
        if conn is None:
            return False
        return await self._use(conn, addr, target) == 200

    async def _connect(self, addr: tuple[str, int]) -> _Conn | None:
        try:
            stream = await anyio.connect_tcp(*addr)
        except OSError:
            return None
        self.connections_opened += 1
        return _Conn(stream)

    async def _use(self, conn: _Conn, addr: tuple[str, int], target: str) -> int | None:
        """One exchange on `conn`, kept for the next probe if it can be; the status, or None if none came."""
        try:
            status, reusable = await self._exchange(conn, addr, target)
        except (OSError, anyio.BrokenResourceError, anyio.EndOfStream, h11.ProtocolError):
            status, reusable = None, False
        except BaseException:
            # Cancelled mid-exchange (the probe timed out): the connection is
            # in an unknown state and is not kept.
            await self._discard(conn)
            raise
        if reusable:
            await self._keep(addr, conn)
        else:
            await self._discard(conn)
        return status

    async def _exchange(self, conn: _Conn, addr: tuple[str, int], target: str) -> tuple[int | None, bool]:
        """Send one GET and read the whole answer: its status, and whether the connection can be reused."""
        c = conn.h11
        request = h11.Request(
            method="GET", target=target, headers=[("Host", f"{addr[0]}:{addr[1]}"), ("Accept", "*/*")]
        )
        await conn.stream.send(c.send(request) + c.send(h11.EndOfMessage()))
        status: int | None = None
        body = 0
        while True:
            event = c.next_event()
            if event is h11.NEED_DATA:
                try:
                    data = await conn.stream.receive(65536)
                except anyio.EndOfStream:
                    data = b""
                c.receive_data(data)
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += len(event.data)
                if body > MAX_BODY:
                    # An answer, but not a connection worth reading to the end.
                    return status, False
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                return None, False
        if c.our_state is h11.DONE and c.their_state is h11.DONE:
            c.start_next_cycle()
            return status, True
        # Answered with `Connection: close`: the status stands, the connection goes.
        return status, False

    def _take(self, addr: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(addr)
        if not idle:
            return None
        conn = idle.pop()
        if not idle:
            del self._idle[addr]
        return conn

    async def _keep(self, addr: tuple[str, int], conn: _Conn) -> None:
        idle = self._idle.get(addr, [])
        if self._closed or len(idle) >= IDLE_PER_ADDRESS:
            await self._discard(conn)
            return
        self._idle[addr] = [*idle, conn]

    async def _discard(self, conn: _Conn) -> None:
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await conn.stream.aclose()

    async def forget(self, url: str) -> None:
        """Close the kept connections to an engine that is gone (its port may be reused)."""
        parts = urlsplit(url)
        addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        for conn in self._idle.pop(addr, []):
            await self._discard(conn)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await self._discard(conn)
