"""The guard on client connections (`Connections`): how many the gateway holds at once,
counted against a limit below the open-file limit (`connection_limit`), and the bytes of
request heads held, every connection's together. At the limit a new connection closes the
one that has waited longest without a request in progress (as nginx reuses idle keep-alive
connections); when every connection has a request in progress the new one is answered 503
at once and closed. The protocol (`connections.GuardedProtocol`) reports to it."""

from __future__ import annotations

import json
import logging
import resource
import time
from collections import OrderedDict
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from llmgw_core.errors import ConfigError

from .errors import error_body
from .heads import HeaderLimits

log = logging.getLogger("llmgw.gateway")


class Guarded(Protocol):
    """A client connection as the guard sees it: the bytes of its request's head it holds,
    and how it is closed at once."""

    charged: int

    def abort(self) -> None: ...


# Connections asyncio accepts in one pass of its accept loop (it is the listen backlog too),
# all of them before the first reaches `connection_made` to be counted: `reserved_fds` covers them.
ACCEPT_BACKLOG = 128
# What an unlimited open-file limit counts as (Linux's default ceiling, fs.nr_open).
UNLIMITED_FILES = 1 << 20
# At the limit, each kind of warning is logged at most this often.
WARN_EVERY_S = 60.0


def answer_bytes(status: int, message: str, kind: str, code: str, retry_after: int | None = None) -> bytes:
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
        self._open: set[Guarded] = set()
        # Connections without a request in progress, the longest waiting first.
        self._waiting: OrderedDict[Guarded, None] = OrderedDict()
        # Bytes of request heads held, every connection's (`Guarded.charged`), and the
        # connections whose head is still arriving, the one that began it longest ago first.
        self.head_bytes = 0
        self._heads: OrderedDict[Guarded, None] = OrderedDict()
        self._warned: dict[str, float] = {}
        self.refusal = answer_bytes(
            503,
            f"the gateway holds its limit of {limit} client connections (http: max_connections), "
            "each with a request in progress; retry shortly",
            "service_unavailable",
            "too_many_connections",
            retry_after=1,
        )
        self.head_refusal = answer_bytes(
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

    def admit(self, conn: Guarded) -> bool:
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

    def busy(self, conn: Guarded, busy: bool) -> None:
        """Whether `conn` has a request in progress; one that stops waiting joins the back of the line."""
        if conn not in self._open:
            return
        if busy:
            self._waiting.pop(conn, None)
        elif conn not in self._waiting:
            self._waiting[conn] = None

    def gone(self, conn: Guarded) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)
        self.charge(conn, 0, arriving=False)

    def charge(self, conn: Guarded, size: int, *, arriving: bool) -> bool:
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
