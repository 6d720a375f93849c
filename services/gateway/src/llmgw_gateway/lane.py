"""The express lane (`Lane`): a routed POST with its body's length given (64 KiB at most)
is handed to what takes it (`Express`: the proxy) from the HTTP protocol's callbacks once
its body is in, without uvicorn's request cycle, a task or the ASGI layer, and its answer,
where it comes whole, written here in one piece. What the proxy declines or cannot finish
there goes to the ASGI app as any request, before any byte of answer went out. And the
client connection's transport whose writes in one pass of the event loop go out as one
(`CorkedTransport`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from .surface import RESUMED

log = logging.getLogger("llmgw.gateway")


class CorkedTransport:
    """A client connection's transport whose writes in one pass of the event loop go out as
    one: uvicorn writes an answer's status line and headers, each body chunk and the end of
    its chunked framing apart, each a system call and, with Nagle's algorithm off, a packet
    that wakes the client. An answer not streamed as events came from its replica at once,
    so its three writes become one. What is held waits for the end of the loop's pass, never
    for more data: a streamed event goes out as soon as the task that wrote it yields."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] | None = None

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self._pending is None:
            self._pending = [data]
            self._loop.call_soon(self.flush)
        else:
            self._pending.append(data)

    def flush(self) -> None:
        pending, self._pending = self._pending, None
        if pending and not self._transport.is_closing():
            self._transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def write_now(self, data: bytes) -> None:
        """`data` out at once, after anything held: a whole answer written in one piece has
        nothing to wait for."""
        pending, self._pending = self._pending, None
        if pending:
            data = b"".join([*pending, data])
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending = None
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        # The rest (get_extra_info, pause_reading, resume_reading, set_protocol) as they are.
        return getattr(self._transport, name)


class Express(Protocol):
    """What takes requests from the express lane: the proxy (`express.ExpressLane`)."""

    def express(self, lane: Lane) -> bool: ...


class Lane:
    """A routed POST on the express lane (`connections.GuardedProtocol`), standing where
    uvicorn's request cycle would: the protocol reads and sets `body`, `more_body`, `response_complete`,
    `keep_alive`, `disconnected` and `message_event` on it as on the cycle.

    Its whole body in, `express` (the proxy's) takes it (or declines, and it goes to the ASGI app as
    any request). Taken, it ends with `answer` (the whole answer written here) or with
    `hand_over` to the ASGI app before any byte of answer went out, with what the proxy had
    done so far in the scope (`RESUMED`)."""

    __slots__ = (
        "body",
        "disconnected",
        "express",
        "headers",
        "keep_alive",
        "loop",
        "message_event",
        "more_body",
        "path",
        "protocol",
        "response_complete",
        "scope",
    )

    def __init__(
        self, protocol: HttpToolsProtocol, express: Express | None, path: str, keep_alive: bool
    ) -> None:
        self.protocol = protocol
        self.express = express
        self.loop = protocol.loop
        # The request's, as uvicorn read them (names in lower case): the protocol's own
        # change with the next request on the connection.
        self.scope: dict[str, Any] = protocol.scope  # type: ignore[assignment]
        self.headers: list[tuple[bytes, bytes]] = protocol.headers
        self.path = path
        self.keep_alive = keep_alive
        self.body = bytearray()
        self.more_body = True
        self.response_complete = False
        self.disconnected = False
        self.message_event: Any = _NO_EVENT

    def take(self) -> None:
        """The body is in: the proxy's, or the ASGI app's where it declines."""
        try:
            express = self.express
            taken = express is not None and express.express(self)
        except Exception:
            log.exception("the express lane failed on a request; the ASGI path takes it")
            taken = False
        if not taken:
            self.hand_over()

    def answer(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, then: Callable[[], None]
    ) -> None:
        """Write the whole answer (`headers` less the server's own, as uvicorn writes them),
        call `then` (what is left to do of the request: the client waits on none of it), and
        go on with the connection's next request."""
        self.response_complete = True
        protocol = self.protocol
        transport: CorkedTransport = protocol.transport  # type: ignore[assignment]
        if self.disconnected or transport.is_closing():
            then()
            return
        parts = [STATUS_LINE[status]]
        for name, value in (*protocol.server_state.default_headers, *headers):
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", body)
        transport.write_now(b"".join(parts))
        then()
        if not self.keep_alive:
            transport.close()
        protocol.on_response_complete()

    def hand_over(self, resumed: object = None) -> None:
        """The request to the ASGI app, as uvicorn would have started it, with its body;
        `resumed`: what the proxy did before (nothing where it declined it)."""
        protocol = self.protocol
        cycle = RequestResponseCycle(
            scope=self.scope,  # type: ignore[arg-type]
            transport=protocol.transport,
            flow=protocol.flow,
            logger=protocol.logger,
            access_logger=protocol.access_logger,
            access_log=protocol.access_log,
            default_headers=protocol.server_state.default_headers,
            message_event=asyncio.Event(),
            expect_100_continue=False,
            keep_alive=self.keep_alive,
            on_response=protocol.on_response_complete,
        )
        cycle.body = self.body
        cycle.more_body = self.more_body
        cycle.disconnected = self.disconnected
        cycle.message_event.set()
        if resumed is not None:
            self.scope[RESUMED] = resumed
        if protocol.cycle is self:  # type: ignore[comparison-overlap]
            protocol.cycle = cycle
        protocol._start_asgi_task(cycle, protocol.app)


class _NoEvent:
    """What the protocol sets on a lane's body and end: nothing waits for them."""

    __slots__ = ()

    def set(self) -> None:
        pass


_NO_EVENT = _NoEvent()
