"""Client connections the gateway holds: how many at once, and how long a client may take
to send its request.

uvicorn (0.54) bounds neither. Its keep-alive timer runs only between requests and every
byte received cancels it, so a client that never sends a request, or trickles a header
every few seconds, holds its connection for good. Its `limit_concurrency` answers 503 only
once a whole request has arrived and never stops accepting, so asyncio's accept loop takes
connections until the open-file limit: accept then fails with EMFILE (`socket.accept() out
of system resource`), the listener is dropped for a second at a time, and no descriptor is
left to reach a replica with.

Without replacing the server:

- `protocol(connections)` is uvicorn's httptools protocol with one deadline per phase of a
  request: its headers within `header_timeout_s` of the connection (on a kept-alive one, of
  the request's first byte), then its body within `body_timeout_s` of the headers. A
  deadline passed aborts the connection; bytes arriving slowly never move it.
- `Connections` counts them against a limit below the open-file limit (`connection_limit`),
  keeping those without a request in progress in the order they began to wait. At the
  limit a new connection closes the one that has waited longest (as nginx reuses idle
  keep-alive connections), so idle or stalled clients cannot lock out a real one; when every
  connection has a request in progress the new one is answered 503 at once and closed.

And a request's head is bounded (`HeadCount`, `HeaderLimits`): llhttp (httptools) keeps
every byte of a header until its line ends, and uvicorn every header of a request, with no
limit of their own, so one 1 MiB header, 20,000 headers, or many connections sending heads
slowly were held whole. A header over `field_bytes`, more than `fields` headers, or a head
over `section_bytes` is answered 431 and the connection closed; and the bytes of every head
held (one still arriving, or one whose request is in progress) count against
`in_flight_bytes` gateway-wide (`Connections.charge`), as connections count against `limit`.

And the express lane (`Lane`): a routed POST with its body's length given (64 KiB at most)
is handed to the proxy (`Proxy.express`) from the protocol's callbacks once its body is in,
without uvicorn's request cycle, a task or the ASGI layer, and its answer, where it comes
whole, written here in one piece. What the proxy declines or cannot finish there goes to
the ASGI app as any request, before any byte of answer went out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import httptools
from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle

from llmgw_core.errors import ConfigError

from .limits import shown
from .proxy import RESUMED, error_body

log = logging.getLogger("llmgw.gateway")

# Connections asyncio accepts in one pass of its accept loop (it is the listen backlog too),
# all of them before the first reaches `connection_made` to be counted: `reserved_fds` covers them.
ACCEPT_BACKLOG = 128
# What an unlimited open-file limit counts as (Linux's default ceiling, fs.nr_open).
UNLIMITED_FILES = 1 << 20
# At the limit, each kind of warning is logged at most this often.
WARN_EVERY_S = 60.0

Phase = Literal["headers", "body"]
# What a head not yet complete may hold past `section_bytes` before it is refused: the
# request line's method and version, and each header line's `: ` and CRLF, which the exact
# count (`HeadCount.bytes`) adds as 4 a header.
HEAD_SLACK = 1024
# How long a connection whose request was refused from its head is read (and what comes
# dropped) before it is closed.
LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class HeaderLimits:
    """How large a request's head may be (gateway.yaml's `http:`): one header (its name and
    value), the number of headers, and the whole head (the request target and every header
    line); and the bytes of heads the gateway holds at once, every connection's together."""

    field_bytes: int = 16 << 10
    section_bytes: int = 64 << 10
    fields: int = 100
    in_flight_bytes: int = 64 << 20


class HeaderTooLarge(Exception):
    """A request's head past a limit of `HeaderLimits`: answered 431, the connection closed."""


class HeadCount:
    """The size of one request's head so far, checked at each piece the parser hands over:
    its target (`target`), each header (`field`), and the bytes of a head not yet complete
    (`unfinished`: the parser keeps a header's bytes until its line ends, so a 1 MiB header
    is refused once its first 65 KiB are in, not once it is whole). Raises `HeaderTooLarge`,
    and nothing else, past a limit."""

    __slots__ = ("bytes", "fields", "limits")

    def __init__(self, limits: HeaderLimits) -> None:
        self.limits = limits
        self.bytes = 0
        self.fields = 0

    def reset(self) -> None:
        self.bytes = 0
        self.fields = 0

    def target(self, size: int) -> None:
        self.bytes += size
        if self.bytes > self.limits.section_bytes:
            raise HeaderTooLarge(self._section_message(self.bytes, "by its target and headers"))

    def field(self, name: bytes, value: bytes) -> None:
        # On every header of every request: the checks inline, the words only for a refusal.
        size = len(name) + len(value)
        self.fields += 1
        self.bytes += size + 4
        limits = self.limits
        if size > limits.field_bytes or self.fields > limits.fields or self.bytes > limits.section_bytes:
            raise self._refusal(name, size)

    def unfinished(self, received: int) -> None:
        """`received` bytes of a head not yet complete are in."""
        if received > self.limits.section_bytes + HEAD_SLACK:
            raise HeaderTooLarge(self._section_message(received, "and not yet complete"))

    def _refusal(self, name: bytes, size: int) -> HeaderTooLarge:
        limits = self.limits
        if self.fields > limits.fields:
            return HeaderTooLarge(
                f"the request has more than {limits.fields} headers (the gateway's http: "
                "max_header_fields); send fewer"
            )
        if size > limits.field_bytes:
            return HeaderTooLarge(
                f"request header {shown(name.decode('latin-1'))} is {size} bytes, over the gateway's "
                f"limit of {limits.field_bytes} a header (http: max_header_field_bytes); send it smaller"
            )
        return HeaderTooLarge(self._section_message(self.bytes, "by its target and headers"))

    def _section_message(self, size: int, how: str) -> str:
        return (
            f"the request's head is {size} bytes {how}, over the gateway's limit of "
            f"{self.limits.section_bytes} (http: max_header_section_bytes); send fewer or smaller headers"
        )


def _answer(status: int, message: str, kind: str, code: str, retry_after: int | None = None) -> bytes:
    """A whole answer the protocol writes itself, then closes: OpenAI's error object."""
    body = json.dumps(error_body(message, kind, code)).encode()
    retry = b"retry-after: %d\r\n" % retry_after if retry_after is not None else b""
    return b"%scontent-type: application/json\r\n%sconnection: close\r\ncontent-length: %d\r\n\r\n%s" % (
        STATUS_LINE[status],
        retry,
        len(body),
        body,
    )


def raise_open_file_limit() -> None:
    """Raise this process's open-file limit to its hard limit, as Go's runtime does at start:
    the soft default (often 1024) is a relic of select(), which asyncio does not use."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or hard == resource.RLIM_INFINITY or soft >= hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:
        log.warning("cannot raise the open-file limit from %d to its hard limit %d: %s", soft, hard, exc)


def open_file_limit() -> int:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return UNLIMITED_FILES if soft == resource.RLIM_INFINITY else soft


def connection_limit(max_connections: int, reserved_fds: int, open_files: int) -> int:
    """How many client connections the gateway may hold: `max_connections`, or with 0 as many
    as `open_files` allows. Each counts twice (its own descriptor, and the replica connection
    its request holds: the upstream pool is capped at the same number), after `reserved_fds`."""
    room = (open_files - reserved_fds) // 2
    if room < 1:
        raise ConfigError(
            f"the open-file limit (ulimit -n) is {open_files}, which leaves no room for client "
            f"connections after http: reserved_fds {reserved_fds}; raise it (ulimit -n, LimitNOFILE= "
            f"in a systemd unit, --ulimit nofile= for docker)"
        )
    if max_connections > room:
        raise ConfigError(
            f"http: max_connections {max_connections} needs {2 * max_connections + reserved_fds} open "
            f"files (one per client connection, one per replica connection its request holds, and "
            f"http: reserved_fds {reserved_fds}) but the open-file limit (ulimit -n) is {open_files}; "
            f"raise that limit, or set max_connections to {room} or less (0 takes what it allows)"
        )
    return max_connections or room


class Connections:
    """The gateway's client connections: counted, the waiting ones in order, and the metrics."""

    def __init__(
        self,
        limit: int,
        *,
        header_timeout_s: float,
        body_timeout_s: float,
        registry: CollectorRegistry,
        headers: HeaderLimits | None = None,
    ) -> None:
        self.limit = limit
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.headers = headers or HeaderLimits()
        self._open: set[GuardedProtocol] = set()
        # Connections without a request in progress, the longest waiting first.
        self._waiting: OrderedDict[GuardedProtocol, None] = OrderedDict()
        # Bytes of request heads held, every connection's (`GuardedProtocol.charged`), and the
        # connections whose head is still arriving, the one that began it longest ago first.
        self.head_bytes = 0
        self._heads: OrderedDict[GuardedProtocol, None] = OrderedDict()
        self._warned: dict[str, float] = {}
        self.refusal = _answer(
            503,
            f"the gateway holds its limit of {limit} client connections (http: max_connections), "
            "each with a request in progress; retry shortly",
            "service_unavailable",
            "too_many_connections",
            retry_after=1,
        )
        self.head_refusal = _answer(
            503,
            f"the gateway holds its limit of {self.headers.in_flight_bytes} bytes of request headers "
            "(http: header_bytes_in_flight), each of a request in progress; retry shortly",
            "service_unavailable",
            "too_many_header_bytes",
            retry_after=1,
        )
        Gauge(
            "llmgw_gateway_connections",
            "Client connections open.",
            registry=registry,
        ).set_function(lambda: self.held)
        Gauge(
            "llmgw_gateway_connection_limit",
            "Client connections the gateway holds at most (http: max_connections, or what the "
            "open-file limit allows).",
            registry=registry,
        ).set(limit)
        self.closed = Counter(
            "llmgw_gateway_connections_closed",
            "Client connections the gateway closed, by reason: header_timeout, body_timeout, "
            "evicted (at the limit, for a new connection: it had waited longest without a request), "
            "refused (at the limit, every connection with a request in progress), header_too_large "
            "(answered 431: a header, the headers' count or the head over its limit), head_evicted "
            "(at http: header_bytes_in_flight, for another head: its head had been arriving longest), "
            "head_refused (at http: header_bytes_in_flight, every head held of a request in progress).",
            ["reason"],
            registry=registry,
        )
        for reason in (
            "header_timeout",
            "body_timeout",
            "evicted",
            "refused",
            "header_too_large",
            "head_evicted",
            "head_refused",
        ):
            self.closed.labels(reason)  # each at 0 from the start, for rate() and alerts
        Gauge(
            "llmgw_gateway_header_bytes",
            "Bytes of request heads the gateway holds (still arriving, or of a request in progress); "
            "at most http: header_bytes_in_flight.",
            registry=registry,
        ).set_function(lambda: self.head_bytes)

    @property
    def held(self) -> int:
        """Connections open."""
        return len(self._open)

    @property
    def waiting(self) -> int:
        """Connections open without a request in progress."""
        return len(self._waiting)

    def admit(self, conn: GuardedProtocol) -> bool:
        """Count a new connection in, making room if need be; False: refuse it."""
        if len(self._open) >= self.limit:
            if not self._waiting:
                self.closed.labels("refused").inc()
                self._warn("refused", "every one has a request in progress: new ones are answered 503")
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self._open.discard(oldest)
            self.closed.labels("evicted").inc()
            self._warn("evicted", "each new one closes the one that has waited longest without a request")
            oldest.abort()
        self._open.add(conn)
        self._waiting[conn] = None
        return True

    def busy(self, conn: GuardedProtocol, busy: bool) -> None:
        """Whether `conn` has a request in progress; one that stops waiting joins the back of the line."""
        if conn not in self._open:
            return
        if busy:
            self._waiting.pop(conn, None)
        elif conn not in self._waiting:
            self._waiting[conn] = None

    def gone(self, conn: GuardedProtocol) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self.charge(conn, 0, arriving=False)

    def charge(self, conn: GuardedProtocol, size: int, *, arriving: bool) -> bool:
        """`conn` holds `size` bytes of request heads now (`arriving`: its head is still coming).
        Grown past `header_bytes_in_flight`, the connections whose heads have been arriving
        longest are closed to make room, as `admit` closes the longest waiting for a new
        connection; False where only heads of requests in progress are left and `conn`'s is
        still arriving: refuse it (it is uncounted then). A whole head is kept: its request
        goes on."""
        grew = size > conn.charged
        self.head_bytes += size - conn.charged
        conn.charged = size
        if arriving:
            self._heads.setdefault(conn, None)
        else:
            self._heads.pop(conn, None)
        while grew and self.head_bytes > self.headers.in_flight_bytes:
            oldest = next((c for c in self._heads if c is not conn), None)
            if oldest is None:
                if not arriving:
                    return True
                self.charge(conn, 0, arriving=False)
                self.closed.labels("head_refused").inc()
                self._warn("head_refused", "heads of requests in progress hold it all: new ones get 503")
                return False
            self.gone(oldest)
            self.closed.labels("head_evicted").inc()
            self._warn("head_evicted", "each new head closes the one that has been arriving longest")
            oldest.abort()
        return True

    def _warn(self, kind: str, what: str) -> None:
        now = time.monotonic()
        if now - self._warned.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
            return
        self._warned[kind] = now
        if kind.startswith("head_"):
            log.warning(
                "request heads at the gateway's limit of %d bytes held at once (http: "
                "header_bytes_in_flight): %s",
                self.headers.in_flight_bytes,
                what,
            )
            return
        log.warning(
            "client connections at the gateway's limit of %d (http: max_connections, or what the "
            "open-file limit allows): %s",
            self.limit,
            what,
        )


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
    """What takes requests from the express lane: `Proxy.express`."""

    def express(self, lane: Lane) -> bool: ...


class Lane:
    """A routed POST on the express lane (`GuardedProtocol`), standing where uvicorn's request
    cycle would: the protocol reads and sets `body`, `more_body`, `response_complete`,
    `keep_alive`, `disconnected` and `message_event` on it as on the cycle.

    Its whole body in, `Proxy.express` takes it (or declines, and it goes to the ASGI app as
    any request). Taken, it ends with `answer` (the whole answer written here) or with
    `hand_over` to the ASGI app before any byte of answer went out, with what the proxy had
    done so far in the scope (`RESUMED`)."""

    __slots__ = (
        "body",
        "disconnected",
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

    def __init__(self, protocol: GuardedProtocol, path: str, keep_alive: bool) -> None:
        self.protocol = protocol
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
            lane = self.protocol.lane
            taken = lane is not None and lane.express(self)
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


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, counted by `guard` and with a deadline per request phase.

    httptools (llhttp, in C) rather than h11: h11's pure-Python parsing and framing was a
    fifth of the gateway's CPU per request. The parser's callbacks mark the phases: a
    request's first byte (`on_message_begin`), its headers' end, its end.
    """

    guard: ClassVar[Connections]
    # What takes the express lane's requests (the proxy), and the request lines' paths it takes.
    lane: ClassVar[Express | None] = None
    lane_paths: ClassVar[frozenset[bytes]] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: Phase | None = None
        # In a read: a phase's deadline is started at its end, so that a request whose headers
        # and body come in one read (the usual case) starts none.
        self._reading = False
        # The request's head: its size so far, whether it is still arriving, the bytes read
        # while it is, and the size of the last whole head, held until its answer is out.
        self._head = HeadCount(self.guard.headers)
        self._in_head = True
        self._received = 0
        self._kept = 0
        # What a header callback refused, for `_feed` to answer (the parser says only that a
        # callback failed).
        self._too_large: HeaderTooLarge | None = None
        # Refused and closing: what the client still sends is dropped (`_refuse`).
        self._lingering = False
        # Bytes of heads counted against `header_bytes_in_flight` (`Connections.charge`).
        self.charged = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(CorkedTransport(transport, self.loop))  # type: ignore[arg-type]
        if not self.guard.admit(self):
            transport.write(self.guard.refusal)
            transport.close()
            return
        # Even a client that sends nothing: its request's headers are due from now.
        self._arm("headers")

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # answered and closing: dropped unread
        if self._in_head:
            self._received += len(data)
        self._reading = True
        try:
            self._feed(data)
        finally:
            self._reading = False
            if self._phase is not None and self._deadline is None:
                self._start_deadline(self._phase)
        if self._in_head and self._received and not self.transport.is_closing():
            # A head still arriving after this read: what the parser keeps of it is refused
            # past the head's limit, and counted against the gateway's (a head that comes
            # whole in one read, the usual case, is counted once, whole).
            try:
                self._head.unfinished(self._received)
            except HeaderTooLarge as exc:
                self._refuse_head(exc)
            else:
                if not self.guard.charge(self, self._kept + self._received, arriving=True):
                    self._refuse(self.guard.head_refusal)
        self._follow()

    def _feed(self, data: bytes) -> None:
        """uvicorn's `data_received`, with a head over its limits answered 431 rather than 400
        and logged as no invalid request."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            too_large, self._too_large = self._too_large, None
            if too_large is not None:
                self._refuse_head(too_large)
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)

    def _refuse_head(self, exc: HeaderTooLarge) -> None:
        self.guard.closed.labels("header_too_large").inc()
        self._refuse(_answer(431, str(exc), "invalid_request_error", "request_header_too_large"))

    def _refuse(self, answer: bytes) -> None:
        """Answer the request whose head is arriving with `answer`, and close. Where an answer
        to a request before it is still going out (pipelined), the connection is aborted
        instead: a second answer would cut into the first."""
        self._disarm()
        self._in_head = False
        self.guard.charge(self, 0, arriving=False)
        if self.cycle is not None and not self.cycle.response_complete:
            self.abort()
            return
        transport: CorkedTransport = self.transport  # type: ignore[assignment]
        transport.write_now(answer)
        # The client may still be sending its head (a 1 MiB header): closed with its bytes
        # unread, the connection is reset, and the client reads the reset instead of the
        # answer. So the gateway stops writing and drops what still comes, for LINGER_S at
        # most, before it closes (nginx's lingering close).
        self._lingering = True
        transport.write_eof()
        self._deadline = self.loop.call_later(LINGER_S, self.abort)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        head = self._head
        head.bytes = head.fields = 0
        if self._phase is None:
            # The next request on a kept-alive connection: its headers are due from its first byte.
            self._arm("headers")

    def on_url(self, url: bytes) -> None:
        try:
            self._head.target(len(url))
        except HeaderTooLarge as exc:
            self._too_large = exc  # for `_feed` to answer: the parser says only that a callback failed
            raise
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        try:
            self._head.field(name, value)
        except HeaderTooLarge as exc:
            self._too_large = exc
            raise
        # uvicorn's own `on_header`, here rather than called: this runs for every header of
        # every request.
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        # The head is whole: what it holds now is its headers, until its answer is out.
        self._in_head = False
        self._kept, self._received = self._head.bytes, 0
        self.guard.charge(self, self._kept, arriving=False)
        if self.url in self.lane_paths and self._lane_fits():
            # What uvicorn sets in the scope for such a request; the lane stands for its cycle.
            path = self.url.decode("ascii")
            scope = self.scope
            scope["method"] = "POST"
            scope["path"] = path
            scope["raw_path"] = self.url
            scope["query_string"] = b""
            self.cycle = Lane(self, path, self.parser.should_keep_alive())  # type: ignore[assignment]
        else:
            super().on_headers_complete()
        self._arm("body")

    def _lane_fits(self) -> bool:
        """Whether the request goes on the express lane: a POST over HTTP/1.1 with no request
        before it unanswered (uvicorn queues those), its body of a length given that fits in
        what uvicorn reads before pausing, no `Expect: 100-continue` and none of `_NOT_ON_LANE`."""
        if (
            self.lane is None
            or self.expect_100_continue
            or (self.cycle is not None and not self.cycle.response_complete)
            or self.parser.get_method() != b"POST"
            or self.parser.get_http_version() != "1.1"
        ):
            return False
        length = b""
        for name, value in self.headers:
            if name == b"content-length":
                if length:
                    return False
                length = value
            elif name in _NOT_ON_LANE:
                return False
        return length.isdigit() and int(length) <= HIGH_WATER_LIMIT

    def on_message_complete(self) -> None:
        # What comes next on the connection is the next request's head.
        self._in_head, self._received = True, 0
        lane = self.cycle
        if isinstance(lane, Lane):
            lane.more_body = False
            self._disarm()
            lane.take()
            return
        super().on_message_complete()
        self._disarm()
        if self.cycle is not None and self.cycle.response_complete and self.timeout_keep_alive_task is None:
            # Answered before its body was all in: the body's bytes cancelled uvicorn's
            # keep-alive timer, and nothing else would close the idle connection.
            self._arm("headers")

    def on_response_complete(self) -> None:
        self._kept = 0
        if self.charged:
            arriving = self._in_head and self._received > 0
            self.guard.charge(self, self._received if arriving else 0, arriving=arriving)
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.gone(self)
        super().connection_lost(exc)

    def abort(self) -> None:
        """Close now, dropping anything unsent: a client that does not read cannot hold it open."""
        self._disarm()
        self.transport.abort()

    def _follow(self) -> None:
        """The place in the waiting line, from where the request stands."""
        self.guard.busy(self, self.cycle is not None and not self.cycle.response_complete)

    def _arm(self, phase: Phase) -> None:
        self._disarm()
        self._phase = phase
        if not self._reading:
            self._start_deadline(phase)

    def _start_deadline(self, phase: Phase) -> None:
        c = self.guard
        timeout = c.header_timeout_s if phase == "headers" else c.body_timeout_s
        self._deadline = self.loop.call_later(timeout, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = None

    def _expired(self, phase: Phase) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        self.guard.closed.labels(f"{'header' if phase == 'headers' else 'body'}_timeout").inc()
        self.abort()


# Headers that keep a request off the express lane: a body without a length; what uvicorn's
# proxy-headers middleware and the CORS middleware (`http: cors_origins`) read.
_NOT_ON_LANE = frozenset({b"transfer-encoding", b"x-forwarded-for", b"x-forwarded-proto", b"origin"})


def protocol(
    connections: Connections, lane: Express | None = None, paths: tuple[str, ...] = ()
) -> type[asyncio.Protocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=…)`), counting into `connections`;
    POSTs to `paths` go to `lane` (the proxy) first."""
    attributes = {"guard": connections, "lane": lane, "lane_paths": frozenset(p.encode() for p in paths)}
    return type("GatewayProtocol", (GuardedProtocol,), attributes)
