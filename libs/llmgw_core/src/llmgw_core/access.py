"""Who may do what on the bus: llmgw's identities, their nats-server permissions,
and the client's side of a refusal.

Each process connects with an identity (an nkey; `llmgw auth init` makes them)
whose rights nats-server itself enforces, subject by subject:

    placement   writes shard specs, replicas, the lease and the desired engines;
                seeds the catalog and deployments (server.yaml, its token-checked
                API); cordons and drains nodes, forgets lost ones; tells each
                node's lifecycle; creates and updates llmgw's streams and buckets;
                reads the usage stream (its page and `/api/usage`)
    ctl         the operator: writes deployments, the catalog, client API keys and
                the nodes' cordons and drains (never a node's status); reads
                everything, and asks launchers for their shards' logs
    observer    reads events, node status, shard status, replicas and heartbeats;
                writes nothing (and never sees shard specs: they carry environments)
    gateway     reads the replicas, deployments, keys and shard-status buckets; reads
                and writes the limits bucket (per-key counters, compare-and-set) and the
                routing bucket (what each replica holds); writes usage;
                reads placement's deployment statuses (the reason none is placed);
                publishes its demand (`<prefix>.demand.<gateway>`, plain NATS) and
                its judgements of replicas (`<prefix>.judgement.<gateway>`)
    node-<id>   one per node, shared by its installer and launcher: writes only its
                own status, shard statuses, heartbeats and events, and the routing
                bucket (what its vLLM replicas' engines hold); reads the desired
                engines, only its own shard specs and shard statuses, and its own
                heartbeats; answers requests for its own shards' logs (only `ctl`
                may ask: logs can quote secrets); asks and answers the other nodes
                for staged weights (`<prefix>.weights.who.<id>`, answered on
                `<prefix>.weights.offer.<asker>.<id>`, nodes only) and reads
                the status of a node that offers (its `mgmt_addr`)
    fleet       `llmgw fleet`'s simulated nodes: every node's rights at once, for
                scale tests only

Nobody may delete or purge a stream. Every identity's replies come to a private
inbox, `_INBOX.<its public key>`, so no one else can read them.

Reading a bucket with a KV watch creates a JetStream consumer. nats-py names
the filter only in the request body, where permissions cannot see it; here
every consumer is given a name, so nats-py uses the subject form
`$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>` and the server checks that
the body's filter is the subject's. A node's permission to create consumers
on the shards stream names its own filter, `$KV.<prefix>-shards.<node>.*`.

nats-server answers a refused publish with an asynchronous `-ERR` and nothing
else: a refused request would wait out its timeout and be retried as if the
server were slow. `GuardedClient` fails every request in flight to the refused
subject at once with `PermissionDenied` (permissions are per subject, so all of
them are refused), logs the refusal once per subject with the identity, and
counts it for `/metrics` (`metrics.bus_metrics`).

nats-server closes the connection of a client whose protocol line is longer
than its `max_control_line` (`-ERR 'maximum control line exceeded'`), and
nats-py then closes the client for good: one over-long subject, made of a
user's name, would end every call of the process. `GuardedClient` refuses such
a line before sending it (`SubjectTooLong`), and the bus refuses subjects and
keys long enough that a JetStream request wrapping them could come near it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, JetStreamManager, api

from .adapters import load_subject
from .errors import BusError, ConfigError
from .subjects import ENGINES_KEY, ONE, Names
from .topology import Needs, kv_stream, needs

log = logging.getLogger("llmgw.access")

ROLES = ("placement", "ctl", "observer", "gateway", "fleet")
NODE_ROLE_PREFIX = "node-"

# nats-py lowercases the server's -ERR text; the subject is recovered from what was sent.
_REFUSAL = re.compile(r"permissions violation for (publish|subscription) to \"([^\"]+)\"")
_CONSUMER_NAME = re.compile(r"^(\$js\.api\.consumer\.create\.[^.]+)\.[^.]+(\..+)?$", re.IGNORECASE)


# --- permissions (pure) ---------------------------------------------------------


@dataclass(frozen=True)
class Permissions:
    """What one identity may publish and subscribe to; everything else is refused."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer the requests it receives (placement answers liveness requests).
    allow_responses: bool = False


def inbox_prefix(public_key: str) -> str:
    """The identity's private inbox: replies to its requests and its consumers' deliveries."""
    return f"_INBOX.{public_key}"


def _read_all(stream: str) -> list[str]:
    """Read every message of a stream: gets, watches, pull consumers and their acks."""
    api_ = "$JS.API"
    return [
        f"{api_}.STREAM.INFO.{stream}",
        f"{api_}.STREAM.MSG.GET.{stream}",
        f"{api_}.DIRECT.GET.{stream}",
        f"{api_}.DIRECT.GET.{stream}.>",
        f"{api_}.CONSUMER.CREATE.{stream}",
        f"{api_}.CONSUMER.CREATE.{stream}.>",
        f"{api_}.CONSUMER.DURABLE.CREATE.{stream}.>",
        f"{api_}.CONSUMER.INFO.{stream}.*",
        f"{api_}.CONSUMER.MSG.NEXT.{stream}.*",
        f"$JS.ACK.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def _read_filtered(stream: str, subject_filter: str) -> list[str]:
    """Read only the messages under one filter: watches and direct gets that name it.

    No `STREAM.MSG.GET` (its subject is in the body) and no durable or unnamed
    consumer creation (their filter is in the body too).
    """
    return [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.DIRECT.GET.{stream}.{subject_filter}",
        f"$JS.API.CONSUMER.CREATE.{stream}.*.{subject_filter}",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _node_publish(names: Names, node: str, need: Needs) -> list[str]:
    """A node's writes and reads; `node` is a node id, or `*` for the simulated fleet."""
    p = names.prefix
    return [
        f"$KV.{names.nodes_bucket}.{node}",
        f"$KV.{names.shard_status_bucket}.{node}.*",
        f"{p}.heartbeat.{node}.*",
        f"{p}.events.node.{node}.>",
        f"{p}.events.shard.{node}.>",
        # Its launcher relays what its replicas' engines hold (their KV events) into the
        # routing bucket: a wrong value costs routing choices, never an answer.
        f"$KV.{names.routing_bucket}.>",
        f"$JS.API.STREAM.INFO.{kv_stream(names.routing_bucket)}",
        # It waits for the streams it uses (`bus.require_streams`).
        *(f"$JS.API.STREAM.INFO.{s}" for s in need.requires if s not in need.reads),
        *(rule for s in need.reads for rule in _read_all(s)),
    ]


def permissions(role: str, names: Names, public_key: str) -> Permissions:
    """nats-server permissions of one identity; `role` is one of ROLES or `node-<id>`."""
    p = names.prefix
    need = needs(names)
    inbox = f"{inbox_prefix(public_key)}.>"
    heartbeats = names.heartbeat_all
    if role.startswith(NODE_ROLE_PREFIX):
        node = role.removeprefix(NODE_ROLE_PREFIX)
        shards = kv_stream(names.shards_bucket)
        publish = [
            *_node_publish(names, node, need["node"]),
            f"{p}.dlq.installer-{node}",
            f"{p}.dlq.launcher-{node}",
            *_read_filtered(shards, f"$KV.{names.shards_bucket}.{node}.*"),
            # Its launcher reads back its own shard statuses, to correct what it does not run.
            *_read_filtered(
                kv_stream(names.shard_status_bucket), f"$KV.{names.shard_status_bucket}.{node}.*"
            ),
        ]
        # Its launcher asks the other nodes for the weights it stages, and answers them with a
        # token for its blob server: only nodes may ask, so only nodes may read the blobs. Each
        # query and offer carries its node in the subject, so one node cannot ask or offer in
        # another's name; and it reads (one key at a time: gets, no watch) the status of a node
        # that offers, whose `mgmt_addr` is the only address it fetches that node's blobs from.
        # A get names its key in the body, where no permission can see it: any node's status.
        nodes = kv_stream(names.nodes_bucket)
        publish += [
            names.weights_query(node),
            names.weights_offer(ONE, node),
            f"$JS.API.STREAM.MSG.GET.{nodes}",
            f"$JS.API.DIRECT.GET.{nodes}.{names.kv_subject(names.nodes_bucket, ONE)}",
        ]
        # Its launcher answers requests for its shards' logs (and only for its own); its
        # agents hear their node's heartbeats, so a second machine with its id stands by.
        own = (
            inbox,
            names.launcher_logs(node),
            # Gateways ask it to load a LoRA adapter into a replica's engine (vLLM).
            load_subject(names.prefix, node),
            names.heartbeat(node, "*"),
            names.weights_query(ONE),
            names.weights_offer(node, ONE),
        )
        # Each rule once: a filtered read grants its stream's info too.
        return Permissions(tuple(dict.fromkeys(publish)), own, allow_responses=True)
    if role == "fleet":
        publish = [*_node_publish(names, "*", need["fleet"]), f"{p}.dlq.llmgw-fleet"]
        return Permissions(tuple(publish), (inbox,))
    if role == "placement":
        publish = [
            *(f"$KV.{b}.>" for b in need["placement"].writes),
            f"{p}.events.replica.>",
            f"{p}.events.placement.>",
            f"{p}.events.deployment.>",
            # An autoscaled deployment's changes of count (`ScaleDecision`).
            names.scale_event("*"),
            # A node's lifecycle (cordoned, draining, drained, uncordoned, deleted).
            names.node_intent("*"),
            f"{p}.dlq.placement",
            names.placement_file,
            *(
                f"$JS.API.STREAM.{op}.{s}"
                for s in need["placement"].manages
                for op in ("CREATE", "UPDATE", "INFO")
            ),
            *(rule for s in need["placement"].reads for rule in _read_all(s)),
        ]
        # The cluster page shows the events as they happen.
        # The gateways' demand reports feed the autoscaler.
        subscribe = (
            inbox,
            heartbeats,
            names.liveness_request,
            names.placement_file,
            names.events_all,
            names.demand(ONE),
            # The gateways' judgements of replicas by their answers.
            names.judgement(ONE),
        )
        return Permissions(tuple(publish), subscribe, allow_responses=True)
    if role == "ctl":
        publish = [
            *(f"$KV.{b}.>" for b in need["ctl"].writes),
            # The desired engines are the operator's too (`llmgw ctl apply -f server.yaml`).
            names.kv_subject(names.config_bucket, ENGINES_KEY),
            names.liveness_request,
            # `llmgw ctl logs`: any node's launcher, for its shards' log lines.
            names.launcher_logs("*"),
            f"{p}.dlq.llmgw-ctl",
            f"{p}.dlq.llmgw-up",
            *(rule for s in need["ctl"].reads for rule in _read_all(s)),
        ]
        return Permissions(tuple(publish), (inbox, heartbeats, names.events_all))
    if role == "observer":
        publish = [names.liveness_request, *(rule for s in need["observer"].reads for rule in _read_all(s))]
        return Permissions(tuple(publish), (inbox, heartbeats, names.events_all))
    if role == "gateway":
        # Reads whole what `needs` says; writes the limits bucket (every gateway's claims on each
        # key's minute, compare-and-set) and the usage records (the tokens each request spent).
        gw = need["gateway"]
        publish = [
            *(rule for s in gw.reads for rule in _read_all(s)),
            *(f"$KV.{b}.>" for b in gw.writes),
            names.usage_all,
            f"$JS.API.STREAM.INFO.{names.usage_stream}",
            # Placement's word on each deployment (`DeploymentStatus`): why one with no
            # replica cannot be placed, quoted to the client that asked for it.
            *_read_filtered(names.events_stream, names.deployment_event("*")),
            # Its demand reports, for placement's autoscaler (every gateway shares the identity).
            names.demand(ONE),
            # Its judgements of replicas by their answers (outlier detection), for placement.
            names.judgement(ONE),
            # A request for a LoRA adapter no replica holds: a node's launcher loads it.
            load_subject(names.prefix, "*"),
        ]
        return Permissions(tuple(publish), (inbox,))
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)} or node-<node id>")


# --- identities ----------------------------------------------------------------------


@dataclass(frozen=True)
class Identity:
    """Who a connection is, in words for logs and errors."""

    name: str  # placement, node-gpu-01 (a seed file's name), user llmgw, no credentials
    public_key: str = ""

    def __str__(self) -> str:
        return f"{self.name} ({self.public_key[:12]}…)" if self.public_key else self.name


def public_key_of(seed_file: str) -> str:
    """The public key of an nkey seed file, or ConfigError saying what is wrong with the file."""
    import nkeys  # type: ignore[import-untyped]

    try:
        seed = bytearray(Path(seed_file).read_bytes().strip())
    except OSError as exc:
        raise ConfigError(
            f"cannot read the nkey seed file {seed_file}: {exc.strerror or exc}; "
            "`llmgw auth init` writes one per identity"
        ) from exc
    try:
        pair = nkeys.from_seed(seed)
    except Exception as exc:  # nkeys raises its own errors, and binascii's
        raise ConfigError(f"{seed_file} is not an nkey seed (`llmgw auth init` writes them): {exc}") from exc
    try:
        return str(pair.public_key.decode())
    finally:
        pair.wipe()


# --- the client's side of a refusal -----------------------------------------------


class PermissionDenied(nats.errors.Error):
    """nats-server refused this identity a publish or a subscription. Retrying cannot help."""

    def __init__(self, identity: str, verb: str, subject: str, server_error: str) -> None:
        super().__init__(
            f"nats-server refused {identity} permission to {verb} {subject!r} ({server_error}); "
            "see the identity's permissions in the server's auth.conf"
        )
        self.identity = identity
        self.verb = verb
        self.subject = subject
        self.server_error = server_error

    def __str__(self) -> str:
        return str(self.args[0])


# nats-server's default max_control_line. A line is `HPUB <subject> <reply> <header bytes>
# <total bytes>` (or `SUB <subject> <queue> <sid>`): LINE_OVERHEAD covers the verb, the
# spaces, the two sizes and the CRLF, with room to spare.
MAX_CONTROL_LINE = 4096
LINE_OVERHEAD = 64
# Subjects and keys as the bus's callers name them. JetStream puts some of them into a
# request subject of its own (a KV read asks `$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>`,
# a consumer is created at `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`), and a reply
# inbox (`_INBOX.<public key>.<id>`, ~110 bytes) goes on the same line: a quarter of the line
# leaves room for all of it.
MAX_SUBJECT_BYTES = 1024


class SubjectTooLong(BusError, nats.errors.Error):
    """A subject refused before it was sent: nats-server would close the connection for it.

    Also a nats error, so that every caller that survives a failed publish survives this one.
    """

    retryable = False


def check_subject(subject: str, limit: int = MAX_SUBJECT_BYTES) -> None:
    """Raise SubjectTooLong when `subject` is longer than `limit` bytes (UTF-8)."""
    size = len(subject.encode())
    if size <= limit:
        return
    start = subject[:48]
    raise SubjectTooLong(
        f"subject '{start}…' is {size:,} bytes long, over the bus's limit of {limit:,} bytes: "
        f"nats-server closes a connection whose protocol line is longer than its max_control_line "
        f"({MAX_CONTROL_LINE:,} bytes by default), so nothing was sent; use a shorter name"
    )


@dataclass(frozen=True)
class Refusal:
    verb: str  # "publish to" or "subscribe to"
    subject: str
    server_error: str


def _refusal_key(verb: str, subject: str) -> str:
    """One key per rule: consumer names are random, so they are left out."""
    m = _CONSUMER_NAME.match(subject)
    if m:
        subject = f"{m.group(1)}.<name>{m.group(2) or ''}"
    return f"{verb} {subject}"


class _NamedConsumers:
    """Every consumer gets a name, so nats-py puts its filter into the request subject."""

    async def add_consumer(
        self,
        stream: str,
        config: api.ConsumerConfig | None = None,
        timeout: float | None = None,
        **params: Any,
    ) -> api.ConsumerInfo:
        config = (config or api.ConsumerConfig()).evolve(**params)
        if not config.name and not config.durable_name:
            config = config.evolve(name=uuid.uuid4().hex)
        info: api.ConsumerInfo = await super().add_consumer(stream, config=config, timeout=timeout)  # type: ignore[misc]
        return info


class _Manager(_NamedConsumers, JetStreamManager):
    pass


class _JetStream(_NamedConsumers, JetStreamContext):
    @property
    def _jsm(self) -> JetStreamManager:
        return _Manager(conn=self._nc, prefix=self._prefix, timeout=self._timeout)


class GuardedClient(Client):
    """nats-py's client with nats-server's permission refusals made visible (see the module doc)."""

    RECENT_SUBJECTS = 4096

    def __init__(self, service: str, identity: str) -> None:
        super().__init__()
        self.service = service
        self.identity = identity
        self.denied: Counter[str] = Counter()
        self.refusals: deque[Refusal] = deque(maxlen=64)
        self._waiting: dict[str, set[asyncio.Future[None]]] = {}
        self._sent: dict[str, str] = {}

    def jetstream(self, **opts: Any) -> JetStreamContext:
        return _JetStream(self, **opts)

    async def _process_connect_init(self) -> None:
        # A server that takes the connection and says nothing (stopped, or cut off after the
        # handshake) fails it at the timeout, and nats-py opens the next one without closing
        # this one: its socket was left to the collector (a ResourceWarning per reconnect
        # attempt once a dead server is found by its pings: bus/connection.py).
        try:
            await super()._process_connect_init()
        except BaseException:
            if self._transport is not None:
                self._transport.close()  # type: ignore[no-untyped-call]
            raise

    @property
    def denied_total(self) -> int:
        return sum(self.denied.values())

    def _remember(self, subject: str) -> None:
        if len(self._sent) >= self.RECENT_SUBJECTS:
            self._sent.clear()
        self._sent[subject.lower()] = subject

    async def publish(
        self, subject: str, payload: bytes = b"", reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        check_subject(subject, MAX_CONTROL_LINE - LINE_OVERHEAD - len(reply.encode()))
        self._remember(subject)
        await super().publish(subject, payload, reply, headers)

    async def subscribe(self, subject: str, queue: str = "", *args: Any, **kw: Any) -> Any:
        check_subject(subject, MAX_CONTROL_LINE - LINE_OVERHEAD - len(queue.encode()))
        self._remember(subject)
        return await super().subscribe(subject, queue, *args, **kw)

    async def request(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float = 0.5,
        old_style: bool = False,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        key = subject.lower()
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.setdefault(key, set())
        waiting.add(refused)
        request = asyncio.ensure_future(super().request(subject, payload, timeout, old_style, headers))
        try:
            await asyncio.wait((request, refused), return_when=asyncio.FIRST_COMPLETED)
            if request.done():
                reply: Msg = request.result()
                return reply
            refused.result()  # raises PermissionDenied
            raise AssertionError("unreachable")
        finally:
            waiting.discard(refused)
            if not waiting and self._waiting.get(key) is waiting:
                del self._waiting[key]
            if not request.done():
                request.cancel()
                with contextlib.suppress(asyncio.CancelledError, nats.errors.Error):
                    await request
            if not refused.done():
                refused.cancel()
            elif not refused.cancelled():
                refused.exception()  # seen, so asyncio does not report it as never retrieved

    def refused(self, exc: Exception) -> bool:
        """Handle a permission refusal from the server; False for any other error."""
        m = _REFUSAL.search(str(exc))
        if m is None:
            return False
        verb = "publish to" if m.group(1) == "publish" else "subscribe to"
        subject = self._sent.get(m.group(2), m.group(2))
        server_error = str(exc).removeprefix("nats: ")
        key = _refusal_key(verb, subject)
        first = key not in self.denied
        self.denied[key] += 1
        self.refusals.append(Refusal(verb, subject, server_error))
        if first:
            # Once per rule: a refusal is a configuration error, and repeating it adds nothing.
            log.error(
                "%s: nats-server refused identity %s permission to %s %s; not retried. "
                "Its permissions are in the server's auth.conf (llmgw auth init writes them)",
                self.service,
                self.identity,
                verb,
                subject,
            )
        if verb == "publish to":
            denied = PermissionDenied(self.identity, verb, subject, server_error)
            for waiter in self._waiting.pop(subject.lower(), set()):
                if not waiter.done():
                    waiter.set_exception(denied)
        return True
