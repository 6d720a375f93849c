"""Peers that lie and clients that linger: a node identity that answers every weights query
under invented names with URLs to a server that never sends, offers off the node's own
address, and 1,100 idle or trickling connections to a node's blob server. Who a query or an
offer speaks for is the subject's node, which nats-server checks; an offer is read only on the
`mgmt_addr` its node's own status reports; each peer is tried once and the origin comes after
a bounded number of them; the blob server holds at most its cap and closes what idles. The
decoding of queries and offers and the choice of peer are fuzzed (hypothesis, fast tier)."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.events import NodeFacts, NodeStatus, WeightsOffer, WeightsQuery, encode
from llmgw_core.subjects import ONE
from llmgw_launcher import weights
from llmgw_launcher.peers import (
    MAX_MESSAGE_BYTES,
    MAX_OFFERS,
    PEER_TRIES,
    OfferRefused,
    Peers,
    Transfer,
    blob_of,
    checked,
    decide,
    exhausted,
    on_address,
    peer_url,
    range_start,
    read_offer,
    read_query,
    sender_of,
)
from llmgw_launcher.weights import Progress, Want, WeightsError
from tests.auth_support import session_for
from tests.hf_server import Hub, hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

MODEL = hashlib.sha256(b"peers").digest() * (1 << 15)  # 1 MiB
SHA = hashlib.sha256(MODEL).hexdigest()
BLOB = f"sha256-{SHA}"
TOKEN = "A" * 32

FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


# --- decoding and choosing, pure (fast) --------------------------------------------------------

NAMES = ["n1", "n2", "n3", "n4", "me"]
NODES = st.sampled_from(NAMES)
ADDR_LIST = ["10.0.0.1", "10.0.0.2", "127.0.0.1", "fd00::1", ""]
ADDRS = st.sampled_from(ADDR_LIST)


def urls(addrs: list[str]) -> st.SearchStrategy[str]:
    """URLs an offer could name: on one of `addrs` or off them, well-formed or not."""
    good = st.builds(
        peer_url,
        st.sampled_from(addrs),
        st.one_of(st.integers(min_value=1, max_value=65535), st.integers()),
        st.sampled_from([BLOB, "sha256-00", "x"]),
    )
    odd = st.sampled_from(
        [
            "",
            f"http://10.0.0.1:80/blobs/{BLOB}?x=1",
            f"http://user@10.0.0.1:80/blobs/{BLOB}",
            f"https://10.0.0.1:80/blobs/{BLOB}",
            f"http://10.0.0.1.evil.example:80/blobs/{BLOB}",
            f"http://10.0.0.1:80/blobs/../{BLOB}",
            f"http://[::1]:80/blobs/{BLOB}",
            f"file:///etc/passwd#{BLOB}",
        ]
    )
    return st.one_of(good, good, odd, st.text(max_size=80))


@st.composite
def offers(draw: st.DrawFn, addrs: dict[str, str]) -> WeightsOffer:
    """An offer as a peer might send it: right, on its node's address, or with one field (or
    all of them) as an attacker chooses."""
    node = draw(NODES)
    fields: dict[str, Any] = {
        "node": node,
        "blob": BLOB,
        "state": draw(st.sampled_from(["held", "origin", "peer", "wanting"])),
        "url": peer_url(addrs.get(node, ""), draw(st.integers(min_value=1, max_value=65535)), BLOB),
        "token": TOKEN,
        "have": draw(st.integers(min_value=0, max_value=len(MODEL))),
        "size": draw(st.sampled_from([0, len(MODEL)])),
    }
    hostile = {
        "blob": st.sampled_from([f"sha256-{'0' * 64}", "../x", "", BLOB + "\n"]),
        "url": urls([*ADDR_LIST, addrs.get(node, "")]),
        "token": st.sampled_from(["", "short", "x\r\nHost: evil", "B" * 200, TOKEN + "\n"]),
        "have": st.integers(),
        "size": st.integers(),
    }
    spoilt = draw(st.sets(st.sampled_from(sorted(hostile)))) if draw(st.booleans()) else set()
    for name in sorted(spoilt):
        fields[name] = draw(hostile[name])
    return WeightsOffer(**fields)


@FUZZ
@given(st.data(), st.fixed_dictionaries({}, optional=dict.fromkeys(NAMES, ADDRS)), st.sets(NODES, max_size=2))
def test_any_offers_give_a_checked_offer_on_its_nodes_address_or_none(
    data: st.DataObject, addrs: dict[str, str], exclude: set[str]
) -> None:
    found = data.draw(st.lists(offers(addrs), max_size=3 * MAX_OFFERS))
    usable = checked(found, BLOB, len(MODEL), addrs)
    assert len(usable) <= MAX_OFFERS
    assert len({o.node for o in usable}) == len(usable)
    chosen = decide("me", usable, exclude)
    if chosen is None:
        return
    assert chosen.node != "me"
    assert chosen.node not in exclude
    assert chosen.state != "peer"
    url = urlsplit(chosen.url)
    assert url.scheme == "http"
    assert url.hostname == addrs[chosen.node].strip("[]")
    assert url.path == f"/blobs/{BLOB}"
    assert not url.query
    assert not url.username
    assert chosen.token == TOKEN
    assert 0 <= chosen.have <= len(MODEL)
    assert chosen.size in (0, len(MODEL))


def json_values() -> st.SearchStrategy[Any]:
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=40)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
        max_leaves=12,
    )


def messages() -> st.SearchStrategy[bytes]:
    """Bytes from the bus: junk, JSON of any shape, and offers and queries nearly right."""
    near = st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["WeightsOffer", "WeightsQuery", "Heartbeat", ""]),
            "node": st.one_of(NODES, st.text(max_size=70)),
            "blob": st.sampled_from([BLOB, "../../etc/passwd", "sha256-" + "f" * 64, "", BLOB + "\n"]),
            "state": st.sampled_from(["held", "origin", "peer", "wanting", "stolen"]),
            "url": urls(ADDR_LIST),
            "token": st.text(max_size=40),
            "size": st.integers(min_value=-(1 << 70), max_value=1 << 70),
            "have": st.integers(min_value=-(1 << 70), max_value=1 << 70),
        },
        optional={"extra": json_values()},
    ).map(lambda d: json.dumps(d).encode())
    return st.one_of(st.binary(max_size=600), json_values().map(lambda v: json.dumps(v).encode()), near)


@FUZZ
@given(messages(), NODES)
def test_any_bytes_read_as_an_offer_or_a_query_of_their_sender_or_refused(data: bytes, sender: str) -> None:
    start = time.monotonic()
    try:
        offer = read_offer(data, sender, BLOB)
    except OfferRefused:
        pass
    else:
        assert offer.node == sender
        assert offer.blob == BLOB
    try:
        query = read_query(data, sender)
    except OfferRefused:
        pass
    else:
        assert query.node == sender
        assert query.size >= 0
        assert re.fullmatch(r"(sha256|gitsha1)-[0-9a-f]{40,64}", query.blob)
    assert time.monotonic() - start < 1


def test_a_message_too_big_is_refused_before_it_is_decoded() -> None:
    big = encode(WeightsOffer(node="n1", blob=BLOB, state="held", url="x" * MAX_MESSAGE_BYTES))
    with pytest.raises(OfferRefused, match=f"an offer of {len(big)} bytes from n1 \\(at most 4096\\)"):
        read_offer(big, "n1", BLOB)


def test_an_offer_or_a_query_in_another_nodes_name_is_refused() -> None:
    offer = encode(WeightsOffer(node="node-q", blob=BLOB, state="held", url="", token=TOKEN))
    with pytest.raises(OfferRefused, match=r"^an offer from node-z in the name of node-q$"):
        read_offer(offer, "node-z", BLOB)
    query = encode(WeightsQuery(node="node-q", blob=BLOB, size=1))
    with pytest.raises(OfferRefused, match=r"^a query from node-z in the name of node-q$"):
        read_query(query, "node-z")
    with pytest.raises(OfferRefused, match="not a node id"):
        sender_of("llmgw.weights.offer.a.b c")
    assert sender_of("llmgw.weights.offer.node-a.node-z") == "node-z"


def test_an_offer_is_read_only_on_its_nodes_address() -> None:
    def at(url: str) -> WeightsOffer:
        return WeightsOffer(node="n1", blob=BLOB, state="held", url=url, token=TOKEN, have=1, size=len(MODEL))

    size = len(MODEL)
    assert on_address(at(f"http://10.0.0.1:7000/blobs/{BLOB}"), BLOB, size, "10.0.0.1")
    assert on_address(at(f"http://[fd00::1]:7000/blobs/{BLOB}"), BLOB, size, "fd00::1")
    assert not on_address(at(f"http://10.0.0.9:7000/blobs/{BLOB}"), BLOB, size, "10.0.0.1")
    assert not on_address(at(f"http://10.0.0.1:7000/blobs/{BLOB}"), BLOB, size, "")  # no status
    assert not on_address(at(f"http://10.0.0.1:0/blobs/{BLOB}"), BLOB, size, "10.0.0.1")
    assert not on_address(at(f"http://10.0.0.1:7000/other/{BLOB}"), BLOB, size, "10.0.0.1")
    assert not on_address(at(f"http://10.0.0.1:7000/blobs/{BLOB}?a"), BLOB, size, "10.0.0.1")


def test_the_origin_comes_after_a_bounded_number_of_peers_or_time() -> None:
    t = Transfer(BLOB, len(MODEL), began=100.0)
    assert exhausted(t, 101.0, 60.0) == ""
    assert exhausted(t, 161.0, 60.0) == "61 s spent on peers (at most 60 s)"
    t.tries = PEER_TRIES
    assert exhausted(t, 101.0, 60.0) == f"{PEER_TRIES} peers tried"


# --- identities on a real nats-server ----------------------------------------------------------


@pytest.fixture
def hub() -> Iterator[Hub]:
    with hf_hub() as h:
        h.add("org/big", {"m.gguf": MODEL})
        yield h


async def node_bus(nats_url: str, prefix: str, tmp_path: Path, node: str) -> Bus:
    """A connection with `node`'s own identity (as a node's launcher has)."""
    cfg = agent_config(nats_url, prefix, tmp_path / node, node=node)
    return await Bus.connect(cfg.nats, service=f"launcher-{node}")


@pytest.mark.anyio
async def test_a_node_may_ask_and_offer_only_in_its_own_name(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    if session_for(nats_url) is None:
        pytest.skip("an external server without identities cannot tell nodes apart")
    forger = await node_bus(nats_url, prefix, tmp_path, "node-z")
    try:
        names = forger.names
        query = encode(WeightsQuery(node="node-a", blob=BLOB))
        for subject in (names.weights_query("node-a"), names.weights_offer("node-b", "node-a")):
            with pytest.raises(Exception, match="permission"):
                await forger.nc.request(subject, query, timeout=5)
        # Nor hear the answers meant for another node.
        await forger.nc.subscribe(names.weights_offer("node-a", ONE))
        await forger.nc.flush()
        refused = f"subscribe to {names.weights_offer('node-a', ONE)}"
        await eventually(lambda: refused in {f"{r.verb} {r.subject}" for r in forger.nc.refusals}, timeout=10)  # type: ignore[attr-defined]
    finally:
        await forger.close()


class Junk:
    """A server that accepts connections and never answers: it counts them."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for s in self.accepted:
            s.close()


async def forge(bus: Bus, node: str, junk: Junk) -> None:
    """Answer every query, as `node`: offers in invented names, an offer of another node's, then
    one in its own name that points to a server that never sends."""
    names = bus.names

    async def answer(msg: Any) -> None:
        asker = msg.subject.rsplit(".", 1)[-1]
        url = f"http://127.0.0.1:{junk.port}/blobs/{BLOB}"
        for i in range(50):
            fake = WeightsOffer(
                node=f"node-q{i}", blob=BLOB, state="held", url=url, token=TOKEN, size=len(MODEL)
            )
            await bus.nc.publish(names.weights_offer(asker, node), encode(fake))
        await bus.nc.publish(names.weights_offer(asker, "node-q0"), encode(fake))  # refused by the server
        own = WeightsOffer(node=node, blob=BLOB, state="held", url=url, token=TOKEN, size=len(MODEL))
        await bus.nc.publish(names.weights_offer(asker, node), encode(own))

    await bus.nc.subscribe(names.weights_query(ONE), cb=answer)


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["off-address", "on-address"])
async def test_nodes_answering_every_query_with_a_stalling_server_cost_a_bounded_number_of_tries(
    bus: Bus,
    nats_url: str,
    prefix: str,
    tmp_path: Path,
    hub: Hub,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    """Four node identities answer every query "held", under fifty invented names and their own,
    with a URL to a server that accepts and never sends. Off their status's address none is
    read; on it, each is tried once at most and PEER_TRIES in all, then the origin serves."""
    if session_for(nats_url) is None:
        pytest.skip("an external server without identities cannot tell nodes apart")
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    forgers = [f"node-x{i}" for i in range(4)]
    junks = {n: Junk() for n in forgers}
    buses: list[Bus] = []
    try:
        for node in forgers:
            b = await node_bus(nats_url, prefix, tmp_path, node)
            buses.append(b)
            # Each writes its own status (its key only): on the junk's address, or another.
            addr = "127.0.0.1" if where == "on-address" else "127.0.0.2"
            await b.put(
                b.names.nodes_bucket, node, NodeStatus(node=node, facts=NodeFacts(node=node, mgmt_addr=addr))
            )
            await forge(b, node, junks[node])
        await bus.put(
            bus.names.nodes_bucket,
            "node-a",
            NodeStatus(node="node-a", facts=NodeFacts(node="node-a", mgmt_addr="127.0.0.1")),
        )
        cfg = agent_config(nats_url, prefix, tmp_path / "node-a", node="node-a", weights_timeout_s=1.5)
        async with shard_events(bus) as events, running_launcher(cfg) as launcher:
            began = time.monotonic()
            spec = shard("node-a", "w", sim_profile(model="hf://org/big/m.gguf"))
            await bus.put(bus.names.shards_bucket, "node-a.w", spec)
            await eventually(lambda: events.states("w")[-1:] == ["ready"], timeout=90)
            took = time.monotonic() - began
            assert launcher.peers is not None
        tried = {n: len(j.accepted) for n, j in junks.items()}
        if where == "off-address":
            assert sum(tried.values()) == 0, tried
        else:
            assert max(tried.values()) == 1, tried
            assert sum(tried.values()) == PEER_TRIES, tried
        assert hub.state.served["m.gguf"] == len(MODEL)
        # The server refused the offer in another node's name.
        refused = {f"{r.verb} {r.subject}" for b in buses for r in b.nc.refusals}  # type: ignore[attr-defined]
        assert f"publish to {bus.names.weights_offer('node-a', 'node-q0')}" in refused
        assert took < 60
    finally:
        for b in buses:
            await b.close()
        for j in junks.values():
            j.close()


# --- the blob server's clients, with real sockets -------------------------------------------


@contextlib.contextmanager
def open_files_soft(n: int) -> Iterator[tuple[int, int]]:
    """This process's soft open-file limit set to `n` for a while (the hard one as it is)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= n:
        pytest.skip(f"the open-file hard limit is {hard}: nothing to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    try:
        yield soft, hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def closed_by_server(s: socket.socket, within_s: float) -> bytes | None:
    """What the server sent before it closed `s` within `within_s`; None if it is still open."""
    s.settimeout(within_s)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return got


@contextlib.asynccontextmanager
async def blob_server(bus: Bus, tmp_path: Path, **kw: Any) -> Any:
    blobs = tmp_path / "blobs"
    blobs.mkdir(exist_ok=True)
    (blobs / BLOB).write_bytes(MODEL)
    peers = Peers(bus, "node-a", blobs, "127.0.0.1", timeout_s=5.0, **kw)
    async with anyio.create_task_group() as tg:
        await tg.start(peers.run)
        try:
            yield peers
        finally:
            tg.cancel_scope.cancel()


async def fetch(peers: Peers) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        url = f"{peers.url}/blobs/{BLOB}"
        return await client.get(url, headers={"Authorization": f"Bearer {peers.grant(BLOB, 'node-b')}"})


def connect(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(n)]


@pytest.mark.anyio
async def test_1100_idle_connections_hold_at_most_the_cap_and_a_reader_is_still_served(
    bus: Bus, tmp_path: Path
) -> None:
    cap = 64
    with open_files_soft(1024) as (_soft, hard):
        async with blob_server(bus, tmp_path, max_connections=cap, header_timeout_s=60.0) as peers:
            # It raised its open-file limit, as a launcher at 1,024 files could not hold them.
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            first = await anyio.to_thread.run_sync(connect, peers.port, cap)
            await eventually(lambda: peers.connections == cap, timeout=10)
            later = await anyio.to_thread.run_sync(connect, peers.port, 1100 - cap)
            try:
                # Each newcomer closed the connection that had waited longest for its request.
                gone = await anyio.to_thread.run_sync(lambda: [closed_by_server(s, 10) for s in first])
                assert gone == [b""] * cap
                await eventually(lambda: peers.closed["evicted"] == 1100 - cap, timeout=10)
                assert peers.connections == cap
                # A reader gets its blob whole.
                r = await fetch(peers)
                assert r.status_code == 200
                assert r.content == MODEL
                assert peers.connections <= cap
                # Idle ones, and one that trickles its headers, are closed once their time is up.
                slow = connect(peers.port, 1)[0]
                later.append(slow)
                peers.header_timeout_s = 0.5
                for byte in b"GET /blobs/":
                    with contextlib.suppress(OSError):
                        slow.send(bytes([byte]))
                    await anyio.sleep(0.1)
                assert await anyio.to_thread.run_sync(closed_by_server, slow, 5) == b""
                await eventually(lambda: peers.connections == 0, timeout=10)
                assert await anyio.to_thread.run_sync(closed_by_server, later[-2], 5) == b""
                # The idle ones left, the trickling one (and the reader's, if it lingered idle).
                assert cap - 1 <= peers.closed["timed_out"] <= cap + 1
                assert peers.closed["refused"] == 0
            finally:
                for s in first + later:
                    s.close()


@pytest.mark.anyio
async def test_when_every_connection_sends_a_blob_a_new_one_is_refused_at_once(
    bus: Bus, tmp_path: Path
) -> None:
    async with blob_server(bus, tmp_path, max_connections=2, rate_bytes_s=50_000) as peers:
        token = peers.grant(BLOB, "node-b")
        readers = connect(peers.port, 2)
        try:
            for s in readers:  # each reads its blob slowly: 20 s at this rate
                s.sendall(
                    f"GET /blobs/{BLOB} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
                )
                s.recv(1)
            started = time.monotonic()
            extra = connect(peers.port, 1)[0]
            readers.append(extra)
            said = await anyio.to_thread.run_sync(closed_by_server, extra, 5)
            assert time.monotonic() - started < 2
            assert said is not None
            assert said.startswith(b"HTTP/1.1 503 ")
            assert peers.closed == {"evicted": 0, "refused": 1, "timed_out": 0}
            assert said.endswith(
                b"node-a serves 2 readers at once, all busy: read from another node, or later"
            )
        finally:
            for s in readers:
                s.close()
        # The readers gone, their threads end at their next write and a reader is served.
        await eventually(lambda: peers.connections == 0, timeout=10)
        peers.rate_bytes_s = 0
        r = await fetch(peers)
        assert r.status_code == 200
        assert r.content == MODEL


class _Peer(http.server.BaseHTTPRequestHandler):
    """A peer on the cluster's network that trickles a byte at a time, or points elsewhere."""

    body = b"x" * 16

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}/trickle")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for i in range(len(self.body)):
                self.wfile.write(self.body[i : i + 1])
                self.wfile.flush()
                time.sleep(0.1)


@pytest.fixture
def peer_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Peer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _fetch(url: str, blobs: Path, peer: str = "") -> Path:
    body = _Peer.body
    want = Want(
        name="m.gguf", url=url, size=len(body), algo="sha256", digest=hashlib.sha256(body).hexdigest()
    )
    return weights.fetch(want, blobs, "m", Progress("m"), threading.Event(), 1.0, peer=peer)


def test_a_peer_that_trickles_or_redirects_is_left_within_the_read_timeout(
    peer_server: str, tmp_path: Path
) -> None:
    """A byte every 0.1 s never trips a 1 s read timeout: the peer's rate does, after one
    window; a peer's redirect is not followed (it could send the node anywhere)."""
    started = time.monotonic()
    with pytest.raises(WeightsError, match=r"peer n1 .* under the .*/s a peer must send"):
        _fetch(f"{peer_server}/trickle", tmp_path, peer="n1")
    assert time.monotonic() - started < 3.0
    with pytest.raises(WeightsError, match="HTTP 302"):
        _fetch(f"{peer_server}/redirect", tmp_path, peer="n1")
    # The origin is not held to a peer's rate: the same server, slowly, is read whole.
    done = _fetch(f"{peer_server}/trickle", tmp_path)
    assert done.read_bytes() == _Peer.body


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.one_of(st.text(max_size=300), st.builds(lambda b: f"/blobs/{b}", st.text(max_size=80))),
    header=st.one_of(st.text(max_size=60), st.builds(lambda n: f"bytes={n}-", st.text(max_size=30))),
)
def test_a_blob_request_names_a_blob_or_nothing_and_a_range_a_bounded_start(path: str, header: str) -> None:
    """What a client sends the blob server, read: a path names a blob in the store's own form or
    is a 404; a `Range` is a start of at most 19 ASCII digits or the whole blob."""
    blob = blob_of(path)
    assert blob is None or (re.fullmatch(r"(sha256|gitsha1)-[0-9a-f]{40,64}", blob) and blob in path)
    start, rng = range_start(header)
    assert 0 <= start < 10**19
    assert (start, rng) == (0, "") or rng == header
    assert blob_of("/blobs/sha256-" + "a" * 64 + "?x=1") == "sha256-" + "a" * 64
    assert range_start("bytes=12-") == (12, "bytes=12-")
    assert range_start("bytes=²-") == (0, "")
