"""Weights shared inside the cluster: real launchers on the session's nats-server, each with its
own node identity, staging from a Hugging Face-shaped hub on loopback that counts the bytes it
sends. The origin is fetched once; a peer that stops mid-transfer is replaced; only nodes read."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import (
    NodeFacts,
    NodeStatus,
    ShardStatus,
    WeightsOffer,
    WeightsQuery,
    decoder,
    encode,
)
from llmgw_core.subjects import ONE
from llmgw_launcher import Launcher
from llmgw_launcher.peers import decide
from tests.auth_support import session_for
from tests.hf_server import Hub, hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

MODEL = hashlib.sha256(b"weights").digest() * (1 << 15)  # 1 MiB: an LFS file
SHA = hashlib.sha256(MODEL).hexdigest()
BLOB = f"sha256-{SHA}"


@pytest.fixture
def hub() -> object:
    with hf_hub() as h:
        h.add("org/big", {"m.gguf": MODEL})
        yield h


def staged(tmp_path: Path, node: str, hub: Hub) -> Path:
    commit = hub.state.repos["org/big"].commit
    return tmp_path / node / "models" / "hf" / "org" / "big" / commit / "files" / "m.gguf"


async def node_status(bus: Bus, node: str, mgmt_addr: str = "127.0.0.1") -> None:
    """The node's status as its installer writes it: other nodes read its blobs only on `mgmt_addr`."""
    facts = NodeFacts(node=node, mgmt_addr=mgmt_addr)
    await bus.put(bus.names.nodes_bucket, node, NodeStatus(node=node, facts=facts))


async def ask(bus: Bus, asker: str, timeout: float) -> WeightsOffer | None:
    """`asker`'s query for the model's blob, as a node asks: the first offer that comes, or None."""
    sub = await bus.nc.subscribe(bus.names.weights_offer(asker, ONE))
    try:
        query = WeightsQuery(node=asker, blob=BLOB, size=len(MODEL))
        await bus.nc.publish(bus.names.weights_query(asker), encode(query))
        msg = await sub.next_msg(timeout=timeout)
    except TimeoutError:  # nats-py's is one too
        return None
    finally:
        await sub.unsubscribe()
    return decoder(WeightsOffer).decode(msg.data)


async def place(bus: Bus, node: str, name: str) -> None:
    await node_status(bus, node)
    spec = shard(node, name, sim_profile(model="hf://org/big/m.gguf"))
    await bus.put(bus.names.shards_bucket, f"{node}.{name}", spec)


def config(nats_url: str, prefix: str, tmp_path: Path, node: str, **kw: object) -> object:
    return agent_config(nats_url, prefix, tmp_path / node, node=node, **kw)


# --- the choice, pure -----------------------------------------------------------------------


def offer(node: str, state: str, have: int = 0) -> WeightsOffer:
    return WeightsOffer(node=node, blob=BLOB, state=state, have=have)  # type: ignore[arg-type]


def test_a_holder_first_then_the_fetcher_then_the_smallest_id_among_those_who_want() -> None:
    assert decide("n2", [offer("n1", "wanting"), offer("n3", "held")], set()).node == "n3"  # type: ignore[union-attr]
    assert decide("n2", [offer("n1", "wanting"), offer("n3", "origin")], set()).node == "n3"  # type: ignore[union-attr]
    # Among nodes that all want it: the smallest id fetches the origin, the others follow it.
    assert decide("n2", [offer("n1", "wanting"), offer("n3", "wanting")], set()).node == "n1"  # type: ignore[union-attr]
    assert decide("n1", [offer("n2", "wanting"), offer("n3", "wanting")], set()) is None
    # A follower is not followed; a node that failed is not asked again.
    assert decide("n2", [offer("n1", "peer")], set()) is None
    assert decide("n2", [offer("n3", "held")], {"n3"}) is None
    # Holders are spread over readers, the same reader always picking the same holder.
    holders = [offer(f"h{i}", "held") for i in range(8)]
    picks = {decide(f"r{i}", holders, set()).node for i in range(32)}  # type: ignore[union-attr]
    assert len(picks) > 2


# --- through real launchers -------------------------------------------------------------------


async def test_two_nodes_staging_one_model_at_once_fetch_the_origin_once(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    async with (
        shard_events(bus) as events,
        running_launcher(config(nats_url, prefix, tmp_path, "node-a")),  # type: ignore[arg-type]
        running_launcher(config(nats_url, prefix, tmp_path, "node-b")),  # type: ignore[arg-type]
    ):
        async with anyio.create_task_group() as tg:
            tg.start_soon(place, bus, "node-a", "w1")
            tg.start_soon(place, bus, "node-b", "w2")
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=60)
        await eventually(lambda: events.states("w2")[-1:] == ["ready"], timeout=60)
    assert staged(tmp_path, "node-a", hub).read_bytes() == MODEL
    assert staged(tmp_path, "node-b", hub).read_bytes() == MODEL
    assert hub.state.served["m.gguf"] == len(MODEL)


async def test_four_nodes_staging_one_model_at_once_fetch_the_origin_once(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    nodes = [f"node-{c}" for c in "abcd"]
    async with shard_events(bus) as events, contextlib.AsyncExitStack() as stack:
        for node in nodes:
            # A generous window for the answers: this machine is shared and loaded.
            cfg = config(nats_url, prefix, tmp_path, node, weights_peer_window_s=1.0)
            await stack.enter_async_context(running_launcher(cfg))  # type: ignore[arg-type]
        async with anyio.create_task_group() as tg:
            for i, node in enumerate(nodes):
                tg.start_soon(place, bus, node, f"w{i}")
        for i in range(len(nodes)):
            await eventually(lambda i=i: events.states(f"w{i}")[-1:] == ["ready"], timeout=90)
    for node in nodes:
        assert staged(tmp_path, node, hub).read_bytes() == MODEL
    assert hub.state.served["m.gguf"] == len(MODEL)


async def test_a_node_stages_from_a_peer_that_holds_the_model_and_says_so(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    async with (
        shard_events(bus) as events,
        running_launcher(config(nats_url, prefix, tmp_path, "node-a")) as a,  # type: ignore[arg-type]
        running_launcher(config(nats_url, prefix, tmp_path, "node-b")),  # type: ignore[arg-type]
    ):
        await place(bus, "node-a", "w1")
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=60)
        assert a.peers is not None
        a.peers.rate_bytes_s = 300_000  # slow enough that node-b's progress is seen
        await place(bus, "node-b", "w2")

        async def progress() -> str:
            got = await bus.get(bus.names.shard_status_bucket, "node-b.w2", ShardStatus)
            return got[0].reason if got and "downloading" in got[0].reason else ""

        label = f"big@{hub.state.repos['org/big'].commit[:6]}"
        words = await eventually(progress, timeout=60)
        assert words.startswith(f"weights {label}: downloading m.gguf from node-a ("), words
        await eventually(lambda: events.states("w2")[-1:] == ["ready"], timeout=60)
        assert a.peers.served_bytes == len(MODEL)
    assert staged(tmp_path, "node-b", hub).read_bytes() == MODEL
    assert hub.state.served["m.gguf"] == len(MODEL)


async def launcher_until(
    cfg: object, stop: anyio.Event, *, task_status: anyio.abc.TaskStatus[Launcher] = anyio.TASK_STATUS_IGNORED
) -> None:
    """A launcher in a task of its own, until `stop`: one can stop while the others go on."""
    async with running_launcher(cfg) as launcher:  # type: ignore[arg-type]
        task_status.started(launcher)
        await stop.wait()


async def test_a_peer_that_stops_mid_transfer_is_replaced_by_another_and_the_bytes_verified(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    holders = ["node-a", "node-b"]
    # The holder node-c picks first (the choice is the same every time for one reader).
    first = decide("node-c", [offer(n, "held") for n in holders], set())
    assert first is not None
    other = next(n for n in holders if n != first.node)
    stops = {n: anyio.Event() for n in [*holders, "node-c"]}
    async with shard_events(bus) as events, anyio.create_task_group() as tg:
        launchers: dict[str, Launcher] = {}
        for i, node in enumerate(holders):
            cfg = config(nats_url, prefix, tmp_path, node)
            launchers[node] = await tg.start(launcher_until, cfg, stops[node])
            await place(bus, node, f"h{i}")
            await eventually(lambda i=i: events.states(f"h{i}")[-1:] == ["ready"], timeout=60)
        assert hub.state.served["m.gguf"] == len(MODEL)
        dying, survivor = launchers[first.node].peers, launchers[other].peers
        assert dying is not None
        assert survivor is not None
        served_before, dying_before = survivor.served_bytes, dying.served_bytes
        dying.rate_bytes_s = 200_000  # about 5 s for the model: it stops well before the end
        await tg.start(launcher_until, config(nats_url, prefix, tmp_path, "node-c"), stops["node-c"])
        await place(bus, "node-c", "w")
        await eventually(lambda: dying.served_bytes - dying_before > 100_000, timeout=60)
        stops[first.node].set()  # its launcher stops: the transfer breaks off
        await eventually(lambda: events.states("w")[-1:] == ["ready"], timeout=60)
        cut = dying.served_bytes - dying_before
        # The rest came from the other holder, resumed where the first left off; none from the origin.
        assert 0 < cut < len(MODEL)
        assert survivor.served_bytes - served_before == len(MODEL) - cut
        assert hub.state.served["m.gguf"] == len(MODEL)
        for stop in stops.values():
            stop.set()
    assert staged(tmp_path, "node-c", hub).read_bytes() == MODEL


async def test_a_reader_that_is_not_a_cluster_node_is_refused(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    async with (
        shard_events(bus) as events,
        running_launcher(config(nats_url, prefix, tmp_path, "node-a")) as a,  # type: ignore[arg-type]
    ):
        await place(bus, "node-a", "w1")
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=60)
        assert a.peers is not None
        url = f"{a.peers.url}/blobs/{BLOB}"
        async with httpx.AsyncClient() as client:
            for headers in ({}, {"Authorization": "Bearer not-a-token"}):
                r = await client.get(url, headers=headers)
                assert r.status_code == 401
                assert r.text == (
                    "node-a serves weights only to the cluster's nodes: ask on "
                    f"{bus.names.weights_query('<your node>')} for a token (as that node's identity)"
                )
            # A token for one blob reads no other.
            token = a.peers.grant(BLOB)
            other = f"{a.peers.url}/blobs/sha256-{'0' * 64}"
            assert (await client.get(other, headers={"Authorization": f"Bearer {token}"})).status_code == 401
        session = session_for(nats_url)
        if session is None:
            return  # an external server without identities: the bus cannot tell nodes from others
        # An identity that is not a node may not ask: nats-server refuses the query.
        auth = session.dirs[prefix]
        observer = await Bus.connect(
            BusOptions(url=session.url, prefix=prefix, nkey_seed_file=str(auth.seed("observer"))),
            service="observer",
        )
        try:
            query = WeightsQuery(node="node-z", blob=BLOB, size=len(MODEL))
            with pytest.raises(Exception, match="permission"):
                await observer.nc.request(bus.names.weights_query("node-z"), encode(query), timeout=5)
        finally:
            await observer.close()
        # A node's own identity is answered, and the token it gets reads the blob, ranges too.
        session.add_node(prefix, "node-b")
        node_b = await Bus.connect(
            BusOptions(url=session.url, prefix=prefix, nkey_seed_file=str(auth.node_seed("node-b"))),
            service="launcher-node-b",
        )
        try:
            got = await ask(node_b, "node-b", timeout=10)
        finally:
            await node_b.close()
        assert got is not None
        assert (got.node, got.state, got.have) == ("node-a", "held", len(MODEL))
        async with httpx.AsyncClient() as client:
            r = await client.get(
                got.url, headers={"Authorization": f"Bearer {got.token}", "Range": "bytes=1000-"}
            )
        assert r.status_code == 206
        assert r.content == MODEL[1000:]


async def test_when_the_only_peer_stops_mid_transfer_the_rest_comes_from_the_origin(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    stops = {n: anyio.Event() for n in ("node-a", "node-b")}
    async with shard_events(bus) as events, anyio.create_task_group() as tg:
        a = await tg.start(launcher_until, config(nats_url, prefix, tmp_path, "node-a"), stops["node-a"])
        await place(bus, "node-a", "w1")
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=60)
        assert a.peers is not None
        a.peers.rate_bytes_s = 200_000
        await tg.start(launcher_until, config(nats_url, prefix, tmp_path, "node-b"), stops["node-b"])
        await place(bus, "node-b", "w2")
        await eventually(lambda: a.peers is not None and a.peers.served_bytes > 100_000, timeout=60)
        stops["node-a"].set()
        await eventually(lambda: events.states("w2")[-1:] == ["ready"], timeout=60)
        cut = a.peers.served_bytes
        stops["node-b"].set()
    # node-b asked the origin only for what node-a had not sent.
    resumed = [r for f, r in hub.state.gets if f == "m.gguf" and r]
    assert len(resumed) == 1
    start = int(resumed[0].removeprefix("bytes=").removesuffix("-"))
    assert 0 < start <= cut < len(MODEL)
    assert hub.state.served["m.gguf"] == len(MODEL) + len(MODEL) - start
    assert staged(tmp_path, "node-b", hub).read_bytes() == MODEL


async def test_bytes_a_peer_sends_wrong_are_discarded_and_fetched_again(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    async with (
        shard_events(bus) as events,
        running_launcher(config(nats_url, prefix, tmp_path, "node-a")) as a,  # type: ignore[arg-type]
        running_launcher(config(nats_url, prefix, tmp_path, "node-b")),  # type: ignore[arg-type]
    ):
        await place(bus, "node-a", "w1")
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=60)
        # node-a's copy rots on its disk after it was verified.
        blob = tmp_path / "node-a" / "models" / "blobs" / BLOB
        rotten = bytearray(blob.read_bytes())
        rotten[12345] ^= 0xFF
        blob.write_bytes(bytes(rotten))
        await place(bus, "node-b", "w2")
        await eventually(lambda: events.states("w2")[-1:] == ["ready"], timeout=60)
        assert a.peers is not None
        assert a.peers.served_bytes == len(MODEL)
    # node-b hashed what node-a sent, discarded it, and fetched the file from the origin.
    assert staged(tmp_path, "node-b", hub).read_bytes() == MODEL
    assert hub.state.served["m.gguf"] == 2 * len(MODEL)


async def test_a_peer_killed_mid_transfer_is_gone_on_with_from_the_origin(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder is a launcher process of its own, SIGKILLed while it sends."""
    import msgspec

    from llmgw_core.engines import parse_source
    from llmgw_launcher.weights import Weights
    from tests.launcher_support import start_launcher_process

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    source = parse_source("hf://org/big/m.gguf")
    assert source is not None
    await Weights(tmp_path / "node-a" / "models", environ={"HF_ENDPOINT": hub.url}).stage(
        source, lambda _w: None
    )
    holder_cfg = config(nats_url, prefix, tmp_path, "node-a", weights_serve_bytes_s=200_000)
    config_path = tmp_path / "node-a.yaml"
    config_path.write_bytes(msgspec.yaml.encode(holder_cfg))
    holder = start_launcher_process(config_path, tmp_path / "node-a.log")
    try:

        async def holds() -> bool:
            got = await ask(bus, "harness", timeout=1)
            return got is not None and got.state == "held"

        await node_status(bus, "node-a")
        await eventually(holds, timeout=60)
        partial = tmp_path / "node-b" / "models" / "blobs" / f"{BLOB}.partial"
        async with (
            shard_events(bus) as events,
            running_launcher(config(nats_url, prefix, tmp_path, "node-b")),  # type: ignore[arg-type]
        ):
            await place(bus, "node-b", "w")
            await eventually(lambda: partial.exists() and partial.stat().st_size > 100_000, timeout=60)
            holder.kill()
            holder.wait(timeout=30)
            await eventually(lambda: events.states("w")[-1:] == ["ready"], timeout=90)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
    resumed = [r for f, r in hub.state.gets if f == "m.gguf" and r]
    assert len(resumed) == 1
    start = int(resumed[0].removeprefix("bytes=").removesuffix("-"))
    assert 100_000 < start < len(MODEL)
    assert hub.state.served["m.gguf"] == len(MODEL) + len(MODEL) - start
    assert staged(tmp_path, "node-b", hub).read_bytes() == MODEL
