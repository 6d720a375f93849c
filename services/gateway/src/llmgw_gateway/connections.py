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

And a request's head is bounded (`heads.py`: `HeadCount`, `HeaderLimits`): llhttp (httptools) keeps
every byte of a header until its line ends, and uvicorn every header of a request, with no
limit of their own, so one 1 MiB header, 20,000 headers, or many connections sending heads
slowly were held whole. A header over `field_bytes`, more than `fields` headers, or a head
over `section_bytes` is answered 431 and the connection closed; and the bytes of every head
held (one still arriving, or one whose request is in progress) count against
`in_flight_bytes` gateway-wide (`Connections.charge`), as connections count against `limit`.

And the express lane (`lane.py`'s `Lane`): a routed POST with its body's length given (64 KiB at most)
is handed to the proxy (`express.py`) from the protocol's callbacks once its body is in,
without uvicorn's request cycle, a task or the ASGI layer, and its answer, where it comes
whole, written here in one piece. What the proxy declines or cannot finish there goes to
the ASGI app as any request, before any byte of answer went out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar, Literal

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .guard import ACCEPT_BACKLOG as ACCEPT_BACKLOG
from .guard import Connections as Connections
from .guard import answer_bytes
from .guard import connection_limit as connection_limit
from .guard import open_file_limit as open_file_limit
from .guard import raise_open_file_limit as raise_open_file_limit
from .heads import HEAD_SLACK as HEAD_SLACK
from .heads import HeadCount as HeadCount
from .heads import HeaderLimits as HeaderLimits
from .heads import HeaderTooLarge as HeaderTooLarge
from .lane import CorkedTransport as CorkedTransport
from .lane import Express, Lane

log = logging.getLogger("llmgw.gateway")

Phase = Literal["headers", "body"]
# How long a connection whose request was refused from its head is read (and what comes
# dropped) before it is closed.
LINGER_S = 2.0


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
        self._refuse(answer_bytes(431, str(exc), "invalid_request_error", "request_header_too_large"))

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
            self.cycle = Lane(self, self.lane, path, self.parser.should_keep_alive())  # type: ignore[assignment]
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
