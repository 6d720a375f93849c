"""One connection to NATS: how it is opened, what its disconnects and reconnects say,
and when it is lost for good.

Reconnects forever once connected, each disconnect and reconnect logged once. A
connection that NATS closed for good, or one whose identity every reconnect is refused
for REFUSED_RECONNECT_GRACE_S, is `lost`: said once, and every call on it raises
ConnectionLost, so that the service ends for its supervisor to start it again
(`lifecycle.while_connected`).
"""

from __future__ import annotations

import contextlib
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

import anyio
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from ..access import MAX_SUBJECT_BYTES, GuardedClient, check_subject, inbox_prefix
from ..errors import BusError, ConnectionLost
from ..subjects import Names
from .options import BusOptions

log = logging.getLogger("llmgw.bus")

# A server that refuses this identity at every reconnect for this long will refuse it for
# good: nats-py signs with the public key it read at the first connection, so a rotated
# seed file is only used by a new connection. (Shorter refusals happen: one member of a
# NATS cluster whose auth.conf was not reloaded yet.)
REFUSED_RECONNECT_GRACE_S = 10.0

# How long closing waits for subscriptions to hand over what they hold before it flushes what
# was published and closes. A subscription read by an iterator that stopped reading (a watch
# whose task ended) never empties: nats-py's default of 30 s made every such close take 30 s.
DRAIN_TIMEOUT_S = 5.0

# A server that answers no PING for PING_INTERVAL_S * MAX_OUTSTANDING_PINGS (6 to 8 s) is
# gone, and the client reconnects to another server of the cluster. A partition drops
# packets without a reset: with nats-py's defaults (every 120 s, 2 unanswered) a client
# kept a dead connection for up to 4 minutes, so a placement whose server was cut off from
# the rest stopped leading and none took over, and its node heartbeats reached no one
# (tests/test_multihost_partitions.py, the symmetric split).
PING_INTERVAL_S = 2.0
MAX_OUTSTANDING_PINGS = 3


def transient(exc: BaseException) -> bool:
    """Whether trying the same call again can help: a timeout, a reconnect, a stream
    whose leader is being elected (no responders, 503), a connection being replaced."""
    if isinstance(exc, nats.js.errors.APIError):
        return exc.code in (503, 504) or isinstance(exc, nats.js.errors.ServiceUnavailableError)
    return isinstance(
        exc,
        (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.ConnectionClosedError,
            nats.errors.StaleConnectionError,
            nats.errors.OutboundBufferLimitError,
            nats.js.errors.NoStreamResponseError,
            OSError,
            TimeoutError,
        ),
    )


class Connection:
    """A NATS client and what is known of its link: connected or not, since when, and lost."""

    def __init__(self, options: BusOptions, service: str) -> None:
        self.options = options
        self.service = service
        self.names = Names(options.prefix)
        self.url = options.resolved_url()
        self.identity = options.identity()
        self.nc = GuardedClient(service, str(self.identity))
        self.js: JetStreamContext = self.nc.jetstream()
        self.reconnects = 0
        # Called at each reconnect: what was cached of the old connection is dropped.
        self.on_reconnect: list[Callable[[], None]] = []
        self.closing = False
        # Set once NATS closed this connection for good, or refused every reconnect for
        # REFUSED_RECONNECT_GRACE_S: no call on it can succeed again. `lost_cause` says why.
        self.lost = anyio.Event()
        self.lost_cause = ""
        self._refused_since: float | None = None
        # Whether this client can hear the bus now, and since when (time.monotonic()):
        # a judge of liveness grants every node a fresh timeout from that moment.
        self.connected = True
        self.connected_since = time.monotonic()
        # While not connected: since when (time.monotonic()), for a service that says so.
        self.disconnected_since = 0.0
        # The first connection succeeded: from then on a lost server is retried forever.
        self._opened = False
        # Kept only to explain a first connection that fails: an error holds its
        # traceback, and so the socket of the attempt that failed.
        self._errors: list[Exception] = []

    @classmethod
    async def open(cls, options: BusOptions, service: str) -> Connection:
        """Connect, or raise BusError saying what refused whom and what to do (`retryable`
        unless the identity was refused or TLS failed)."""
        conn = cls(options, service)
        conn._allowed()
        try:
            # Once connected, a lost server is retried forever; the first
            # connection is bounded, so a wrong address or password is an error
            # the operator sees, not a hang.
            with anyio.fail_after(options.connect_timeout_s):
                await conn.nc.connect(**conn._client_options())
            conn._opened = True
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            # Bounded: closing a connection whose TLS handshake failed can wait forever.
            with anyio.move_on_after(2, shield=True), contextlib.suppress(Exception):
                await conn.nc.close()
            errors = conn._errors
            refused = any(_authentication_refused(e) or isinstance(e, ssl.SSLError) for e in [*errors, exc])
            raise BusError(
                _refused_connection(conn.url, service, str(conn.identity), errors, exc),
                # A refused identity stays refused; a server that is not up yet may come up.
                retryable=not refused,
            ) from exc
        conn._errors = []
        conn.connected_since = time.monotonic()
        return conn

    def _allowed(self) -> None:
        """Refuse to connect without credentials unless that was asked for; warn when it was."""
        options, service, url = self.options, self.service, self.url
        if options.authenticated():
            return
        if not options.resolved_insecure():
            raise BusError(
                f"{service}: no NATS identity for {url}: set nats: nkey_seed_file (or LLMGW_NATS_NKEY) "
                "to a seed that `llmgw auth init` wrote, or nats: insecure: true (LLMGW_NATS_INSECURE=1) "
                "for a cluster without authentication",
                retryable=False,
            )
        log.warning(
            "%s: connecting to NATS at %s without credentials (insecure): anyone who reaches it can "
            "write every key, start any process on any node and take the placement lease",
            service,
            url,
        )

    def _client_options(self) -> dict[str, Any]:
        """nats-py's connect arguments: servers, reconnects, callbacks, credentials, TLS."""
        options = self.options
        kwargs: dict[str, Any] = {
            # Several servers of one NATS cluster: "nats://a:4222,nats://b:4222".
            "servers": [u.strip() for u in self.url.split(",") if u.strip()],
            "name": self.service,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
            "drain_timeout": DRAIN_TIMEOUT_S,
            "ping_interval": PING_INTERVAL_S,
            "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
            "disconnected_cb": self._disconnected,
            "reconnected_cb": self._reconnected,
            "closed_cb": self._closed,
            "error_cb": self._error,
        }
        if options.creds_file:
            kwargs["user_credentials"] = options.creds_file
        if options.resolved_nkey():
            kwargs["nkeys_seed"] = options.resolved_nkey()
        if options.user:
            kwargs["user"] = options.user
            kwargs["password"] = options.password
        if options.token:
            kwargs["token"] = options.token
        public_key = self.identity.public_key
        inbox = options.inbox_prefix or (inbox_prefix(public_key) if public_key else "")
        if inbox:
            kwargs["inbox_prefix"] = inbox
        if options.tls_ca or options.tls_cert:
            ctx = ssl.create_default_context(cafile=options.tls_ca or None)
            if options.tls_cert:
                ctx.load_cert_chain(options.tls_cert, options.tls_key or None)
            kwargs["tls"] = ctx
        return kwargs

    # --- nats-py's callbacks -------------------------------------------------

    async def _disconnected(self) -> None:
        if self._opened:
            self.connected = False
            self.disconnected_since = time.monotonic()
            if self.closing:
                return
        log.warning("%s: disconnected from NATS at %s", self.service, self.url)

    async def _reconnected(self) -> None:
        log.warning("%s: reconnected to NATS at %s", self.service, self.url)
        if self._opened:
            self._refused_since = None
            self.reconnects += 1
            self.connected = True
            self.connected_since = time.monotonic()
            for forget in self.on_reconnect:
                forget()

    async def _closed(self) -> None:
        # Our own close sets `closing` first; any other close is the library's, for good:
        # a server's -ERR (maximum control line exceeded, authorization violation, user
        # authentication expired, ...), or reconnecting given up.
        if self._opened and not self.closing:
            self._lose(_lost_words(self.service, self.url, self.nc.last_error))

    async def _error(self, exc: Exception) -> None:
        nc = self.nc
        if nc.refused(exc):  # a permission refusal: logged and counted there
            return
        if not self._opened:
            self._errors.append(exc)
            del self._errors[:-8]
            if _authentication_refused(exc) or isinstance(exc, ssl.SSLError):
                # The server refused this identity, or TLS failed, at the first connection:
                # asking again cannot help, so this attempt is the last. (Once connected, a
                # lost server is retried forever, whatever it answers meanwhile.)
                nc.options["allow_reconnect"] = False
                return
        if self._opened and not self.connected:
            if _authentication_refused(exc):
                self._refused_reconnect(exc)
            return  # each failed reconnect of an outage: the disconnect was logged once
        if isinstance(exc, nats.errors.DrainTimeoutError):
            log.info(
                "%s: closing: a subscription still held messages nobody read after %g s; closed without them",
                self.service,
                DRAIN_TIMEOUT_S,
            )
            return
        log.warning("%s: NATS error: %s", self.service, exc)

    def _refused_reconnect(self, exc: BaseException) -> None:
        """The server refused this identity at a reconnect: said at the first refusal of an
        outage; once it has refused for REFUSED_RECONNECT_GRACE_S, the connection is lost."""
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
            log.error(
                "%s: NATS at %s refuses %s at reconnect: %s; check its entry in the server's auth.conf",
                self.service,
                self.url,
                self.identity,
                _said(exc),
            )
        elif now - self._refused_since >= REFUSED_RECONNECT_GRACE_S and not self.lost.is_set():
            self._lose(_lost_words(self.service, self.url, exc, REFUSED_RECONNECT_GRACE_S))

    # --- lost for good ---------------------------------------------------------

    def _lose(self, cause: str) -> None:
        if self.lost.is_set():
            return
        self.connected = False
        self.lost_cause = cause
        log.error("%s", cause)
        self.lost.set()

    def raise_if_final(self, exc: BaseException) -> None:
        """Raise what no retry can help: ConnectionLost once this connection can never work
        again (`transient` would call its `connection closed` worth a retry), and a subject
        refused before sending (SubjectTooLong) as itself."""
        if isinstance(exc, BusError) and not exc.retryable:
            raise exc
        if not self.lost.is_set() and self.nc.is_closed and not self.closing:
            # Closed, and its closed callback not run yet: the first to notice says it.
            self._lose(_lost_words(self.service, self.url, self.nc.last_error))
        if self.lost.is_set():
            raise ConnectionLost(self.lost_cause) from exc

    def check(self, subject: str) -> None:
        """Before a call: refuse a subject too long to send (see MAX_SUBJECT_BYTES), and any
        call on a connection that is lost (it would wait out its timeout first)."""
        check_subject(subject, MAX_SUBJECT_BYTES)
        if self.lost.is_set():
            raise ConnectionLost(self.lost_cause)

    async def close(self) -> None:
        """Drain and close; what was sent is delivered first."""
        self.closing = True
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except (nats.errors.Error, OSError):
                # A connection still reconnecting (or lost): nats-py's close flushes what was
                # buffered meanwhile into a socket that is gone, and raises; it is closed all
                # the same.
                with contextlib.suppress(nats.errors.Error, OSError):
                    await self.nc.close()


def _authentication_refused(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "authoriz" in text or "authentic" in text


def _refused_connection(
    url: str, service: str, identity: str, errors: list[Exception], exc: BaseException
) -> str:
    """One line: what refused whom, and what to do."""
    # The server's own refusal says more than the broken pipe that follows it.
    refusals = [e for e in errors if _authentication_refused(e)]
    tls = [e for e in [*errors, exc] if isinstance(e, ssl.SSLError)]
    cause: BaseException = refusals[0] if refusals else tls[0] if tls else errors[-1] if errors else exc
    if refusals:
        hint = (
            "the server does not accept this identity: check that its auth.conf lists the key "
            "(`llmgw auth init` and `llmgw auth add-node` write it) and that this is the right seed file"
        )
    elif tls:
        hint = (
            "TLS failed: set nats: tls_ca to the CA that signed the server's certificate, and tls_cert and "
            "tls_key where the server asks for client certificates"
        )
    else:
        hint = "is nats-server running there? Set LLMGW_NATS_URL (or nats: url) to its address"
    text = " ".join(f"{cause or type(cause).__name__}".split())
    return f"{service}: cannot connect to NATS at {url} as {identity}: {text}; {hint}"


def _said(exc: BaseException | None) -> str:
    """A server's or nats-py's error in plain words: `nats: 'Authorization Violation'` is
    `Authorization Violation`."""
    said = f"{exc or type(exc).__name__}" if exc is not None else "no reason given"
    return " ".join(said.removeprefix("nats: ").strip("'").split())


def _lost_words(service: str, url: str, cause: BaseException | None, refused_s: float = 0.0) -> str:
    """One line: why this connection can do nothing any more, and what to do."""
    text = _said(cause)
    if "control line" in text.lower():
        hint = (
            "the server refused a protocol line longer than its max_control_line; llmgw refuses such "
            "subjects before sending them, so this is a bug: report it with this service's log"
        )
    elif cause is not None and _authentication_refused(cause):
        hint = (
            "the server no longer accepts this identity (its key was rotated or removed, or its credentials "
            "expired): check its entry in the server's auth.conf; a new connection reads the seed file again"
        )
    else:
        hint = ""
    if refused_s:
        what = f"NATS at {url} refused every reconnect for {refused_s:g} s ({text})"
    else:
        what = f"NATS at {url} closed the connection for good ({text})"
    return f"{service}: {what}" + (f"; {hint}" if hint else "")
