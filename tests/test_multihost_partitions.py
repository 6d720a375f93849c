"""Partitions between real hosts (network namespaces, tests/multihost): each test cuts the
network where a fleet spread over hosts can be cut, heals it, and runs the history checker
(tests/multihost/checker.py) over everything the run left: nothing lost, nothing doubled,
one placement acting per lease term, no engine left running where its replica moved, and
ready again within a stated time. Where a side must stop (CAP), the test says which, and what
it says while stopped. docs/reliability.md, "Partitions", has one row per test.

Every process is given the NATS servers it talks to, so that which side of a cut it is on is
the test's choice, not the client library's random pick of a server.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, NodeStatus, ReplicaRecord
from tests.cluster_support import sim_catalog
from tests.multihost.checker import Ack, Convergence, assert_holds
from tests.multihost.fleet import NATS_PORT, Fleet
from tests.multihost.history import History, Recorder, engines, read
from tests.multihost.hosts import Hosts
from tests.waiting import eventually

# A fleet of ten processes on up to ten hosts (two cores shared with the rest of the suite),
# and a partition held past node_timeout_s: over the per-commit minute on a busy machine.
pytestmark = [pytest.mark.multihost, pytest.mark.anyio, pytest.mark.slow, pytest.mark.timeout(300)]

NATS = ("a", "b", "c")
NODE_TIMEOUT_S = 3.0
# How soon after a heal the deployment must be ready as wanted again: a node timeout to hear
# the healed side, a control step, and a sim engine's start, with room for a busy machine.
CONVERGE_S = 45.0
# How long the test reads the lease's holder again where a read times out.
HOLDER_READ_S = 15.0
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(replicas: int = 1, **more: Any) -> list[dict[str, Any]]:
    return [{"name": "chat", "profile": "tiny", "replicas": replicas, **more}]


@dataclass
class Run:
    net: Hosts
    fleet: Fleet

    def url(self, *hosts: str) -> str:
        return ",".join(f"nats://{self.net[h].addr}:{NATS_PORT}" for h in hosts)

    def nats(self, identity: str, *hosts: str) -> dict[str, Any]:
        """The `nats:` section of `identity`, talking to the servers on `hosts` only."""
        return {**self.fleet.nats(identity), "url": self.url(*hosts)}

    def placement(self, host: str, identity: str, *servers: str, deployments: Any = None) -> None:
        extra = {"nats": self.nats("placement", *servers)}
        deployments = chat() if deployments is None else deployments
        self.fleet.start_placement(host, identity, [sim_catalog()], deployments, extra=extra)

    def node(self, host: str, node: str, *servers: str, gpus: int = 1) -> None:
        self.fleet.start_node(host, node, gpus=gpus, extra={"nats": self.nats(f"node-{node}", *servers)})

    def gateway(self, host: str, name: str, *servers: str) -> None:
        self.fleet.start_gateway(host, name, nats=self.nats("gateway", *servers))

    def state_dirs(self) -> list[Path]:
        return [h.state / n for h in self.net for n in ("n1", "n2")]

    def running(self, host: str, node: str) -> list[int]:
        """Engine pids node `node`'s launcher keeps records of that still run."""
        found, _ = engines(self.net[host].state / node)
        return [pid for e in found for pid in e.running]

    async def stopped(self, host: str, node: str) -> None:
        """Once node `node`'s engines have stopped after a heal; if they have not within
        CONVERGE_S, the failure carries what its launcher said (its watches' outages and
        reopenings, its shard specs' deletes) and placement's log."""
        try:
            await eventually(lambda: not self.running(host, node), timeout=CONVERGE_S, interval=0.3)
        except AssertionError as exc:
            said = "\n".join(
                f"--- {name}\n{self.fleet.log(name)[-4000:]}" for name in (f"launcher-{node}", "placement-p1")
            )
            raise AssertionError(f"{node}'s engines still run: {self.running(host, node)}\n{said}") from exc

    @contextlib.asynccontextmanager
    async def recording(self, *servers: str) -> AsyncIterator[tuple[Bus, Recorder]]:
        """The test's connection (as `ctl`, to `servers`), and a recorder over it."""
        options = BusOptions(
            url=self.url(*servers),
            prefix=self.fleet.prefix,
            nkey_seed_file=str(self.fleet.auth.seed("ctl")),
            replicas=self.fleet.replicas,
        )
        async with await Bus.connect(options, service="partition-test") as bus:
            recorder = Recorder(bus, interval=0.3)
            async with anyio.create_task_group() as tg:
                await tg.start(recorder.run)
                yield bus, recorder
                tg.cancel_scope.cancel()


def start(make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet], *hosts: str) -> Run:
    net = make_hosts(*NATS, *hosts)
    fleet = make_fleet(net, node_timeout_s=NODE_TIMEOUT_S)
    fleet.start_nats(NATS)
    return Run(net, fleet)


async def ready(bus: Bus, count: int = 1, *, on: tuple[str, ...] = (), timeout: float = 90) -> dict[str, str]:
    """Once `count` replicas of chat are ready (and no more), on the nodes `on` when given:
    replica key -> its node."""

    async def found() -> dict[str, str]:
        entries = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
        nodes = {
            k: c.value.members[0].node for k, c in entries.items() if c.value and c.value.state == "ready"
        }
        assert len(nodes) == count, nodes
        assert not on or sorted(nodes.values()) == sorted(on), nodes
        return nodes

    return await eventually(found, timeout=timeout, interval=0.3)


async def installed(bus: Bus, node: str) -> None:
    """Once `node` says its engines are installed: placement may place on it from then."""

    async def said() -> bool:
        try:
            found = await bus.get(bus.names.nodes_bucket, node, NodeStatus)
        except BusError as exc:  # placement has not made the bucket yet
            raise AssertionError(str(exc)) from exc
        states = [e.state for e in found[0].engines] if found else []
        assert states, f"{node} has said nothing of its engines yet"
        assert set(states) <= {"installed", "configured"}, states
        return True

    await eventually(said, timeout=60, interval=0.3)


async def spread_over_both(bus: Bus) -> None:
    """chat, 2 replicas spread, written once n1 and n2 can both take one: one on each."""
    for node in ("n1", "n2"):
        await installed(bus, node)
    chat2 = Deployment(name="chat", profile="tiny", replicas=2, strategy="spread")
    await bus.put(bus.names.deployments_bucket, "chat", chat2)
    await ready(bus, 2, on=("n1", "n2"))


async def holder(bus: Bus) -> str:
    """The placement lease's holder now. Read again (for up to HOLDER_READ_S) where a read times
    out: asked just after a heal, the server may still be catching up its streams."""
    deadline = time.monotonic() + HOLDER_READ_S
    while True:
        try:
            found = await bus.revisions(bus.names.leases_bucket, "placement")
            return (found[0][1] or b"").decode() if found else ""
        except BusError:
            if time.monotonic() > deadline:
                raise
            await anyio.sleep(0.5)


def terms(history: History) -> list[str]:
    """The lease's holders, in the order they took it."""
    out: list[str] = []
    for r in history.of("leases"):
        if r.key == "placement" and r.value is not None and (not out or out[-1] != r.value.decode()):
            out.append(r.value.decode())
    return out


async def health(url: str) -> tuple[int, str]:
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.get(f"{url}/healthz")
    return r.status_code, r.text


async def test_the_leader_cut_off_from_the_nats_majority_stands_down_and_a_standby_leads(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """p1 leads through NATS server a; a and p1's host are cut from b and c (nodes still reach
    everyone). p1 cannot renew on a minority server: within a lease period it stops saying it
    leads, p2 (on the majority) takes the lease, the replica is neither moved nor doubled, and
    after the heal p1 finds the lease taken and stands by."""
    run = start(make_hosts, make_fleet, "p", "q", "d", "e")
    run.placement("p", "p1", "a")
    run.node("d", "n1", "b", "c")
    run.node("e", "n2", "b", "c")
    async with run.recording("b", "c") as (bus, recorder):
        before = await ready(bus)
        await eventually(lambda: holder(bus), timeout=10)
        assert await holder(bus) == "p1"
        run.placement("q", "p2", "b", "c")
        p1 = await run.fleet.placement_url("p1")
        await run.fleet.placement_url("p2")

        run.net["a"].cut(run.net["b"], run.net["c"])
        run.net["p"].cut(run.net["b"], run.net["c"])

        async def p2_leads() -> bool:
            assert await holder(bus) == "p2"
            return True

        await eventually(p2_leads, timeout=30, interval=0.3)

        async def p1_says_why() -> str:
            # Still leading but unproven, or stood down and unable to read the lease: either
            # way no load balancer should send to it.
            code, text = await health(p1)
            assert code == 503, text
            return text

        text = await eventually(p1_says_why, timeout=15, interval=0.3)
        why = "does not lead until a renewal lands|cannot reach NATS|no answer from NATS"
        assert re.search(why, text), text
        assert await ready(bus) == before

        run.net["a"].heal()
        run.net["p"].heal()
        healed_at = time.time()
        await eventually(lambda: "standing by" in run.fleet.log("placement-p1"), timeout=30, interval=0.3)
        assert await holder(bus) == "p2"
        assert await ready(bus) == before
        history = await read(bus, run.state_dirs(), recorder)
    assert terms(history)[-2:] == ["p1", "p2"]
    assert_holds(history, converge=Convergence({"chat": 1}, healed_at, CONVERGE_S))


async def test_a_node_cut_off_past_its_timeout_loses_its_replica_and_stops_its_engine_on_heal(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """The node holding the replica is cut from everything for longer than node_timeout_s:
    the replica is placed again on the other node under a new id; the cut node hears nothing,
    so its engine runs on until the heal, and then its launcher stops it (not doubled)."""
    run = start(make_hosts, make_fleet, "p", "d", "e")
    run.placement("p", "p1", *NATS)
    run.node("d", "n1", *NATS)
    run.node("e", "n2", *NATS)
    async with run.recording(*NATS) as (bus, recorder):
        [(key, node)] = (await ready(bus)).items()
        host = "d" if node == "n1" else "e"
        assert run.running(host, node)
        run.net[host].cut()
        other = "n2" if node == "n1" else "n1"
        [moved] = await ready(bus, on=(other,), timeout=60)
        assert moved != key
        # Cut off, the node cannot know its replica moved: its engine still runs.
        assert run.running(host, node)

        run.net[host].heal()
        healed_at = time.time()
        await run.stopped(host, node)
        history = await read(bus, run.state_dirs(), recorder)
    assert terms(history) == ["p1"]
    assert_holds(history, converge=Convergence({"chat": 1}, healed_at, CONVERGE_S))


async def requests(url: str, until: anyio.Event, results: list[tuple[float, int]]) -> None:
    """Chat requests to the gateway at `url`, one after another until `until`: (when it was
    sent, its status; 0 for no answer), each given 30 s (a gateway holds a request while its
    deployment has no ready replica)."""
    async with httpx.AsyncClient(timeout=30) as client:
        while not until.is_set():
            sent = time.monotonic()
            try:
                r = await client.post(f"{url}/v1/chat/completions", json=CHAT)
                results.append((sent, r.status_code))
            except httpx.HTTPError:
                results.append((sent, 0))
            await anyio.sleep(0.1)


async def test_a_node_cut_off_from_nats_but_not_from_the_gateway_is_served_until_its_replica_moves(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """n1 holds the replica and is cut from the NATS hosts only; the gateway (on g) still reaches
    it. Placement hears n1 go silent: the replica is `unknown` (the gateway still routes to it),
    then after node_timeout_s placed on n2; the gateway follows the bucket. Requests succeed
    throughout but for the moment of the move; after the heal n1's old engine is stopped."""
    run = start(make_hosts, make_fleet, "p", "d", "e", "g")
    run.placement("p", "p1", *NATS)
    run.node("d", "n1", *NATS)
    run.gateway("g", "g1", *NATS)
    async with run.recording(*NATS) as (bus, recorder):
        [(key, _)] = (await ready(bus)).items()
        run.node("e", "n2", *NATS)
        await installed(bus, "n2")
        gateway = await run.fleet.gateway_url("g1")
        done, results = anyio.Event(), list[tuple[float, int]]()
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests, gateway, done, results)
            await eventually(lambda: results and results[-1][1] == 200, timeout=30, interval=0.2)
            cut_at = time.monotonic()
            run.net["d"].cut(*(run.net[h] for h in NATS))
            [moved] = await ready(bus, on=("n2",), timeout=60)
            assert moved != key
            moved_at = time.monotonic()
            await eventually(lambda: results[-1][0] > moved_at + 3, timeout=30, interval=0.2)
            done.set()
        during = [s for t, s in results if t >= cut_at]
        after = [s for t, s in results if t >= moved_at + 2]
        assert after, "requests were answered after the move"
        assert set(after) == {200}, after
        # Between the old replica's removal and the new one's start the gateway holds requests.
        assert during.count(200) == len(during), [(round(t - cut_at, 1), s) for t, s in results if s != 200]
        run.net["d"].heal()
        healed_at = time.time()
        await run.stopped("d", "n1")
        history = await read(bus, run.state_dirs(), recorder)
    assert_holds(history, converge=Convergence({"chat": 1}, healed_at, CONVERGE_S))


async def test_a_gateway_cut_off_from_nats_serves_what_it_knew_and_says_so(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """The gateway is cut from every NATS server, not from the node: it serves the replicas it
    knew for as long as the cut lasts (here past three node timeouts), and its `/healthz`,
    still 200, says it is cut off from NATS and for how long; after the heal, no more."""
    run = start(make_hosts, make_fleet, "p", "d", "g")
    run.placement("p", "p1", *NATS)
    run.node("d", "n1", *NATS)
    run.gateway("g", "g1", *NATS)
    async with run.recording(*NATS) as (bus, recorder):
        await ready(bus)
        gateway = await run.fleet.gateway_url("g1")
        assert await health(gateway) == (200, '{"status":"ok","deployments":["chat"]}')
        run.net["g"].cut(*(run.net[h] for h in NATS))
        cut_at = time.monotonic()

        async def says_so() -> dict[str, Any]:
            code, text = await health(gateway)
            assert code == 200, text
            said = dict(json.loads(text))
            assert said.get("nats", "").startswith("cut off from NATS for "), said
            return said

        said = await eventually(says_so, timeout=30, interval=0.5)
        assert said["nats"].endswith(" s: serving the replicas it knew then"), said

        async def served() -> bool:
            async with httpx.AsyncClient(timeout=10) as client:
                r = await client.post(f"{gateway}/v1/chat/completions", json=CHAT)
            assert r.status_code == 200, r.text
            assert time.monotonic() - cut_at > 3 * NODE_TIMEOUT_S
            return True

        await eventually(served, timeout=30, interval=0.5)
        run.net["g"].heal()
        healed_at = time.time()

        async def heard_again() -> bool:
            assert await health(gateway) == (200, '{"status":"ok","deployments":["chat"]}')
            return True

        await eventually(heard_again, timeout=30, interval=0.5)
        history = await read(bus, run.state_dirs(), recorder)
    assert_holds(history, converge=Convergence({"chat": 1}, healed_at, CONVERGE_S))


async def test_one_nats_server_cut_from_the_other_two_leaves_the_majority_working(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """Server c is cut from a and b. The majority side keeps working: p1 (on a, b) leads on,
    a write through it is acknowledged, n1's replica serves on. What talks only to c stops:
    p2 cannot take the lease, n2 (its heartbeats reach no one) is lost, and its replica is
    placed again on n1; after the heal n2's old engine is stopped."""
    run = start(make_hosts, make_fleet, "p", "q", "d", "e")
    run.placement("p", "p1", "a", "b", deployments=[])
    run.node("d", "n1", "a", "b", gpus=2)
    run.node("e", "n2", "c")
    async with run.recording("a", "b") as (bus, recorder):
        await spread_over_both(bus)
        run.placement("q", "p2", "c", deployments=[])
        await run.fleet.placement_url("p2")

        run.net["c"].cut(run.net["a"], run.net["b"])
        await ready(bus, 2, on=("n1", "n1"), timeout=60)
        assert await holder(bus) == "p1"
        deployment = await bus.get(bus.names.deployments_bucket, "chat", Deployment)
        assert deployment is not None
        acked = Ack("deployments", "chat", await bus.put(bus.names.deployments_bucket, "chat", deployment[0]))

        run.net["c"].heal()
        healed_at = time.time()
        await run.stopped("e", "n2")
        history = await read(bus, run.state_dirs(), recorder)
    assert terms(history) == ["p1"]
    assert_holds(history, acks=[acked], converge=Convergence({"chat": 2}, healed_at, CONVERGE_S))


async def test_a_symmetric_split_under_load_keeps_the_majority_half_serving(
    make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    """Hosts split in two: {a, b, p1, n1, g1} and {c, p2, n2, g2}, clients on both gateways.
    Placements and nodes are given every server: whichever they were on, they go on through
    one their half still reaches.
    The half with two NATS servers keeps leading and moves n2's replica onto n1; the other
    half cannot write, and its gateway serves only what it still reaches. After the heal:
    one lease holder per term, no replica doubled, n2's old engine stopped, 2 ready."""
    run = start(make_hosts, make_fleet, "p", "q", "d", "e", "g", "h")
    run.placement("p", "p1", *NATS, deployments=[])
    run.node("d", "n1", *NATS, gpus=2)
    run.node("e", "n2", *NATS)
    # Each gateway talks to its own half's servers: one whose server is across the cut routes
    # on its last snapshot until it finds the connection dead (the gateway-cut test's case).
    run.gateway("g", "g1", "a", "b")
    run.gateway("h", "g2", "c")
    async with run.recording("a", "b") as (bus, recorder):
        await spread_over_both(bus)
        run.placement("q", "p2", *NATS, deployments=[])
        g1, g2 = await run.fleet.gateway_url("g1"), await run.fleet.gateway_url("g2")
        done = anyio.Event()
        one: list[tuple[float, int]] = []
        two: list[tuple[float, int]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(requests, g1, done, one)
            tg.start_soon(requests, g2, done, two)
            await eventually(lambda: one and two, timeout=30, interval=0.2)
            cut_at = time.monotonic()
            for host in ("a", "b", "p", "d", "g"):
                run.net[host].cut(*(run.net[h] for h in ("c", "q", "e", "h")))
            await ready(bus, 2, on=("n1", "n1"), timeout=60)
            moved_at = time.monotonic()
            await eventually(lambda: one[-1][0] > moved_at + 3, timeout=30, interval=0.2)
            done.set()
        assert await holder(bus) == "p1"
        after = [s for t, s in one if t >= moved_at + 2]
        assert after, "requests were answered after the move"
        assert set(after) == {200}, after
        minority = [s for t, s in two if t >= cut_at]
        assert minority, "the minority's gateway was asked during the split"
        for host in ("a", "b", "p", "d", "g"):
            run.net[host].heal()
        healed_at = time.time()
        await run.stopped("e", "n2")
        history = await read(bus, run.state_dirs(), recorder)
    assert_holds(history, converge=Convergence({"chat": 2}, healed_at, CONVERGE_S))
