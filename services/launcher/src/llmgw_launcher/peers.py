"""Weights shared inside the cluster: a node serves the blobs it holds to the other nodes, and a
node staging a blob asks them before it goes to the origin.

    Peers.run()            the node's blob server (HTTP, in threads of its own) and its answers
                           on `<prefix>.weights.who`
    Peers.choose(want)     where one blob should come from: a peer that holds it, a peer that
                           fetches it from the origin now, or the origin (this node's turn)
    decide(...)            that choice, pure

Who may read. A blob is read with `Authorization: Bearer <token>`, a random token the serving
node made for that one blob and accepts for `TOKEN_TTL_S` (a transfer that started goes on).
A node gets a token only in an answer to a `WeightsQuery`, and nats-server lets only node
identities publish a query or subscribe to them, and delivers the answer to the asker's private
inbox: so the bus's own identities decide who may read, and nothing else needs to know them.
(Signing each HTTP request with the node's nkey would need every server node to know every
other node's public key and trust its binding to a node id; nodes hold only their own seed,
and the keys live in nats-server's auth.conf.) The bytes and the token cross the network in
clear, as the hub's do over http; every byte is verified on arrival against the sha256 the
reader resolved itself, so a peer can withhold weights but never change them.

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
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, Literal

import anyio
import anyio.abc
import anyio.from_thread
import msgspec
import nats.errors
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.events import WeightsOffer, WeightsQuery, decoder, encode

log = logging.getLogger("llmgw.launcher.peers")

# A token answers one blob for this long: enough to start (and resume) a transfer.
TOKEN_TTL_S = 600.0
CHUNK = 1 << 20
_BLOB = re.compile(r"^(sha256|gitsha1)-[0-9a-f]{40,64}$")
State = Literal["wanting", "origin", "peer"]


@dataclass
class Transfer:
    """A blob this node is staging, as the other nodes are told of it."""

    blob: str
    size: int
    state: State = "wanting"
    upstream: str = ""
    # The nodes that asked for the blob while this node wanted it, with their offers.
    heard: dict[str, WeightsOffer] = field(default_factory=dict)


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
    ) -> None:
        self.bus = bus
        self.node = node
        self.blobs = blobs
        self.addr = addr
        self.port = port
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.rate_bytes_s = rate_bytes_s
        self.serving = False
        self.served_bytes = 0
        self._lock = threading.Lock()
        self._transfers: dict[str, Transfer] = {}
        self._tokens: dict[str, tuple[str, float]] = {}
        self._server: ThreadingHTTPServer | None = None
        self._sockets: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"

    # --- running ------------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve blobs and answer queries until cancelled; a server that cannot bind is said, and
        the node then only asks (it still stages from peers and the origin)."""
        try:
            server = ThreadingHTTPServer((self.addr, self.port), _handler(self))
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
        sub = None
        try:
            if server is not None:
                server.daemon_threads = True
                self._server = server
                self.port = int(server.server_address[1])
                threading.Thread(target=server.serve_forever, name="weights-peers", daemon=True).start()
                self.serving = True
                try:
                    sub = await self.bus.nc.subscribe(self.bus.names.weights_query, cb=self._on_query)
                except (nats.errors.Error, OSError) as exc:
                    log.error("%s: cannot answer weights queries: %s", self.bus.names.weights_query, exc)
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                self.serving = False
                if sub is not None:
                    with contextlib.suppress(nats.errors.Error, OSError):
                        await sub.unsubscribe()
                if server is not None:
                    await anyio.to_thread.run_sync(self._close, server)

    def _close(self, server: ThreadingHTTPServer) -> None:
        server.shutdown()
        server.server_close()
        # Transfers under way end with the node: their readers go on from another.
        with self._lock:
            sockets = list(self._sockets)
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    # --- the bus ------------------------------------------------------------------------

    async def _on_query(self, msg: Msg) -> None:
        try:
            query = decoder(WeightsQuery).decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("%s: not a weights query: %s", msg.subject, exc)
            return
        try:
            offer = self.offer(query)
            if offer is not None and msg.reply:
                await msg.respond(encode(offer))
        except (nats.errors.Error, OSError) as exc:
            log.warning("%s: cannot answer %s: %s", msg.subject, query.node, exc)
        except Exception:  # one bad query must not end the subscription
            log.exception("%s: cannot answer %s", msg.subject, query.node)

    def offer(self, query: WeightsQuery) -> WeightsOffer | None:
        """This node's answer to `query`: what it has of the blob, and a token to read it."""
        if query.node == self.node or not self.serving:
            return None
        final = self.blobs / query.blob
        with self._lock:
            transfer = self._transfers.get(query.blob)
            if transfer is not None and transfer.state == "wanting":
                transfer.heard[query.node] = WeightsOffer(
                    node=query.node,
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
            token=self.grant(query.blob),
            have=have,
            size=_size(final) if state == "held" else (transfer.size if transfer else 0),
        )

    def grant(self, blob: str) -> str:
        token = secrets.token_urlsafe(24)
        now = time.monotonic()
        with self._lock:
            for t, (_b, until) in list(self._tokens.items()):
                if until < now:
                    del self._tokens[t]
            self._tokens[token] = (blob, now + TOKEN_TTL_S)
        return token

    def allowed(self, token: str, blob: str) -> bool:
        with self._lock:
            found = self._tokens.get(token)
        return found is not None and found[0] == blob and found[1] >= time.monotonic()

    async def ask(self, blob: str, size: int) -> list[WeightsOffer]:
        """Every answer to a query for `blob` within the window."""
        query = WeightsQuery(
            node=self.node,
            blob=blob,
            size=size,
            url=f"{self.url}/blobs/{blob}" if self.serving else "",
            token=self.grant(blob) if self.serving else "",
        )
        nc = self.bus.nc
        inbox = nc.new_inbox()
        offers: list[WeightsOffer] = []

        async def on_offer(msg: Msg) -> None:
            try:
                offers.append(decoder(WeightsOffer).decode(msg.data))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s: not a weights offer: %s", inbox, exc)

        try:
            sub = await nc.subscribe(inbox, cb=on_offer)
            try:
                await nc.publish(self.bus.names.weights_query, encode(query), reply=inbox)
                await nc.flush()
                await anyio.sleep(self.window_s)
            finally:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()
        except (nats.errors.Error, OSError) as exc:
            log.warning("%s: cannot ask the other nodes for %s: %s", self.node, blob, exc)
        return offers

    # --- a staging's side (from its thread) -----------------------------------------------

    def begin(self, blob: str, size: int) -> None:
        with self._lock:
            self._transfers[blob] = Transfer(blob, size)

    def choose(self, blob: str, size: int, exclude: set[str]) -> WeightsOffer | None:
        """Ask the other nodes (on the loop), then decide; the choice is what this node says."""
        offers = anyio.from_thread.run(self.ask, blob, size)
        with self._lock:
            transfer = self._transfers[blob]
            heard = list(transfer.heard.values())
            found = {o.node for o in offers}
            chosen = decide(self.node, offers + [o for o in heard if o.node not in found], exclude)
            transfer.state = "origin" if chosen is None else "peer"
            transfer.upstream = "" if chosen is None else chosen.node
            transfer.heard.clear()
        return chosen

    def again(self, blob: str) -> None:
        """The node followed failed: want it again, and hear who else does."""
        with self._lock:
            transfer = self._transfers.get(blob)
            if transfer is not None:
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

    def track(self, s: socket.socket, on: bool) -> None:
        with self._lock:
            if on:
                self._sockets.add(s)
            else:
                self._sockets.discard(s)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _handler(peers: Peers) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def setup(self) -> None:
            super().setup()
            peers.track(self.connection, True)

        def finish(self) -> None:
            peers.track(self.connection, False)
            with contextlib.suppress(OSError):
                super().finish()

        def do_GET(self) -> None:
            parts = self.path.split("?", 1)[0].strip("/").split("/")
            if len(parts) != 2 or parts[0] != "blobs" or not _BLOB.match(parts[1]):
                return self._refuse(404, f"no such path {self.path}; blobs are at /blobs/<algo>-<hex>")
            blob = parts[1]
            token = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not token or not peers.allowed(token, blob):
                return self._refuse(
                    401,
                    f"{peers.node} serves weights only to the cluster's nodes: ask on "
                    f"{peers.bus.names.weights_query} for a token (as a node identity)",
                )
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes=") and rng.endswith("-") and rng[6:-1].isdigit():
                start = int(rng[6:-1])
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
