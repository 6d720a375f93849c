"""Weights shared inside the cluster: a node serves the blobs it holds to the other nodes, and a
node staging a blob asks them before it goes to the origin.

    Peers.run()            the node's blob server (HTTP, in threads of its own) and its answers
                           to the queries on `<prefix>.weights.who.*`
    Peers.choose(want)     where one blob should come from: a peer that holds it, a peer that
                           fetches it from the origin now, or the origin (this node's turn)
    read_query, read_offer the bus's bytes, checked (pure); `OfferRefused` says why not
    checked(...)           the offers whose URL is on their node's `mgmt_addr` (pure)
    decide(...)            the choice among them (pure)

Who is who. A query is published on `<prefix>.weights.who.<asker>` and each answer on
`<prefix>.weights.offer.<asker>.<offerer>`, and nats-server lets only a node's own identity
publish a subject that names it there: the node a query or an offer speaks for is the
subject's, never the payload's (a payload naming another node is dropped). A node that held
a blob's offers could otherwise answer every query under invented names, each pointing to a
server that never sends, and the asker would try them one after another for ever.

Where from. An offer's URL must be `http://<mgmt_addr>:<port>/blobs/<blob>`, with the
`mgmt_addr` that node reports in its own status (the nodes bucket's key that only it may
write), else it is ignored: a node never fetches a URL an offer invented.

How long. A peer that fails a transfer (stops, stalls, sends wrong bytes, refuses) is not
chosen again, for any blob, for `PENALTY_S`; a staging tries at most `PEER_TRIES` peers for one
blob and chooses none once `budget_s` has passed since it began: the origin is asked after a
bounded time whatever the peers say. Per query at most `MAX_OFFERS` offers are kept (the first
of each node), each at most `MAX_MESSAGE_BYTES`.

Who may read. A blob is read with `Authorization: Bearer <token>`, a random token the serving
node made for that one blob and that one reader, and accepts for `TOKEN_TTL_S` (a transfer
that started goes on). A node gets a token only in an answer to its query, and nats-server
lets only node identities ask or hear the answers: so the bus's own identities decide who may
read, and nothing else needs to know them. (Signing each HTTP request with the node's nkey
would need every server node to know every other node's public key and trust its binding to
a node id; nodes hold only their own seed, and the keys live in nats-server's auth.conf.) The
bytes and the token cross the network in clear, as the hub's do over http; every byte is
verified on arrival against the sha256 the reader resolved itself, so a peer can withhold
weights but never change them.

The blob server's clients. At most `max_connections` at once (and never more than the
open-file limit, raised to its hard limit, leaves room for). A connection has
`header_timeout_s` to send its request, and an idle kept-alive one as long for its next: then
it is closed, however slowly its bytes trickle. At the cap a new connection closes the one
that has waited longest for its request; when every connection is sending a blob, the new one
is answered 503 at once and closed. Each read and write waits at most `timeout_s`.

The origin once. Nodes that want one blob at the same time find each other: each registers its
want before it asks, and the query carries its own offer. Every pair then either hears of each
other while both still want (and both pick the same node, the smallest id, to fetch the origin),
or one had already chosen and says so (the later one follows it). A node that follows reads the
fetcher's download as it grows; a fetcher serves its `.partial` while it arrives. If the node
followed stops (dies, is stopped, stalls), the follower asks again without it, resuming its own
`.partial` from whoever it picks next, or from the origin.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import resource
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import anyio
import anyio.abc
import anyio.from_thread
import msgspec
import nats.errors

from llmgw_core.bus import Bus
from llmgw_core.bus.deadletter import DecodeFailure, decode
from llmgw_core.errors import BusError
from llmgw_core.events import NodeStatus, WeightsOffer, WeightsQuery
from llmgw_core.limits import NAME_MAX
from llmgw_core.subjects import ONE

log = logging.getLogger("llmgw.launcher.peers")

# A token answers one blob for this long: enough to start (and resume) a transfer.
TOKEN_TTL_S = 600.0
# Tokens held at once: one per reader and blob, reused while it has half its life left; past
# this many the oldest are forgotten (a node asking for every blob in turn cannot fill memory).
MAX_TOKENS = 4096
CHUNK = 1 << 20
# A query or an offer is a few hundred bytes; a bigger one is dropped before it is decoded.
MAX_MESSAGE_BYTES = 4096
# Offers kept per query (the first of each node), and queries heard per blob while it is wanted.
MAX_OFFERS = 32
# Peers tried for one blob before the origin, and how long a failed peer is not chosen again.
PEER_TRIES = 3
PENALTY_S = 600.0
# A node's `mgmt_addr` as its status says, kept this long (a node with none: `NO_ADDR_TTL_S`).
ADDR_TTL_S = 30.0
NO_ADDR_TTL_S = 5.0
ADDR_TIMEOUT_S = 5.0
# The blob server: connections at once, and the open files kept for everything else the
# launcher holds (engines' pipes and logs, the bus); each connection holds a socket and a file.
MAX_CONNECTIONS = 64
RESERVED_FDS = 256
HEADER_TIMEOUT_S = 10.0
# A warning about one node's bad messages is logged at most this often.
WARN_EVERY_S = 60.0

_BLOB = re.compile(r"^(sha256|gitsha1)-[0-9a-f]{40,64}$")
_NODE = re.compile(rf"^[A-Za-z0-9_-]{{1,{NAME_MAX}}}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{16,128}$")
# `bytes=<start>-` only (what `weights.fetch` sends), ASCII digits: `str.isdigit` takes '²'.
_RANGE = re.compile(r"^bytes=([0-9]{1,19})-$")
_URL = re.compile(r"^http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})/blobs/([a-z0-9-]+)$")
State = Literal["wanting", "origin", "peer"]


class OfferRefused(ValueError):
    """A query or an offer from the bus that is not used: what was wrong, in words."""


@dataclass
class Transfer:
    """A blob this node is staging, as the other nodes are told of it."""

    blob: str
    size: int
    state: State = "wanting"
    upstream: str = ""
    # The nodes that asked for the blob while this node wanted it, with their offers.
    heard: dict[str, WeightsOffer] = field(default_factory=dict)
    # Peers chosen so far, and when the staging began: both bound the time before the origin.
    tries: int = 0
    began: float = field(default_factory=time.monotonic)


# --- pure ---------------------------------------------------------------------------------


def sender_of(subject: str) -> str:
    """The node a query or an offer came from: its subject's last token, which nats-server
    lets only that node's identity publish."""
    node = subject.rsplit(".", 1)[-1]
    if not _NODE.fullmatch(node):
        raise OfferRefused(f"{subject}: its last token is not a node id")
    return node


_Message = TypeVar("_Message", WeightsQuery, WeightsOffer)


def _decoded(kind: type[_Message], what: Literal["query", "offer"], data: bytes, sender: str) -> _Message:
    """`data` from `sender` as a `kind`, at most `MAX_MESSAGE_BYTES` long, through the bus's own
    decode (its words bounded); `OfferRefused` otherwise."""
    if len(data) > MAX_MESSAGE_BYTES:
        article = "an" if what == "offer" else "a"
        raise OfferRefused(
            f"{article} {what} of {len(data)} bytes from {sender} (at most {MAX_MESSAGE_BYTES})"
        )
    try:
        return decode(kind, sender, data)
    except DecodeFailure as exc:
        raise OfferRefused(f"not a weights {what} from {sender}: {exc.error}") from None


def read_query(data: bytes, sender: str) -> WeightsQuery:
    """`sender`'s query, checked: at most `MAX_MESSAGE_BYTES`, a query, naming `sender` itself
    and a blob as the store names it. Raises `OfferRefused` (only) saying what is wrong."""
    query = _decoded(WeightsQuery, "query", data, sender)
    if query.node != sender:
        raise OfferRefused(f"a query from {sender} in the name of {query.node}")
    if not _BLOB.fullmatch(query.blob):
        raise OfferRefused(f"a query from {sender} for {query.blob[:80]!r}, not a blob name")
    if query.size < 0:
        raise OfferRefused(f"a query from {sender} for {query.blob} of {query.size} bytes")
    return query


def read_offer(data: bytes, sender: str, blob: str) -> WeightsOffer:
    """`sender`'s answer to a query for `blob`, checked: at most `MAX_MESSAGE_BYTES`, an offer
    of `sender` itself for `blob`, with a token that fits a header and a URL of the blob
    server's shape (its address is checked against the node's status by `checked`). Raises
    `OfferRefused` (only) saying what is wrong."""
    offer = _decoded(WeightsOffer, "offer", data, sender)
    if offer.node != sender:
        raise OfferRefused(f"an offer from {sender} in the name of {offer.node}")
    if offer.blob != blob:
        raise OfferRefused(f"an offer from {sender} of {offer.blob[:80]!r}, not the {blob} asked for")
    return offer


def blob_of(path: str) -> str | None:
    """The blob a blob server's request path names (`/blobs/<algo>-<hex>`, a query ignored);
    None for any other path."""
    parts = path.split("?", 1)[0].strip("/").split("/")
    if len(parts) != 2 or parts[0] != "blobs" or not _BLOB.fullmatch(parts[1]):
        return None
    return parts[1]


def range_start(header: str) -> tuple[int, str]:
    """Where a `Range: bytes=<start>-` asks the blob to start, with the header as it counts;
    (0, "") for any other form: the whole blob."""
    asked = _RANGE.fullmatch(header)
    if asked is None:
        return 0, ""
    return int(asked[1]), header


def peer_url(addr: str, port: int, blob: str) -> str:
    """Where a node on `addr` serves `blob`."""
    host = f"[{addr}]" if ":" in addr else addr
    return f"http://{host}:{port}/blobs/{blob}"


def on_address(offer: WeightsOffer, blob: str, size: int, addr: str) -> bool:
    """Whether `offer` can be read: a token, its URL the blob server's on `addr` (the node's
    `mgmt_addr`) for `blob`, and counts that fit the blob's `size`."""
    if not addr or not _TOKEN.fullmatch(offer.token) or offer.blob != blob:
        return False
    found = _URL.fullmatch(offer.url)
    if found is None or not 0 < int(found[2]) < 65536:
        return False
    if offer.url != peer_url(addr, int(found[2]), blob):
        return False
    return 0 <= offer.have <= size and offer.size in (0, size)


def checked(
    offers: Iterable[WeightsOffer], blob: str, size: int, addrs: Mapping[str, str]
) -> list[WeightsOffer]:
    """The offers (at most `MAX_OFFERS`, one per node) that can be read (`on_address`)."""
    found: dict[str, WeightsOffer] = {}
    for offer in offers:
        if len(found) >= MAX_OFFERS:
            break
        if offer.node not in found and on_address(offer, blob, size, addrs.get(offer.node, "")):
            found[offer.node] = offer
    return list(found.values())


def decide(me: str, offers: list[WeightsOffer], exclude: set[str]) -> WeightsOffer | None:
    """The peer to read a blob from, or None: this node fetches it from the origin (pure).

    A node that holds it first (spread over the holders by rendezvous hashing, so that many
    readers do not all pick one), then one that fetches it from the origin now (the most bytes
    first), else among the nodes that want it and have not chosen, the smallest id fetches the
    origin and the others follow it. A node that itself follows a peer is not followed: a
    chain would stall as a whole when its head does, and two followers could pick each other.
    """
    live = [o for o in offers if o.node != me and o.node not in exclude]
    held = [o for o in live if o.state == "held"]
    if held:
        return min(held, key=lambda o: hashlib.sha256(f"{me}/{o.node}".encode()).hexdigest())
    fetching = [o for o in live if o.state == "origin"]
    if fetching:
        return max(fetching, key=lambda o: (o.have, o.node))
    wanting = [o for o in live if o.state == "wanting"]
    first = min(wanting, key=lambda o: o.node, default=None)
    if first is None or me < first.node:
        return None
    return first


def exhausted(transfer: Transfer, now: float, budget_s: float) -> str:
    """Why no peer is chosen for `transfer` any more ("": one may be)."""
    if transfer.tries >= PEER_TRIES:
        return f"{transfer.tries} peers tried"
    if now - transfer.began > budget_s:
        return f"{now - transfer.began:.0f} s spent on peers (at most {budget_s:g} s)"
    return ""


def raise_open_file_limit() -> int:
    """Raise this process's open-file limit to its hard limit (the soft default, often 1024, is
    a relic of select()); the limit now, `1 << 20` for none."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to its hard limit %d: %s", soft, hard, exc)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


class _Quiet:
    """At most one warning per node per `WARN_EVERY_S`: a node sending junk cannot flood the log."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def warn(self, node: str, words: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(node, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            if len(self._last) >= 1024:
                self._last.clear()
            self._last[node] = now
        log.warning("%s", words)


# --- the node's side ----------------------------------------------------------------------


class Peers:
    """One per launcher: its blob server and its side of the query protocol."""

    def __init__(
        self,
        bus: Bus,
        node: str,
        blobs: Path,
        addr: str,
        *,
        port: int = 0,
        window_s: float = 0.3,
        timeout_s: float = 30.0,
        rate_bytes_s: int = 0,
        budget_s: float | None = None,
        max_connections: int = MAX_CONNECTIONS,
        header_timeout_s: float = HEADER_TIMEOUT_S,
    ) -> None:
        self.bus = bus
        self.node = node
        self.blobs = blobs
        self.addr = addr
        self.port = port
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.rate_bytes_s = rate_bytes_s
        # Enough for a few peers to fail by silence, and the answers between them.
        self.budget_s = budget_s if budget_s is not None else PEER_TRIES * (timeout_s + 2 * window_s) + 10
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.serving = False
        self.served_bytes = 0
        # Blob server connections closed by this node, by why: `evicted` (at the cap, the one
        # that waited longest for its request), `refused` (at the cap, all sending: 503),
        # `timed_out` (no whole request within `header_timeout_s`).
        self.closed: dict[str, int] = {"evicted": 0, "refused": 0, "timed_out": 0}
        self._lock = threading.Lock()
        self._transfers: dict[str, Transfer] = {}
        # token: (blob, reader, valid until); (reader, blob): token
        self._tokens: dict[str, tuple[str, str, float]] = {}
        self._granted: dict[tuple[str, str], str] = {}
        self._failed: dict[str, float] = {}
        self._addrs: dict[str, tuple[str, float]] = {}
        self._quiet = _Quiet()
        self._server: BlobServer | None = None

    @property
    def url(self) -> str:
        return peer_url(self.addr, self.port, "").removesuffix("/blobs/")

    @property
    def connections(self) -> int:
        """Connections the blob server holds now."""
        return 0 if self._server is None else self._server.held()

    # --- running ------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve blobs and answer queries until cancelled; a server that cannot bind is said, and
        the node then only asks (it still stages from peers and the origin)."""
        open_files = raise_open_file_limit()
        cap = max(1, min(self.max_connections, (open_files - RESERVED_FDS) // 2))
        if cap < self.max_connections:
            log.warning(
                "%s: the blob server serves %d readers at once, not %d: the open-file limit is %d",
                self.node,
                cap,
                self.max_connections,
                open_files,
            )
        try:
            server: BlobServer | None = BlobServer((self.addr, self.port), self, cap)
        except OSError as exc:
            log.error(
                "%s: cannot serve weights to the other nodes on %s:%s: %s; it stages from them and the "
                "origin, but serves none (set weights_port to a free port)",
                self.node,
                self.addr,
                self.port,
                exc.strerror or exc,
            )
            server = None
        try:
            async with anyio.create_task_group() as tg:
                if server is not None:
                    self._server = server
                    self.port = int(server.server_address[1])
                    threading.Thread(target=server.serve_forever, name="weights-peers", daemon=True).start()
                    threading.Thread(target=server.reap, name="weights-peers-reaper", daemon=True).start()
                    self.serving = True
                    subject = self.bus.names.weights_query(ONE)
                    try:
                        await tg.start(self.bus.listen, subject, self._on_query)
                    except BusError as exc:
                        log.error("%s: cannot answer weights queries: %s", subject, exc)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                self.serving = False
                if server is not None:
                    await anyio.to_thread.run_sync(server.close)

    # --- the bus ------------------------------------------------------------------------

    async def _on_query(self, subject: str, data: bytes) -> None:
        sender = ""
        try:
            sender = sender_of(subject)
            if sender == self.node:
                return
            offer = self.offer(read_query(data, sender), sender)
            if offer is not None:
                await self.bus.publish_core(self.bus.names.weights_offer(sender, self.node), offer)
        except OfferRefused as exc:
            self._quiet.warn(sender or subject, f"{subject}: dropped: {exc}")
        except BusError as exc:
            log.warning("%s: cannot answer %s: %s", subject, sender, exc)
        except Exception:  # one bad query must not end the subscription
            log.exception("%s: cannot answer %s", subject, sender)

    def offer(self, query: WeightsQuery, sender: str) -> WeightsOffer | None:
        """This node's answer to `sender`'s `query`: what it has of the blob, and a token to read it."""
        if sender == self.node or not self.serving or not _BLOB.fullmatch(query.blob):
            return None
        final = self.blobs / query.blob
        with self._lock:
            transfer = self._transfers.get(query.blob)
            if (
                transfer is not None
                and transfer.state == "wanting"
                and (sender in transfer.heard or len(transfer.heard) < MAX_OFFERS)
            ):
                transfer.heard[sender] = WeightsOffer(
                    node=sender,
                    blob=query.blob,
                    state="wanting",
                    url=query.url,
                    token=query.token,
                    size=query.size,
                )
        if final.exists():
            state: Literal["held", "origin", "peer", "wanting"] = "held"
            have = _size(final)
        elif transfer is not None:
            state, have = transfer.state, _size(self.blobs / f"{query.blob}.partial")
        else:
            return None
        return WeightsOffer(
            node=self.node,
            blob=query.blob,
            state=state,
            url=f"{self.url}/blobs/{query.blob}",
            token=self.grant(query.blob, sender),
            have=have,
            size=_size(final) if state == "held" else (transfer.size if transfer else 0),
        )

    def grant(self, blob: str, reader: str = "") -> str:
        """A token for `reader` (a node id; "": whoever hears this node's query) to read `blob`."""
        now = time.monotonic()
        with self._lock:
            token = self._granted.get((reader, blob))
            if token is not None and self._tokens[token][2] - now > TOKEN_TTL_S / 2:
                return token
            for t, (b, r, until) in list(self._tokens.items()):
                if until < now:
                    del self._tokens[t]
                    self._granted.pop((r, b), None)
            while len(self._tokens) >= MAX_TOKENS:  # the oldest first: dicts keep their order
                t, (b, r, _until) = next(iter(self._tokens.items()))
                del self._tokens[t]
                if self._granted.get((r, b)) == t:
                    del self._granted[(r, b)]
            token = secrets.token_urlsafe(24)
            self._tokens[token] = (blob, reader, now + TOKEN_TTL_S)
            self._granted[(reader, blob)] = token
        return token

    def allowed(self, token: str, blob: str) -> bool:
        with self._lock:
            found = self._tokens.get(token)
        return found is not None and found[0] == blob and found[2] >= time.monotonic()

    async def ask(self, blob: str, size: int) -> list[WeightsOffer]:
        """The offers the other nodes send within the window, read (`read_offer`): the first of
        each node, `MAX_OFFERS` at most, each naming the node whose subject it came on."""
        query = WeightsQuery(
            node=self.node,
            blob=blob,
            size=size,
            url=f"{self.url}/blobs/{blob}" if self.serving else "",
            token=self.grant(blob) if self.serving else "",
        )
        names = self.bus.names
        offers: dict[str, WeightsOffer] = {}

        async def on_offer(subject: str, data: bytes) -> None:
            sender = ""
            try:
                sender = sender_of(subject)
                if sender not in offers and len(offers) < MAX_OFFERS:
                    offers[sender] = read_offer(data, sender, blob)
            except OfferRefused as exc:
                self._quiet.warn(sender or subject, f"{subject}: dropped: {exc}")

        async with anyio.create_task_group() as tg:
            try:  # the offers are heard from before the query goes out
                await tg.start(self.bus.listen, names.weights_offer(self.node, ONE), on_offer)
                await self.bus.publish_core(names.weights_query(self.node), query)
                await anyio.sleep(self.window_s)
            except BusError as exc:
                log.warning("%s: cannot ask the other nodes for %s: %s", self.node, blob, exc)
            tg.cancel_scope.cancel()
        return list(offers.values())

    async def addresses(self, nodes: Iterable[str]) -> dict[str, str]:
        """Each node's `mgmt_addr` as its own status says (cached); a node without one is left out."""
        now = time.monotonic()
        found: dict[str, str] = {}
        missing: list[str] = []
        with self._lock:
            for node in nodes:
                hit = self._addrs.get(node)
                if hit is not None and hit[1] > now:
                    found[node] = hit[0]
                elif len(missing) < 2 * MAX_OFFERS:
                    missing.append(node)

        async def one(node: str) -> None:
            addr = ""
            try:
                with anyio.fail_after(ADDR_TIMEOUT_S):
                    got = await self.bus.get(self.bus.names.nodes_bucket, node, NodeStatus)
                addr = got[0].facts.mgmt_addr if got is not None else ""
                if not addr:
                    words = f"{node} offers weights, its status says no mgmt_addr: its offers are ignored"
                    self._quiet.warn(node, words)
            except (TimeoutError, BusError, nats.errors.Error, OSError, msgspec.MsgspecError) as exc:
                self._quiet.warn(
                    node, f"cannot read {node}'s status (its mgmt_addr) to check its offers: {exc}; ignored"
                )
            except Exception:  # one node's status must not fail a staging
                log.exception("cannot read %s's status to check its offers", node)
            found[node] = addr
            with self._lock:
                if len(self._addrs) >= 1024:
                    self._addrs.clear()
                self._addrs[node] = (addr, time.monotonic() + (ADDR_TTL_S if addr else NO_ADDR_TTL_S))

        async with anyio.create_task_group() as tg:
            for node in missing:
                tg.start_soon(one, node)
        return {n: a for n, a in found.items() if a}

    # --- a staging's side (from its thread) -----------------------------------------------

    def begin(self, blob: str, size: int) -> None:
        with self._lock:
            self._transfers[blob] = Transfer(blob, size)

    def choose(self, blob: str, size: int, exclude: set[str]) -> WeightsOffer | None:
        """Ask the other nodes (on the loop), check their offers against their statuses, then
        decide; the choice is what this node says. None (the origin) once `exhausted`."""
        with self._lock:
            transfer = self._transfers[blob]
            why = exhausted(transfer, time.monotonic(), self.budget_s)
            if why:
                transfer.state, transfer.upstream = "origin", ""
                transfer.heard.clear()
        if why:
            log.info("%s: %s from the origin: %s", self.node, blob, why)
            return None
        offers = anyio.from_thread.run(self.ask, blob, size)
        found = {o.node for o in offers}
        addrs: dict[str, str] = {}
        # Nodes heard while their addresses were being read are read too (a few rounds at most).
        for _round in range(3):
            with self._lock:
                heard = [o for o in transfer.heard.values() if o.node not in found]
            want = {o.node for o in [*offers, *heard]} - addrs.keys()
            if not want:
                break
            addrs.update(anyio.from_thread.run(self.addresses, want))
            for node in want:
                addrs.setdefault(node, "")
        with self._lock:
            now = time.monotonic()
            for node, until in list(self._failed.items()):
                if until < now:
                    del self._failed[node]
            heard = [o for o in transfer.heard.values() if o.node not in found]
            usable = checked([*offers, *heard], blob, size, addrs)
            chosen = decide(self.node, usable, exclude | self._failed.keys())
            transfer.state = "origin" if chosen is None else "peer"
            transfer.upstream = "" if chosen is None else chosen.node
            if chosen is not None:
                transfer.tries += 1
            transfer.heard.clear()
        return chosen

    def again(self, blob: str) -> None:
        """The node followed failed: it is not chosen again for `PENALTY_S`; want the blob again,
        and hear who else does."""
        with self._lock:
            transfer = self._transfers.get(blob)
            if transfer is not None:
                if transfer.upstream:
                    if len(self._failed) >= 1024:
                        self._failed.clear()
                    self._failed[transfer.upstream] = time.monotonic() + PENALTY_S
                transfer.state, transfer.upstream = "wanting", ""

    def end(self, blob: str) -> None:
        with self._lock:
            self._transfers.pop(blob, None)

    def transfer(self, blob: str) -> Transfer | None:
        with self._lock:
            return self._transfers.get(blob)

    def count(self, n: int) -> None:
        with self._lock:
            self.served_bytes += n


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# --- the blob server ----------------------------------------------------------------------


@dataclass
class _Conn:
    """One connection: waiting for its request (`since` then) or sending."""

    waiting: bool = True
    since: float = field(default_factory=time.monotonic)


class BlobServer(ThreadingHTTPServer):
    """The blob server's connections, counted and timed (see the module's docstring)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], peers: Peers, cap: int) -> None:
        self.peers = peers
        self.cap = cap
        self.conns: dict[socket.socket, _Conn] = {}
        self.lock = threading.Lock()
        self.closed = threading.Event()
        super().__init__(address, _handler(peers))

    def held(self) -> int:
        with self.lock:
            return len(self.conns)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        """Admit a new connection under the cap: closing the one that waited longest for its
        request if need be, else refusing this one at once."""
        evict = None
        with self.lock:
            if len(self.conns) >= self.cap:
                waiting = [(c.since, id(s), s) for s, c in self.conns.items() if c.waiting]
                if not waiting:
                    self.peers.closed["refused"] += 1
                    _busy(request, self.peers.node, self.cap)
                    return False
                evict = min(waiting)[2]
                del self.conns[evict]
                self.peers.closed["evicted"] += 1
            self.conns[request] = _Conn()
        if evict is not None:
            _cut(evict)
        return True

    def shutdown_request(self, request: Any) -> None:
        with self.lock:
            self.conns.pop(request, None)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A reader that went away mid-answer is no fault of this node's: said quietly."""
        log.debug("%s: blob server: %s", self.peers.node, client_address, exc_info=True)

    def phase(self, conn: socket.socket, waiting: bool) -> None:
        with self.lock:
            found = self.conns.get(conn)
            if found is not None:
                found.waiting, found.since = waiting, time.monotonic()

    def reap(self) -> None:
        """Close the connections that have waited `header_timeout_s` for their request."""
        while not self.closed.wait(min(0.5, self.peers.header_timeout_s / 4)):
            limit, now = self.peers.header_timeout_s, time.monotonic()
            with self.lock:
                late = [s for s, c in self.conns.items() if c.waiting and now - c.since > limit]
                for s in late:
                    del self.conns[s]
                self.peers.closed["timed_out"] += len(late)
            for s in late:
                _cut(s)

    def close(self) -> None:
        """Stop accepting, and end the transfers under way: their readers go on from another."""
        self.closed.set()
        self.shutdown()
        self.server_close()
        with self.lock:
            conns = list(self.conns)
            self.conns.clear()
        for s in conns:
            _cut(s)


def _cut(s: socket.socket) -> None:
    """End a connection a handler thread may be blocked on: its reads and writes fail at once."""
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)


def _busy(request: socket.socket, node: str, cap: int) -> None:
    body = f"{node} serves {cap} readers at once, all busy: read from another node, or later".encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with contextlib.suppress(OSError):
        request.setblocking(False)
        request.send(head + body)


def _handler(peers: Peers) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Each read and write of the socket: a reader that stops reading frees its thread.
        timeout = peers.timeout_s
        server: BlobServer

        def log_message(self, format: str, *args: object) -> None:
            pass

        def handle_one_request(self) -> None:
            # From here until its headers are in, the reaper may close it.
            self.server.phase(self.connection, True)
            super().handle_one_request()

        def finish(self) -> None:
            with contextlib.suppress(OSError):
                super().finish()

        def do_GET(self) -> None:
            self.server.phase(self.connection, False)
            blob = blob_of(self.path)
            if blob is None:
                return self._refuse(404, f"no such path {self.path[:200]}; blobs are at /blobs/<algo>-<hex>")
            token = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not token or not peers.allowed(token, blob):
                return self._refuse(
                    401,
                    f"{peers.node} serves weights only to the cluster's nodes: ask on "
                    f"{peers.bus.names.weights_query('<your node>')} for a token (as that node's identity)",
                )
            start, rng = range_start(self.headers.get("Range", ""))
            final = peers.blobs / blob
            if final.exists():
                return self._send(final, start, _size(final), rng, growing=False)
            transfer = peers.transfer(blob)
            if transfer is None:
                return self._refuse(404, f"{peers.node} holds no {blob}")
            self._send(peers.blobs / f"{blob}.partial", start, transfer.size, rng, growing=True)

        def _refuse(self, status: int, words: str) -> None:
            body = words.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _send(self, path: Path, start: int, size: int, rng: str, *, growing: bool) -> None:
            if start >= size and rng:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            blob = path.name.removesuffix(".partial")
            f = self._open(path, blob, growing)
            if f is None:
                return self._refuse(404, f"{peers.node} holds no {blob}")
            with f:
                self.send_response(206 if rng else 200)
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
                self.send_header("Content-Length", str(size - start))
                self.end_headers()
                self._copy(f, start, size, blob, growing)

        def _open(self, path: Path, blob: str, growing: bool) -> BinaryIO | None:
            """The file, once it exists; a fetcher that has not begun yet is waited for."""
            deadline = time.monotonic() + peers.timeout_s
            while True:
                try:
                    return path.open("rb")
                except FileNotFoundError:
                    final = peers.blobs / blob
                    if final.exists():
                        return final.open("rb")
                    if not growing or peers.transfer(blob) is None or time.monotonic() > deadline:
                        return None
                time.sleep(0.05)

        def _copy(self, f: BinaryIO, start: int, size: int, blob: str, growing: bool) -> None:
            """Bytes from `start` to `size`; a file still arriving is followed as it grows (its
            descriptor stays valid when the download is renamed into its blob)."""
            f.seek(start)
            pos, began, idle_since = start, time.monotonic(), time.monotonic()
            while pos < size:
                # Under a rate limit, blocks of a tenth of a second's worth: the limit holds
                # within a second, not only on average over a whole model.
                chunk = min(CHUNK, max(4096, peers.rate_bytes_s // 10)) if peers.rate_bytes_s else CHUNK
                block = f.read(min(chunk, size - pos))
                if not block:
                    stalled = time.monotonic() - idle_since > peers.timeout_s
                    if (
                        not growing
                        or stalled
                        or (peers.transfer(blob) is None and not (peers.blobs / blob).exists())
                    ):
                        return  # the reader sees a short body and goes on from another
                    time.sleep(0.02)
                    continue
                idle_since = time.monotonic()
                try:
                    self.wfile.write(block)
                except OSError:
                    return
                pos += len(block)
                peers.count(len(block))
                if peers.rate_bytes_s:
                    ahead = (pos - start) / peers.rate_bytes_s - (time.monotonic() - began)
                    if ahead > 0:
                        time.sleep(ahead)

    return Handler
