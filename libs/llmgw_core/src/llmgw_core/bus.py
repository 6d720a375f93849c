"""The bus client every service uses: NATS JetStream with llmgw's rules built in.

- Connection: URL from `LLMGW_NATS_URL`, credentials, nkeys or TLS; reconnects
  forever, and each disconnect and reconnect is logged. A connection that NATS
  closed for good (see `Bus.lost`) is said once, and every call on it raises
  ConnectionLost: a service ends then, for its supervisor to start it again
  (`lifecycle.while_connected`).
- No subject or key longer than MAX_SUBJECT_BYTES is sent (SubjectTooLong): the
  server would close the connection for it.
- Streams and buckets are ensured idempotently at start.
- Every publish carries `Nats-Msg-Id` (deduplication) and W3C trace headers.
- A consumer never dies of a bad message: it is logged with subject and
  msgspec's path, counted, copied to `<prefix>.dlq.<service>` and terminated.
- A KV watch yields every key's current value first, then changes, and
  survives a server restart without missing an update.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import ssl
import time
import uuid
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Generic, TypeVar
from urllib.parse import urlsplit

import anyio
import anyio.abc
import msgspec
import nats
import nats.errors
import nats.js.errors
from msgspec import Meta
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from .access import (
    MAX_SUBJECT_BYTES,
    GuardedClient,
    Identity,
    PermissionDenied,
    check_subject,
    inbox_prefix,
    public_key_of,
)
from .errors import BusError, ConnectionLost, StoreFull
from .events import Heartbeat, decoder, encode
from .store import (
    BATCH_INCOMPLETE,
    BUCKETS,
    HISTORY,
    Episode,
    Refusal,
    StoreWatch,
    clock,
    space_refusal,
    stream_limits,
    total_bytes,
    unacknowledged,
    unstaged,
)
from .store import size as _size
from .subjects import ALL, DEFAULT_PREFIX, Names

log = logging.getLogger("llmgw.bus")
tracer = trace.get_tracer("llmgw.bus")

T = TypeVar("T", bound=msgspec.Struct)

DEFAULT_URL = "nats://127.0.0.1:4222"
KV_OPS_DELETE = ("DEL", "PURGE")
# A watch lets its caller's other tasks turn after this many messages taken in one run.
WATCH_TURN_EVERY = 64
# A server that refuses this identity at every reconnect for this long will refuse it for
# good: nats-py signs with the public key it read at the first connection, so a rotated
# seed file is only used by a new connection. (Shorter refusals happen: one member of a
# NATS cluster whose auth.conf was not reloaded yet.)
REFUSED_RECONNECT_GRACE_S = 10.0
# How long the server keeps a snapshot's consumer once nothing reads it (see `entries`).
SNAPSHOT_INACTIVE_S = 5.0


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


def _tracing() -> bool:
    """Whether spans go anywhere: a tracer provider was set (`telemetry.setup` sets one only
    when an OTLP endpoint is configured; tests set their own)."""
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _inject_trace(headers: dict[str, str]) -> None:
    """Add the current trace context's headers (`traceparent`, `tracestate`, baggage).
    An empty context (no span, no baggage) has nothing to propagate: asking every
    configured propagator to say so costs more than the rest of a publish's headers."""
    if otel_context.get_current():
        propagate.inject(headers)


# Messages in one atomic batch (nats-server takes up to 1,000).
ATOMIC_MAX = 500


@dataclass(frozen=True)
class _Write:
    subject: str
    data: bytes
    headers: dict[str, str]


@dataclass
class Writes:
    """KV puts, KV deletes and events queued for one `Bus.commit`."""

    items: list[_Write] = field(default_factory=list)

    def put(self, bucket: str, key: str, value: msgspec.Struct) -> None:
        self.items.append(_Write(Names.kv_subject(bucket, key), encode(value), {}))

    def delete(self, bucket: str, key: str) -> None:
        self.items.append(_Write(Names.kv_subject(bucket, key), b"", {"KV-Operation": "DEL"}))

    def publish(self, subject: str, msg: msgspec.Struct, *, traceparent: str = "") -> None:
        """An event; it carries `traceparent` (else the current span's context)."""
        headers: dict[str, str] = {}
        if traceparent:
            headers["traceparent"] = traceparent
        else:
            _inject_trace(headers)
        self.items.append(_Write(subject, encode(msg), headers))

    def __len__(self) -> int:
        return len(self.items)


class BusOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to reach NATS; the `nats:` section of agent.yaml and server.yaml."""

    url: str = ""
    prefix: str = DEFAULT_PREFIX
    creds_file: str = ""
    # The identity's nkey seed (`llmgw auth init` writes one per identity); LLMGW_NATS_NKEY otherwise.
    nkey_seed_file: str = ""
    user: str = ""
    password: str = ""
    token: str = ""
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # 1 on one machine, 3 on a NATS cluster.
    replicas: int = 1
    connect_timeout_s: float = 15.0
    events_max_age_s: float = 7 * 24 * 3600
    events_max_bytes: int = 256 << 20
    # Connecting without any credentials must be asked for (LLMGW_NATS_INSECURE=1 does the same).
    insecure: bool = False
    # Replies and deliveries come here; an nkey identity's default is `_INBOX.<public key>`,
    # the private inbox its permissions name.
    inbox_prefix: str = ""
    # What one cluster holds, to size every bucket's byte limit (`llmgw_core.store`;
    # docs/operations.md has the formula and what the NATS store must hold for them).
    max_nodes: Annotated[int, Meta(ge=1)] = 256
    # Shard specs in the cluster: replicas times ranks, over every deployment.
    max_shards: Annotated[int, Meta(ge=1)] = 2048
    # Deployments, and as many profiles.
    max_deployments: Annotated[int, Meta(ge=1)] = 512
    # The largest value one key may hold; a larger write is refused (nats-server's max_payload
    # bounds it too, 1 MiB by default).
    max_value_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20
    # A bucket's byte limit by its name without the prefix (`shard-status: 268435456`),
    # instead of the formula's.
    bucket_max_bytes: dict[str, Annotated[int, Meta(ge=1)]] = {}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.bucket_max_bytes) - set(BUCKETS))
        if unknown:
            raise ValueError(
                f"bucket_max_bytes names no bucket: {', '.join(unknown)} (the buckets: {', '.join(BUCKETS)})"
            )

    def resolved_url(self) -> str:
        return self.url or os.environ.get("LLMGW_NATS_URL", "") or DEFAULT_URL

    def resolved_nkey(self) -> str:
        return self.nkey_seed_file or os.environ.get("LLMGW_NATS_NKEY", "")

    def resolved_insecure(self) -> bool:
        return self.insecure or os.environ.get("LLMGW_NATS_INSECURE", "").lower() in ("1", "true", "yes")

    def authenticated(self) -> bool:
        """Whether this connection presents any credentials (a client certificate counts)."""
        url = urlsplit(self.resolved_url())
        return bool(
            self.creds_file
            or self.resolved_nkey()
            or self.user
            or self.token
            or self.tls_cert
            or url.username
        )

    def identity(self) -> Identity:
        nkey = self.resolved_nkey()
        if nkey:
            return Identity(Path(nkey).name.removesuffix(".nk"), public_key_of(nkey))
        if self.creds_file:
            return Identity(f"credentials {Path(self.creds_file).name}")
        user = self.user or urlsplit(self.resolved_url()).username
        if user:
            return Identity(f"user {user}")
        if self.token:
            return Identity("a token")
        if self.tls_cert:
            return Identity(f"client certificate {Path(self.tls_cert).name}")
        return Identity("no credentials")


@dataclass(frozen=True)
class KVChange(Generic[T]):
    """One key's value (None once deleted) at a bucket revision."""

    key: str
    value: T | None
    revision: int
    # Why the value at `revision` cannot be used (it did not decode; it was dead-lettered),
    # from a watch that asked for such changes; "" for a value or a delete.
    error: str = ""


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


class DecodeFailure(Exception):
    def __init__(self, subject: str, error: str) -> None:
        super().__init__(f"{subject}: {error}")
        self.subject = subject
        self.error = error


class Bus:
    def __init__(self, nc: Client, options: BusOptions, service: str) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.options = options
        self.names = Names(options.prefix)
        self.service = service
        self.decode_errors: Counter[str] = Counter()
        self.reconnects = 0
        self._kvs: dict[str, KeyValue] = {}
        # Message ids: a random prefix per client and a counter, as unique as a uuid4 per
        # message within the server's duplicate window, at a fraction of the cost.
        self._msg_ids = uuid.uuid4().hex
        self._msg_seq = itertools.count()
        # Per stream, whether it takes atomic batches (see `commit`).
        self._atomic: dict[str, bool] = {}
        self._reconnected = anyio.Event()
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
        # Each stream's limits, as `ensure` sets them, and whether writes are refused for space now.
        self.limits = stream_limits(options, self.names)
        self.store = StoreWatch()
        self._byte_limits: dict[str, int] = {}

    # --- connection ---------------------------------------------------------

    @classmethod
    async def connect(cls, options: BusOptions | None = None, *, service: str) -> Bus:
        options = options or BusOptions()
        url = options.resolved_url()
        identity = options.identity()
        if not options.authenticated():
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
        holder: list[Bus] = []

        async def on_disconnect() -> None:
            if holder:
                holder[0].connected = False
            if holder and holder[0].closing:
                return
            log.warning("%s: disconnected from NATS at %s", service, url)

        async def on_reconnect() -> None:
            log.warning("%s: reconnected to NATS at %s", service, url)
            if holder:
                holder[0]._on_reconnect()

        async def on_closed() -> None:
            # Our own close sets `closing` first; any other close is the library's, for good:
            # a server's -ERR (maximum control line exceeded, authorization violation, user
            # authentication expired, ...), or reconnecting given up.
            if holder and not holder[0].closing:
                holder[0]._lose(_lost_words(service, url, nc.last_error))

        errors: list[Exception] = []
        nc = GuardedClient(service, str(identity))
        connected = False

        async def on_error(exc: Exception) -> None:
            if nc.refused(exc):  # a permission refusal: logged and counted there
                return
            if not connected:
                # Kept only to explain a first connection that fails: an error holds its
                # traceback, and so the socket of the attempt that failed.
                errors.append(exc)
                del errors[:-8]
            if (_authentication_refused(exc) or isinstance(exc, ssl.SSLError)) and not connected:
                # The server refused this identity, or TLS failed, at the first connection:
                # asking again cannot help, so this attempt is the last. (Once connected, a
                # lost server is retried forever, whatever it answers meanwhile.)
                nc.options["allow_reconnect"] = False
                return
            if holder and not holder[0].connected:
                if _authentication_refused(exc):
                    holder[0]._refused_reconnect(exc, url, str(identity))
                return  # each failed reconnect of an outage: the disconnect was logged once
            log.warning("%s: NATS error: %s", service, exc)

        kwargs: dict[str, Any] = {
            # Several servers of one NATS cluster: "nats://a:4222,nats://b:4222".
            "servers": [u.strip() for u in url.split(",") if u.strip()],
            "name": service,
            "allow_reconnect": True,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": 5,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            "closed_cb": on_closed,
            "error_cb": on_error,
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
        inbox = options.inbox_prefix or (inbox_prefix(identity.public_key) if identity.public_key else "")
        if inbox:
            kwargs["inbox_prefix"] = inbox
        if options.tls_ca or options.tls_cert:
            ctx = ssl.create_default_context(cafile=options.tls_ca or None)
            if options.tls_cert:
                ctx.load_cert_chain(options.tls_cert, options.tls_key or None)
            kwargs["tls"] = ctx
        try:
            # Once connected, a lost server is retried forever; the first
            # connection is bounded, so a wrong address or password is an error
            # the operator sees, not a hang.
            with anyio.fail_after(options.connect_timeout_s):
                await nc.connect(**kwargs)
            connected = True
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            # Bounded: closing a connection whose TLS handshake failed can wait forever.
            with anyio.move_on_after(2, shield=True), contextlib.suppress(Exception):
                await nc.close()
            refused = any(_authentication_refused(e) or isinstance(e, ssl.SSLError) for e in [*errors, exc])
            raise BusError(
                _refused_connection(url, service, str(identity), errors, exc),
                # A refused identity stays refused; a server that is not up yet may come up.
                retryable=not refused,
            ) from exc
        bus = cls(nc, options, service)
        holder.append(bus)
        return bus

    def _on_reconnect(self) -> None:
        self._refused_since = None
        self.reconnects += 1
        self.connected = True
        self.connected_since = time.monotonic()
        self._kvs.clear()
        self._reconnected.set()
        self._reconnected = anyio.Event()

    def _refused_reconnect(self, exc: BaseException, url: str, identity: str) -> None:
        """The server refused this identity at a reconnect: said at the first refusal of an
        outage; once it has refused for REFUSED_RECONNECT_GRACE_S, the connection is lost."""
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
            log.error(
                "%s: NATS at %s refuses %s at reconnect: %s; check its entry in the server's auth.conf",
                self.service,
                url,
                identity,
                _said(exc),
            )
        elif now - self._refused_since >= REFUSED_RECONNECT_GRACE_S and not self.lost.is_set():
            self._lose(_lost_words(self.service, url, exc, REFUSED_RECONNECT_GRACE_S))

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
            self._lose(_lost_words(self.service, self.options.resolved_url(), self.nc.last_error))
        if self.lost.is_set():
            raise ConnectionLost(self.lost_cause) from exc

    def _check(self, subject: str) -> None:
        """Before a call: refuse a subject too long to send (see MAX_SUBJECT_BYTES), and any
        call on a connection that is lost (it would wait out its timeout first)."""
        check_subject(subject, MAX_SUBJECT_BYTES)
        if self.lost.is_set():
            raise ConnectionLost(self.lost_cause)

    # --- writes refused for space --------------------------------------------------

    def note_write(self, stream: str) -> None:
        """A write to `stream` landed: an episode of writes refused for space may be over (said
        once). Cheap while nothing is refused."""
        if self.store.episode is not None:
            self._said_stored(self.store.stored(stream))

    async def refusal(
        self, stream: str, what: str, exc: BaseException, *, unanswered: bool = False
    ) -> StoreFull | None:
        """The StoreFull that a failed write to `stream` is, if NATS refused it for space (the
        episode's start is said once); with `unanswered`, for a write that timed out at every
        try, also when nats-server answers everything but the write. None for any other fault."""
        if isinstance(exc, nats.js.errors.APIError):
            found = await self._space(stream, exc.err_code, exc.description or "")
        else:
            found = await self._space(stream, None, str(exc))
        if found is not None:
            return self._refused(stream, found, what)
        return await self._unanswered(stream, what, exc) if unanswered else None

    async def _space(self, stream: str, err_code: int | None, description: str) -> Refusal | None:
        refusal = space_refusal(err_code, description, stream=stream)
        if refusal is None or "maximum bytes" not in description.lower():
            return refusal
        # The bucket's own limit, as the server holds it (this client's configuration may differ).
        limit = self._byte_limits.get(stream)
        if limit is None:
            limit = 0
            with anyio.move_on_after(2), contextlib.suppress(nats.errors.Error, OSError):
                limit = (await self.js.stream_info(stream)).config.max_bytes or 0
            self._byte_limits[stream] = limit
        return space_refusal(err_code, description, stream=stream, limit=limit)

    def _refused(self, stream: str, refusal: Refusal, what: str) -> StoreFull:
        started = self.store.episode is None
        if self.store.refused(stream, refusal, time.time()):
            # A warning, as an outage of NATS is: the service goes on, and says when it stores again.
            if started:
                log.warning(
                    "%s: %s; free space in NATS's store or raise the limit (docs/operations.md)",
                    self.service,
                    self.store.banner(),
                )
            else:
                log.warning("%s: %s", self.service, self.store.banner())
        return StoreFull(
            f"{what} refused: NATS store full: {refusal.reason}", stream=stream, banner=self.store.banner()
        )

    def _said_stored(self, ended: Episode | None) -> None:
        if ended is not None:
            log.warning(
                "%s: NATS stores again: writes work after %.0f s (%d refused since %s)",
                self.service,
                time.time() - ended.since,
                ended.refused,
                clock(ended.since),
            )

    async def _unanswered(self, stream: str, what: str, exc: BaseException) -> StoreFull | None:
        """A write that timed out at every try, while nats-server answers a question about its
        stream at once: the stream is not storing (a disk that filled stops it until nats-server
        restarts). None when the server does not answer either (an outage, said as one)."""
        if not isinstance(exc, nats.errors.TimeoutError | TimeoutError) or not self.connected:
            return None
        with anyio.move_on_after(2):
            try:
                await self.js.stream_info(stream)
            except (nats.errors.Error, OSError):
                return None
            return self._refused(stream, unacknowledged(stream), what)
        return None

    async def close(self) -> None:
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

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.close()

    # --- streams and buckets -----------------------------------------------

    async def ensure(self) -> None:
        """Create or update the events and DLQ streams and every bucket, with their limits
        (`llmgw_core.store`); safe to repeat.

        The events and DLQ streams take this configuration's limits as they are (they drop
        their oldest messages at the limit). A bucket's limits are only ever raised to what
        this configuration asks, never lowered: a bucket refuses new values at its limit, so
        lowering one below what it holds would leave it refusing every new key, and a node
        agent and placement whose `nats:` sections differ would undo each other at every
        start. Lower one by hand (docs/operations.md).
        """
        o = self.options
        events, dlq = self.names.events_stream, self.names.dlq_stream
        streams = (
            api.StreamConfig(
                name=events,
                subjects=[self.names.events_all],
                storage=api.StorageType.FILE,
                max_age=o.events_max_age_s,
                max_bytes=self.limits[events].max_bytes,
                num_replicas=o.replicas,
                duplicate_window=120,
                # Many events of one control step are written as one atomic batch (see `commit`).
                allow_atomic=True,
            ),
            api.StreamConfig(
                name=dlq,
                subjects=[self.names.dlq_all],
                storage=api.StorageType.FILE,
                max_age=o.events_max_age_s,
                max_bytes=self.limits[dlq].max_bytes,
                num_replicas=o.replicas,
            ),
        )
        stream = ""
        try:
            for cfg in streams:
                stream = cfg.name or ""
                try:
                    info = await self.js.add_stream(cfg)
                except nats.js.errors.BadRequestError:
                    info = await self.js.update_stream(cfg)
                self._atomic[stream] = bool(info.config.allow_atomic)
                self._created(stream)
            for bucket in self.names.buckets():
                stream = f"KV_{bucket}"
                await self._ensure_bucket(bucket)
                await self._raise_limits(stream)
                await self._allow_atomic(stream)
                self._created(stream)
        except nats.errors.Error as exc:
            self.raise_if_final(exc)
            full = await self.refusal(
                stream, f"creating {stream} ({_size(self.limits[stream].max_bytes)})", exc
            )
            if full is not None:
                raise StoreFull(
                    f"{full}; llmgw's streams need {_size(total_bytes(o, self.names))} in all on each NATS "
                    "server that holds them: give its JetStream store more room (jetstream "
                    "{ max_file_store }, a larger disk) or size llmgw for a smaller cluster "
                    "(nats: max_nodes, max_shards, max_deployments, events_max_bytes; docs/operations.md)",
                    stream=full.stream,
                    banner=full.banner,
                ) from exc
            raise BusError(f"cannot create llmgw's streams and buckets: {exc}") from exc

    def _created(self, stream: str) -> None:
        """`stream` exists with its limits: a refusal to create it (its limit did not fit) is over."""
        if self.store.episode is not None:
            self._said_stored(self.store.stored(stream, written=False))

    async def _raise_limits(self, stream: str) -> None:
        """Raise a bucket's byte and value-size limits to this configuration's (see `ensure`); a
        bucket without limits (made by an older llmgw) gets them, unless it holds more already."""
        info = await self.js.stream_info(stream)
        config = info.config
        want = self.limits[stream]
        changed = False
        held = info.state.bytes
        current = config.max_bytes if config.max_bytes is not None else -1
        if current < 0 and held > want.max_bytes:
            log.warning(
                "%s: %s holds %s, over the %s this configuration sizes it for: it stays without a "
                "byte limit; raise nats: max_nodes, max_shards or max_deployments (docs/operations.md)",
                self.service,
                stream,
                _size(held),
                _size(want.max_bytes),
            )
        elif current < want.max_bytes:
            config.max_bytes = want.max_bytes
            changed = True
        largest = config.max_msg_size if config.max_msg_size is not None else -1
        if want.max_msg_size > 0 and largest < want.max_msg_size:  # -1 (none) included
            config.max_msg_size = want.max_msg_size
            changed = True
        if changed:
            await self.js.update_stream(config)

    async def _allow_atomic(self, stream: str) -> None:
        """Let a bucket's stream take atomic batches, where the server knows them (2.12+);
        an older server leaves the flag unset and `commit` writes one by one."""
        config = (await self.js.stream_info(stream)).config
        if not config.allow_atomic:
            config.allow_atomic = True
            try:
                config = (await self.js.update_stream(config)).config
            except nats.js.errors.BadRequestError as exc:
                log.info("%s takes no atomic batches (%s): writes go one by one", stream, exc)
                config.allow_atomic = False
        self._atomic[stream] = bool(config.allow_atomic)

    async def _ensure_bucket(self, bucket: str) -> KeyValue:
        try:
            kv = await self.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            limits = self.limits[f"KV_{bucket}"]
            try:
                kv = await self.js.create_key_value(
                    api.KeyValueConfig(
                        bucket=bucket,
                        history=HISTORY,
                        storage=api.StorageType.FILE,
                        replicas=self.options.replicas,
                        max_bytes=limits.max_bytes,
                        max_value_size=limits.max_msg_size,
                    )
                )
            except nats.js.errors.BadRequestError:
                # Another process created it in the meantime, with settings of its own
                # (`allow_atomic`): "already in use with a different configuration". Use it.
                kv = await self.js.key_value(bucket)
        self._kvs[bucket] = kv
        return kv

    async def kv(self, bucket: str) -> KeyValue:
        kv = self._kvs.get(bucket)
        if kv is None:
            try:
                try:
                    kv = await self.js.key_value(bucket)
                except nats.js.errors.BucketNotFoundError:
                    kv = await self._ensure_bucket(bucket)
            except PermissionDenied:
                raise  # a refusal of this identity, said as such (see `watch`)
            except (nats.errors.Error, OSError) as exc:
                self.raise_if_final(exc)
                raise BusError(f"cannot open bucket {bucket}: {exc or type(exc).__name__}") from exc
            self._kvs[bucket] = kv
        return kv

    # --- publishing ---------------------------------------------------------

    def _headers(self, msg_id: str | None) -> dict[str, str]:
        headers = {"Nats-Msg-Id": msg_id or f"{self._msg_ids}{next(self._msg_seq):x}"}
        _inject_trace(headers)
        return headers

    async def publish(self, subject: str, msg: msgspec.Struct, *, msg_id: str | None = None) -> int:
        """Publish an event to JetStream; returns its sequence (a duplicate gets the first's)."""
        self._check(subject)
        data = encode(msg)
        if not _tracing():
            # Nothing would record a span of this publish: skip making one (it costs more
            # than the rest of llmgw's side), but still pass on the current trace.
            return await self._publish(subject, data, self._headers(msg_id))
        with tracer.start_as_current_span(
            f"publish {subject}",
            kind=trace.SpanKind.PRODUCER,
            attributes=_messaging(subject, "publish", data),
        ):
            return await self._publish(subject, data, self._headers(msg_id))

    async def _publish(self, subject: str, data: bytes, headers: dict[str, str]) -> int:
        # One message id for every try: a retried publish that did land is stored once.
        stream = self._stream_of(subject)
        attempt = 1
        while True:
            try:
                ack = await self.js.publish(subject, data, headers=headers)
            except (nats.errors.Error, OSError) as exc:
                self.raise_if_final(exc)
                what = f"publish to {subject}"
                last = attempt == 3 or not transient(exc)
                full = await self.refusal(stream, what, exc, unanswered=attempt == 3)
                if full is not None:
                    raise full from exc
                if last:
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                self.note_write(stream)
                return ack.seq
            await anyio.sleep(0.2 * attempt)
            attempt += 1

    async def publish_core(self, subject: str, msg: msgspec.Struct) -> None:
        """Plain NATS publish, for liveness: nothing is stored."""
        self._check(subject)
        try:
            await self.nc.publish(subject, encode(msg), headers=self._headers(None))
        except (nats.errors.Error, OSError) as exc:
            self.raise_if_final(exc)
            raise BusError(f"publish to {subject} failed: {exc or type(exc).__name__}") from exc

    async def heartbeat(
        self, node: str, service: str, interval: float, beat: Callable[[], Heartbeat] | None = None
    ) -> None:
        """Publish `<prefix>.heartbeat.<node>.<service>` every `interval` until cancelled. Raises
        only ConnectionLost: beating on a connection that NATS closed for good cannot succeed.

        Each beat is `beat()`, by default one that names this process (`claims.Claimant`)."""
        from .claims import Claimant

        if beat is None:
            claimant = Claimant.here()

            def beat() -> Heartbeat:
                return claimant.beat(node, service)

        subject = self.names.heartbeat(node, service)
        # Beats keep to a fixed schedule: the time a beat takes to send, or a late wake,
        # shortens the next wait instead of adding to every gap after it. A schedule
        # missed by more than a whole interval (a suspended process) restarts from now
        # rather than sending the missed beats in a burst.
        due = time.monotonic()
        while True:
            try:
                await self.publish_core(subject, beat())
            except ConnectionLost:
                raise
            except Exception as exc:  # liveness must never take a service down
                log.warning("%s: heartbeat failed: %s", service, exc)
            due += interval
            wait = due - time.monotonic()
            if wait < -interval:
                due, wait = time.monotonic(), 0.0
            await anyio.sleep(max(0.0, wait))

    async def _kv_call(
        self, what: str, bucket: str, call: Callable[[KeyValue], Awaitable[Any]], *, write: bool = False
    ) -> Any:
        """One KV operation, retried while the failure is transient (a write is idempotent:
        the same value again, or a compare-and-set that fails loudly if it already landed).
        A write refused for space raises StoreFull at once: trying again cannot help yet."""
        attempts = 3
        stream = f"KV_{bucket}"
        for attempt in range(1, attempts + 1):
            try:
                result = await call(await self.kv(bucket))
            except BusError as exc:  # SubjectTooLong and ConnectionLost are not retryable
                if attempt == attempts or not exc.retryable:
                    raise
            except (nats.errors.Error, OSError) as exc:
                self.raise_if_final(exc)
                # Answers, not faults: the caller says what each one means.
                if isinstance(
                    exc,
                    nats.js.errors.NotFoundError
                    | nats.js.errors.KeyWrongLastSequenceError
                    | nats.js.errors.NoKeysError,
                ):
                    raise
                full = (
                    await self.refusal(stream, what, exc, unanswered=attempt == attempts) if write else None
                )
                if full is not None:
                    raise full from exc
                if attempt == attempts or not transient(exc):
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                if write:
                    self.note_write(stream)
                return result
            await anyio.sleep(0.2 * attempt)
        raise AssertionError("unreachable")

    async def put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        """Write a key; a put is idempotent, so a timed-out one (lost in a reconnect) is retried."""
        self._check(Names.kv_subject(bucket, key))
        data = encode(value)
        return int(
            await self._kv_call(f"write {bucket}/{key}", bucket, lambda kv: kv.put(key, data), write=True)
        )

    async def create(self, bucket: str, key: str, value: msgspec.Struct) -> int | None:
        """Write a key only if it has no value; None if it has one."""
        self._check(Names.kv_subject(bucket, key))
        data = encode(value)
        try:
            return int(
                await self._kv_call(
                    f"create {bucket}/{key}", bucket, lambda kv: kv.create(key, data), write=True
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update(self, bucket: str, key: str, value: msgspec.Struct, *, last: int) -> int | None:
        """Compare-and-set: write only if the key is still at revision `last`; None if it moved."""
        self._check(Names.kv_subject(bucket, key))
        data = encode(value)
        try:
            return int(
                await self._kv_call(
                    f"update {bucket}/{key}", bucket, lambda kv: kv.update(key, data, last=last), write=True
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def get(self, bucket: str, key: str, kind: type[T]) -> tuple[T, int] | None:
        self._check(Names.kv_subject(bucket, key))
        try:
            entry = await self._kv_call(f"read {bucket}/{key}", bucket, lambda kv: kv.get(key))
        except nats.js.errors.NotFoundError:  # never written, or deleted
            return None
        if entry.value is None or entry.operation in KV_OPS_DELETE:
            return None
        return decoder(kind).decode(entry.value), int(entry.revision or 0)

    async def revisions(self, bucket: str, key: str) -> list[tuple[int, bytes | None]]:
        """Every revision of `key` the bucket still holds (its `history` setting), newest first:
        (revision, value), the value None for a delete or purge."""
        try:
            with anyio.fail_after(30):
                entries = await self._kv_call(
                    f"read the history of {bucket}/{key}", bucket, lambda kv: kv.history(key)
                )
        except nats.js.errors.NoKeysError:  # never written, or purged
            return []
        except TimeoutError as exc:
            raise BusError(f"reading the history of {bucket}/{key} took over 30 s") from exc
        return sorted(
            (
                (int(e.revision or 0), None if e.operation in KV_OPS_DELETE else (e.value or b""))
                for e in entries
            ),
            key=lambda entry: entry[0],
            reverse=True,
        )

    async def delete(self, bucket: str, key: str) -> None:
        # A key longer than the bus would write can still have been stored by a raw client;
        # deleting it is one plain publish (no JetStream API subject wraps it), so only the
        # client's own protocol-line guard applies: the key can always be removed.
        if self.lost.is_set():
            raise ConnectionLost(self.lost_cause)
        try:
            await self._kv_call(f"delete {bucket}/{key}", bucket, lambda kv: kv.delete(key), write=True)
        except nats.js.errors.NotFoundError:
            return

    # --- many writes at once -------------------------------------------------

    def _stream_of(self, subject: str) -> str:
        if subject.startswith("$KV."):
            return f"KV_{subject.split('.', 2)[1]}"
        return self.names.events_stream

    async def _atomic_allowed(self, stream: str) -> bool:
        """Whether `stream` takes atomic batches (nats-server 2.12 and later, with the stream's
        allow_atomic set by `ensure`); asked once per stream."""
        found = self._atomic.get(stream)
        if found is None:
            try:
                info = await self.js.stream_info(stream)
                found = bool(info.config.allow_atomic)
            except (nats.errors.Error, OSError):
                found = False
            self._atomic[stream] = found
        return found

    async def commit(self, writes: Writes) -> None:
        """Write every queued put, delete and event: one atomic batch per stream and up to
        ATOMIC_MAX messages where the server allows it (one commit, not one per message),
        else pipelined one by one. Streams are written in the order they were first queued.
        Raises BusError when a write did not land; what an atomic batch held is then not
        written at all, and a retry writes it whole. A subject too long to send refuses the
        whole commit before anything is written."""
        for w in writes.items:
            self._check(w.subject)
        by_stream: dict[str, list[_Write]] = {}
        for w in writes.items:
            by_stream.setdefault(self._stream_of(w.subject), []).append(w)
        for stream, items in by_stream.items():
            subjects = {w.subject for w in items}
            attributes: dict[str, str | int] = {
                "messaging.system": "nats",
                "messaging.destination.name": subjects.pop() if len(subjects) == 1 else stream,
                "messaging.operation.type": "send",
                "messaging.operation.name": "commit",
                "messaging.batch.message_count": len(items),
            }
            with tracer.start_as_current_span(
                f"commit {len(items)} to {stream}", kind=trace.SpanKind.PRODUCER, attributes=attributes
            ):
                if await self._atomic_allowed(stream):
                    for start in range(0, len(items), ATOMIC_MAX):
                        await self._atomic_batch(stream, items[start : start + ATOMIC_MAX])
                else:
                    await self._pipelined(items)

    async def _atomic_batch(self, stream: str, items: list[_Write]) -> None:
        attempts = 3
        what = (
            f"a batch of {len(items)} writes to {stream}"
            if len(items) > 1
            else f"a write to {items[0].subject}"
        )
        for attempt in range(1, attempts + 1):
            batch = uuid.uuid4().hex[:20]
            try:
                for i, w in enumerate(items[:-1], start=1):
                    headers = {**w.headers, "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
                    await self.nc.publish(w.subject, w.data, headers=headers)
                last = items[-1]
                headers = {
                    **last.headers,
                    "Nats-Batch-Id": batch,
                    "Nats-Batch-Sequence": str(len(items)),
                    "Nats-Batch-Commit": "1",
                }
                reply = await self.nc.request(last.subject, last.data, headers=headers, timeout=10)
            except (nats.errors.Error, OSError) as exc:
                self.raise_if_final(exc)
                full = await self.refusal(stream, what, exc, unanswered=attempt == attempts)
                if full is not None:
                    raise full from exc
                if attempt == attempts or not transient(exc):
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                error = msgspec.json.decode(reply.data).get("error") if reply.data else None
                if not error:
                    self.note_write(stream)
                    return
                code, description = error.get("err_code"), str(error.get("description", ""))
                refusal = await self._space(stream, code, description)
                if refusal is None and code == BATCH_INCOMPLETE and (attempt == attempts or len(items) == 1):
                    # A batch whose every message was sent, or a batch of one, that nats-server
                    # calls incomplete: it could not stage it (on its store's disk).
                    refusal = unstaged(description, code)
                if refusal is not None:
                    raise self._refused(stream, refusal, what)
                if attempt == attempts or (error.get("code") not in (503, 504) and code != BATCH_INCOMPLETE):
                    raise BusError(f"{what} was refused: {description or error} (error {code or '?'})")
            await anyio.sleep(0.2 * attempt)

    async def _pipelined(self, items: list[_Write]) -> None:
        """One write at a time on the wire, many in flight: for servers without atomic batches."""
        failures: list[BaseException] = []
        limiter = anyio.CapacityLimiter(64)

        async def one(w: _Write) -> None:
            stream = self._stream_of(w.subject)
            async with limiter:
                for attempt in range(1, 4):
                    try:
                        await self.js.publish(w.subject, w.data, headers=w.headers or None)
                    except (nats.errors.Error, OSError) as exc:
                        full = await self.refusal(stream, f"a write to {w.subject}", exc)
                        if full is not None or attempt == 3 or not transient(exc):
                            failures.append(full or exc)
                            return
                    else:
                        self.note_write(stream)
                        return
                    await anyio.sleep(0.2 * attempt)

        async with anyio.create_task_group() as tg:
            for w in items:
                tg.start_soon(one, w)
        if failures:
            self.raise_if_final(failures[0])
            full = next((f for f in failures if isinstance(f, StoreFull)), None)
            first = full or failures[0]
            text = f"{len(failures)} of {len(items)} writes failed: {first or type(first).__name__}"
            if full is not None:
                raise StoreFull(text, stream=full.stream, banner=full.banner)
            raise BusError(text)

    async def keys(self, bucket: str) -> set[str]:
        """Every key that holds a value now (the values are not read)."""
        try:
            return set(await self._kv_call(f"list {bucket}", bucket, lambda kv: kv.keys()))
        except nats.js.errors.NoKeysError:
            return set()

    async def entries(self, bucket: str, kind: type[T], keys: str = ALL) -> dict[str, KVChange[T]]:
        """A snapshot of every key's current value (bad values are skipped, and counted).

        Each key's last message is only collected as it arrives, and decoded once all are
        in: through `watch`, every key costs a queue hop and a timed wait, which made
        `llmgw ctl get nodes` take seconds at 10,000 nodes. A reconnect meanwhile reads again.
        """
        self._check(Names.kv_subject(bucket, keys))
        try:
            with anyio.fail_after(30):
                while True:
                    try:
                        found = await self._last_messages(bucket, keys)
                    except PermissionDenied as exc:  # a configuration error: retrying cannot help
                        raise BusError(f"{self.service}: cannot read {bucket} {keys}: {exc}") from exc
                    except (nats.errors.Error, OSError, BusError) as exc:
                        self.raise_if_final(exc)
                        log.warning("%s: cannot read %s yet: %s", self.service, bucket, exc)
                        await anyio.sleep(0.5)
                        continue
                    if found is not None:
                        break
        except TimeoutError as exc:
            raise BusError(f"reading {bucket} took over 30 s; is NATS reachable?") from exc
        out: dict[str, KVChange[T]] = {}
        for key, (revision, data) in found.items():
            value = await self._kv_value(bucket, key, data, kind)
            if value is not None:
                out[key] = KVChange(key, value, revision)
        return out

    async def _last_messages(self, bucket: str, keys: str) -> dict[str, tuple[int, bytes]] | None:
        """Each key's last value and revision, deleted keys left out, read by one ordered
        consumer; None when the connection was replaced meanwhile."""
        await self.kv(bucket)  # the bucket exists, and this identity may read it
        prefix = Names.kv_subject(bucket, "")
        found: dict[str, tuple[int, bytes]] = {}
        done = anyio.Event()

        async def on_msg(msg: Msg) -> None:
            meta = msg.metadata
            key = msg.subject[len(prefix) :]
            deleted = _deletes(msg.headers)
            if deleted:
                found.pop(key, None)
            elif deleted is not None:
                found[key] = (meta.sequence.stream, msg.data)
            if meta.num_pending == 0:
                done.set()

        epoch = self.reconnects
        # A snapshot's consumer goes with it: an unsubscribed consumer lingers on the server for
        # its inactive threshold, and nats-server takes 1,000 consumers per stream, so a reader
        # polling every few tenths of a second (a script around `llmgw ctl get`) left every
        # reader of the bucket, placement included, refused (`maximum consumers limit reached`).
        sub = await self._last_per_key(bucket, keys, on_msg, inactive_threshold=SNAPSHOT_INACTIVE_S)
        try:
            info = await sub.consumer_info()
            # Nothing left and nothing ever sent, by the server's count: an empty bucket, or
            # no key matches. (What this client has taken so far is no measure: on a busy
            # machine the server may have sent every key before the first is taken.)
            if info.num_pending == 0 and (info.delivered is None or info.delivered.consumer_seq == 0):
                done.set()
            while not done.is_set():
                with anyio.move_on_after(1.0):
                    await done.wait()
                if self.reconnects != epoch:
                    return None
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
        return found

    async def _last_per_key(
        self,
        bucket: str,
        keys: str,
        on_msg: Callable[[Msg], Awaitable[None]],
        *,
        inactive_threshold: float = 300,
    ) -> JetStreamContext.PushSubscription:
        """An ordered consumer of `bucket`'s keys matching `keys`: each key's last message, then
        every new one, to `on_msg`."""
        return await self.js.subscribe(
            Names.kv_subject(bucket, keys),
            stream=f"KV_{bucket}",
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold=inactive_threshold,
        )

    async def _kv_value(self, bucket: str, key: str, data: bytes, kind: type[T]) -> T | None:
        """A key's value, or None (dead-lettered) when it is empty or does not decode."""
        value = await self._kv_decoded(bucket, key, data, kind)
        return None if isinstance(value, str) else value

    async def _kv_decoded(self, bucket: str, key: str, data: bytes, kind: type[T]) -> T | str:
        """A key's value, or why it cannot be used (dead-lettered): empty, or it does not decode."""
        if not data:
            # Only a KV delete (its KV-Operation header) removes a key: an empty
            # value put by mistake must not stop an engine or drop a deployment.
            error = "an empty value is not a delete (use a KV delete); the key keeps its last value"
            await self.dead_letter(Names.kv_subject(bucket, key), b"", error)
            return error
        try:
            return self._decode(kind, Names.kv_subject(bucket, key), data)
        except DecodeFailure as exc:
            await self.dead_letter(exc.subject, data, exc.error)
            return exc.error

    async def history(self, subject: str, kind: type[T], *, idle_s: float = 1.0) -> list[T]:
        """Every event on `subject` (wildcards allowed) still in the events stream, oldest first:
        read until none has come for `idle_s`. Values that do not decode are skipped."""
        self._check(subject)
        dec = decoder(kind)
        out: list[T] = []
        try:
            sub = await self.js.subscribe(subject, stream=self.names.events_stream, ordered_consumer=True)
        except (nats.errors.Error, OSError) as exc:
            self.raise_if_final(exc)
            raise BusError(f"cannot read {subject}: {exc or type(exc).__name__}") from exc
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=idle_s)
                except nats.errors.TimeoutError:
                    return out
                with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
                    out.append(dec.decode(msg.data))
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()

    # --- bad messages ---------------------------------------------------------

    async def dead_letter(self, subject: str, data: bytes, error: str) -> None:
        """Count a message that could not be handled and copy it to the service's DLQ."""
        self.decode_errors[subject] += 1
        log.error(
            "%s: bad message on %s: %s (copied to %s)",
            self.service,
            subject,
            error,
            self.names.dlq(self.service),
        )
        headers = {"Llmgw-Subject": subject, "Llmgw-Error": error[:1024]}
        try:
            await self.js.publish(self.names.dlq(self.service), data, headers=headers)
        except nats.errors.Error as exc:
            full = await self.refusal(self.names.dlq_stream, "copying a bad message to the DLQ", exc)
            log.error("%s: could not copy the bad message to the DLQ: %s", self.service, full or exc)
        else:
            self.note_write(self.names.dlq_stream)

    def _decode(self, kind: type[T], subject: str, data: bytes) -> T:
        try:
            return decoder(kind).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeFailure(subject, str(exc)) from exc

    # --- consuming ------------------------------------------------------------

    async def consume(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        *,
        durable: str,
        stream: str | None = None,
        max_deliver: int = 5,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle each message on a JetStream subject (durable pull consumer) until cancelled.

        A message that does not decode goes to the DLQ and is terminated; one
        whose handler raises is redelivered with a delay, and after
        `max_deliver` tries goes to the DLQ too.
        """
        self._check(subject)
        cfg = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, max_deliver=max_deliver, ack_wait=30)
        sub = await self.js.pull_subscribe(
            subject, durable=durable, stream=stream or self.names.events_stream, config=cfg
        )
        task_status.started()
        try:
            while True:
                try:
                    msgs = await sub.fetch(batch=64, timeout=1)
                except nats.errors.TimeoutError:
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError) as exc:
                    self.raise_if_final(exc)
                    await anyio.sleep(0.2)
                    continue
                for msg in msgs:
                    await self._handle(msg, kind, handler, max_deliver)
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def _handle(
        self,
        msg: Msg,
        kind: type[T],
        handler: Callable[[T, Msg], Awaitable[None]],
        max_deliver: int,
    ) -> None:
        try:
            value = self._decode(kind, msg.subject, msg.data)
        except DecodeFailure as exc:
            await self.dead_letter(msg.subject, msg.data, exc.error)
            await msg.term()
            return
        ctx = propagate.extract(dict(msg.headers or {}))
        token = otel_context.attach(ctx)
        try:
            with tracer.start_as_current_span(
                f"handle {msg.subject}",
                kind=trace.SpanKind.CONSUMER,
                attributes=_messaging(msg.subject, "process", msg.data),
            ):
                await handler(value, msg)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            delivered = msg.metadata.num_delivered if msg.metadata else 1
            if delivered >= max_deliver:
                await self.dead_letter(msg.subject, msg.data, f"handler failed {delivered} times: {exc}")
                await msg.term()
            else:
                log.warning(
                    "%s: handler for %s failed (try %d of %d): %s",
                    self.service,
                    msg.subject,
                    delivered,
                    max_deliver,
                    exc,
                )
                await msg.nak(delay=min(30.0, 0.5 * 2**delivered))
            return
        finally:
            otel_context.detach(token)
        await msg.ack()

    async def subscribe_core(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, str], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Handle plain NATS messages (heartbeats) until cancelled; bad ones go to the DLQ.

        The handler runs in the subscription's own callback, one message at a
        time, with no queue of llmgw's in between: a heartbeat handler only
        records a time, and a queue that a burst overflows would turn a busy
        judge into a cluster of "lost" nodes.
        """
        self._check(subject)
        dec = decoder(kind)

        async def on_msg(msg: Msg) -> None:
            try:
                value = dec.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                await self.dead_letter(msg.subject, msg.data, str(exc))
                return
            try:
                await handler(value, msg.subject)
            except Exception as exc:  # a handler's fault costs that message, never the subscription
                log.exception("%s: handler for %s failed: %s", self.service, msg.subject, exc)

        try:
            sub = await self.nc.subscribe(subject, cb=on_msg)
        except (nats.errors.Error, OSError) as exc:
            self.raise_if_final(exc)
            raise BusError(f"cannot subscribe to {subject}: {exc or type(exc).__name__}") from exc
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                with contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def watch(
        self, bucket: str, kind: type[T], keys: str = ALL, *, undecodable: bool = False
    ) -> AsyncIterator[KVChange[T]]:
        """Every key's current value first, then each change, for as long as the caller iterates.

        After a reconnect (a restarted server, a network cut) the watch is
        opened again and every key whose revision moved past what was already
        yielded comes out, deletes included, so nothing written while away is
        missed. A value that does not decode goes to the DLQ and is skipped;
        with `undecodable` it comes out too, as a change with no value and its
        `error`, so that the caller can keep the key's last good value.

        Messages that arrived together come out together, with no turn of the
        event loop between them: the ordered consumer's callback only puts each
        in an inbox, and a change is yielded straight from it. nats-py's own
        `KeyValue.watch` (like `next_msg`) costs a task and a timed wait per
        message, one turn of the loop or more each; with fifty engines starting
        on two cores a turn takes a tenth of a second and more, and fifty shard
        specs that reached a launcher at once came out of its watch over 9 s.
        A caller that wants the same should not wait on the loop per change either.
        After every WATCH_TURN_EVERY messages the loop turns once, so that a long run
        (thousands of shard statuses) does not hold the caller's other tasks back.
        """
        self._check(Names.kv_subject(bucket, keys))
        prefix = Names.kv_subject(bucket, "")
        seen: dict[str, int] = {}
        taken = 0
        while True:
            epoch = self.reconnects
            inbox: deque[Msg] = deque()
            arrived = [anyio.Event()]

            async def on_msg(
                msg: Msg, inbox: deque[Msg] = inbox, arrived: list[anyio.Event] = arrived
            ) -> None:
                inbox.append(msg)
                arrived[0].set()

            try:
                await self.kv(bucket)  # the bucket exists, and this identity may read it
                sub = await self._last_per_key(bucket, keys, on_msg)
            except PermissionDenied as exc:  # a configuration error: retrying cannot help
                raise BusError(f"{self.service}: cannot watch {bucket} {keys}: {exc}") from exc
            except (nats.errors.Error, OSError, BusError) as exc:
                self.raise_if_final(exc)
                log.warning("%s: cannot watch %s yet: %s", self.service, bucket, exc)
                await anyio.sleep(0.5)
                continue
            try:
                while True:
                    if not inbox:
                        arrived[0] = anyio.Event()
                        with anyio.move_on_after(1.0):
                            await arrived[0].wait()
                        if not inbox:
                            if self.reconnects != epoch:
                                break  # open it again: what changed meanwhile comes out then
                            continue
                    msg = inbox.popleft()
                    taken += 1
                    if taken % WATCH_TURN_EVERY == 0:
                        # A long run of messages still lets the caller's other tasks turn.
                        await anyio.lowlevel.checkpoint()
                    key = msg.subject[len(prefix) :]
                    rev = msg.metadata.sequence.stream
                    if rev <= seen.get(key, 0):
                        continue
                    seen[key] = rev
                    deleted = _deletes(msg.headers)
                    if deleted is None:
                        continue  # a marker of a kind this client does not know
                    if deleted:
                        yield KVChange(key, None, rev)
                        continue
                    value = await self._kv_decoded(bucket, key, msg.data or b"", kind)
                    if not isinstance(value, str):
                        yield KVChange(key, value, rev)
                    elif undecodable:
                        yield KVChange(key, None, rev, error=value)
            finally:
                with anyio.CancelScope(shield=True):
                    with contextlib.suppress(nats.errors.Error, OSError):
                        await sub.unsubscribe()


def _deletes(headers: dict[str, str] | None) -> bool | None:
    """Whether a KV message deletes its key (a KV delete or purge, or a server's marker of
    one); None for a marker of a kind this client does not know, which is skipped, as
    nats-py's own watch does."""
    if not headers:
        return False
    operation = headers.get("KV-Operation")
    if operation is not None:
        return operation in KV_OPS_DELETE
    reason = headers.get("Nats-Marker-Reason")
    if reason is None:
        return False
    return True if reason in ("MaxAge", "Purge", "Remove") else None


def _messaging(subject: str, operation: str, data: bytes) -> dict[str, str | int]:
    """OpenTelemetry's messaging attributes for a span that sends or handles one NATS message."""
    return {
        "messaging.system": "nats",
        "messaging.destination.name": subject,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.message.body.size": len(data),
    }
