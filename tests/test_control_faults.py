"""The control plane under ordinary faults: deletions mid-step, bad input, launcher silence,
replica ids across failovers and leaders, and desired state that no restart rewrites.

Placements run in-process (each with its own NATS connection) over simulated
fleets on the real protocol; the faults are real: KV deletes and purges,
values written by hand, heartbeats that stop.
"""

from __future__ import annotations

import random
import time

import anyio
import msgspec
import pytest

from llmgw import ctl
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import (
    Deployment,
    NodeFacts,
    NodeStatus,
    PlacementDecision,
    ReplicaRecord,
    ReplicaStatus,
    decoder,
)
from llmgw_placement.controller import ClusterState, Controller
from tests.control_support import TP1, control_plane, dlq, ready_replicas, replicas, server_config
from tests.waiting import eventually, passes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def test_deployments_deleted_at_any_moment_never_stop_placement(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression: a deployment deleted while a step awaited its writes raised KeyError and
    placement exited (the standby then died the same way)."""
    rng = random.Random(8)
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet([f"n{i}" for i in range(4)], gpus=8)
        a = await cp.start_placement("a")
        b = await cp.start_placement("b")
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        kv = await bus.kv(bus.names.deployments_bucket)
        names = [f"d{i}" for i in range(6)]
        with anyio.fail_after(60):
            for _ in range(60):
                name = rng.choice(names)
                action = rng.random()
                if action < 0.5:
                    await bus.put(
                        bus.names.deployments_bucket,
                        name,
                        Deployment(name=name, profile="tp1", replicas=rng.randint(0, 4)),
                    )
                elif action < 0.8:
                    await kv.delete(name)
                else:
                    await kv.purge(name)
                await anyio.sleep(rng.uniform(0.0, 0.15))
        left = {k: c.value for k, c in (await bus.entries(bus.names.deployments_bucket, Deployment)).items()}
        wanted = {name: dep.replicas for name, dep in left.items() if dep is not None}

        async def converged() -> bool:
            found = await replicas(bus)
            per: dict[str, int] = {}
            for r in found.values():
                assert r.deployment in wanted, f"replica {r.deployment}.{r.replica} of a deleted deployment"
                if r.state == "ready":
                    per[r.deployment] = per.get(r.deployment, 0) + 1
            assert per == {k: v for k, v in wanted.items() if v}, (per, wanted)
            shards = await bus.entries(bus.names.shards_bucket, ShardSpec)
            assert all(c.value is not None and c.value.deployment in wanted for c in shards.values())
            assert sum(per.values()) == len(shards) == len(found), (
                "one shard per TP=1 replica, none left over"
            )
            return True

        await eventually(converged, timeout=60, interval=0.3)
        assert cp.crashes() == []
        assert not a.stopped.is_set()
        assert not b.stopped.is_set()
        assert len(cp.leaders()) == 1


async def test_bad_desired_state_is_dead_lettered_and_causes_nothing(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=8)
        p = await cp.start_placement("a", max_replicas=20)
        await eventually(lambda: p.service.controller is not None, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2)
        )
        await eventually(lambda: ready_replicas(bus, "chat"), timeout=20)
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 2), timeout=20)
        before = set(await replicas(bus))
        kv = await bus.kv(bus.names.deployments_bucket)
        # A body that disagrees with its key: placed and removed in a loop before.
        await bus.put(
            bus.names.deployments_bucket, "evil", Deployment(name="docs", profile="tp1", replicas=1)
        )
        # An empty value is not a delete: chat keeps its replicas.
        await kv.put("chat", b"")
        # Over the configured maximum.
        await bus.put(
            bus.names.deployments_bucket, "huge", Deployment(name="huge", profile="tp1", replicas=21)
        )
        # A profile the catalog does not have.
        await bus.put(
            bus.names.deployments_bucket, "ghost", Deployment(name="ghost", profile="nope", replicas=1)
        )
        # A name that breaks the naming rule (a dot splits a subject).
        await kv.put("bad.name", b'{"kind":"Deployment","name":"bad.name","profile":"tp1"}')

        async def all_dead_lettered() -> list[str]:
            errors = [
                f"{m.headers.get('Llmgw-Subject', '')}: {m.headers.get('Llmgw-Error', '')}"
                for m in await dlq(bus)
                if m.headers
            ]
            assert len(errors) >= 5, errors
            return errors

        errors = await eventually(all_dead_lettered, timeout=20, interval=0.3)
        text = "\n".join(errors)
        assert "key evil holds a deployment named docs" in text
        assert "an empty value is not a delete" in text
        assert "deployment huge asks for 21 replicas, over the maximum of 20" in text
        assert "deployment ghost: profile nope is not in the catalog (tp1)" in text
        assert (
            f"$KV.{bus.names.deployments_bucket}.bad.name: Expected `str` matching regex "
            "'^[A-Za-z0-9_-]+$' - at `$.name`" in text
        )
        writes = p.service.controller.writes if p.service.controller else 0
        await passes(p.steps)
        assert set(await replicas(bus)) == before, "bad input placed or removed nothing"
        assert p.service.controller is not None
        assert p.service.controller.writes == writes
        assert sum(p.bus.decode_errors.values()) == len(errors) == 5, "each one counted"
        assert len(await dlq(bus)) == len(errors), "each bad value is dead-lettered once, not every step"


async def _equal(found: object, expected: object) -> bool:
    got = await found  # type: ignore[misc]
    assert got == expected, got
    return True


async def _count(found: object, n: int) -> bool:
    return len(await found) == n  # type: ignore[misc]


async def test_a_silent_launcher_whose_installer_beats_keeps_serving_then_fails_over_after_the_grace(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """An agent restart is not a node failure: while n0's installer beats, its silent launcher makes
    the replica's readiness `unknown` (its URL kept, so the gateway still sends to it) and nothing
    moves until launcher_grace_s has passed; then the node is failed over."""
    async with control_plane(nats_url, prefix) as cp, anyio.create_task_group() as beats:
        launcher = await cp.start_fleet(["n0"], gpus=8)  # n0's launcher: it answers n0's shards
        beats.start_soon(bus.heartbeat, "n0", "installer", 0.3)
        p = await cp.start_placement("a", node_timeout_s=2.0, launcher_grace_s=8.0)
        await eventually(lambda: p.service.controller is not None, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
        )
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 1), timeout=20)
        url = (await replicas(bus))["chat.r0"].url
        assert url
        await cp.start_fleet(["n1"], gpus=8)

        async def launcher_heard() -> bool:
            judged = await ctl.liveness(bus)
            assert judged is not None
            n0 = next(n for n in judged.nodes if n.node == "n0")
            return n0.silent_s >= 0 and n0.installer_silent_s >= 0

        await eventually(launcher_heard, timeout=10)
        launcher.cancel()
        silenced_at = time.monotonic()
        states: list[tuple[str, str]] = []

        async def watch() -> None:
            sub = await bus.js.subscribe(bus.names.replica_event("chat", "*"), ordered_consumer=True)
            async for msg in sub.messages:
                event = decoder(ReplicaStatus).decode(msg.data)
                states.append((event.state, event.reason))

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await eventually(lambda: "unknown" in [s for s, _ in states], timeout=10)
            r0 = (await replicas(bus))["chat.r0"]
            assert r0.state == "unknown"
            assert r0.url == url, "the engines it last heard ready are still routed to"
            assert r0.reason == (
                "launcher on n0 silent: readiness unknown; its installer still beats (an agent restart?): "
                "its engines are routed to for up to launcher_grace_s (8 s) before it fails over"
            )

            # Past node_timeout (2 s) and well into the grace: judged alive, nothing moved.
            async def in_grace() -> str:
                judged = await ctl.liveness(bus)
                assert judged is not None
                n0 = next(n for n in judged.nodes if n.node == "n0")
                assert n0.alive
                assert n0.silent_s >= 3.0, n0
                assert 0 < n0.grace_left_s <= 5.0, n0
                return (await ctl.nodes(bus)).splitlines()[1]

            line = await eventually(in_grace, timeout=10, interval=0.2)
            assert line.startswith("n0    launcher silent "), line
            assert ", installer beats (fails over in " in line, line
            assert set(await replicas(bus)) == {"chat.r0"}
            assert "failed" not in [s for s, _ in states]

            # Then the grace ends and the replica is placed again elsewhere, under a new id.
            await eventually(lambda: _equal(ready_replicas(bus, "chat"), ["chat.r1"]), timeout=30)
            tg.cancel_scope.cancel()
        # The grace counts from the last beat placement heard (before the launcher was
        # cancelled, by up to a heartbeat and whatever the loop was behind), on its clock.
        last_heard = p.service.state.last_seen["n0"]
        assert last_heard <= silenced_at
        assert time.monotonic() - last_heard >= 8.0
        assert ("failed", "node n0 lost") in states
        beats.cancel_scope.cancel()


async def test_a_node_silent_altogether_makes_readiness_unknown_then_fails_over(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """The launcher and the installer both silent (the fleet is the node's only agent): the node
    is lost after node_timeout, grace or not."""
    async with control_plane(nats_url, prefix) as cp:
        silent_node = await cp.start_fleet(["n0"], gpus=8)
        p = await cp.start_placement("a", node_timeout_s=4.0, launcher_grace_s=600.0)
        await eventually(lambda: p.service.controller is not None, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
        )
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 1), timeout=20)
        await cp.start_fleet(["n1"], gpus=8)
        # Heard by placement before it falls silent: else `ctl nodes` rightly says n0 was never
        # heard since placement started, and not for how long it has been silent.
        await eventually(lambda: "n0" in p.service.state.last_seen, timeout=20)
        silent_node.cancel()  # n0's agent stops: no heartbeat, no status update
        states: list[str] = []

        async def watch() -> None:
            sub = await bus.js.subscribe(bus.names.replica_event("chat", "*"), ordered_consumer=True)
            async for msg in sub.messages:
                states.append(decoder(ReplicaStatus).decode(msg.data).state)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            await eventually(lambda: "unknown" in states, timeout=10)
            found = await replicas(bus)
            r0 = found["chat.r0"]
            assert r0.state == "unknown"
            assert r0.reason == "launcher on n0 silent: readiness unknown"
            # Then the node is lost and the replica placed again elsewhere, under a new id.
            await eventually(lambda: _equal(ready_replicas(bus, "chat"), ["chat.r1"]), timeout=20)
            tg.cancel_scope.cancel()
        assert states.index("unknown") < states.index("failed")
        # `llmgw ctl nodes` says what placement judged, not what it heard in a window of its own.
        listed = (await ctl.nodes(bus)).splitlines()
        assert listed[1].startswith("n0    lost "), listed
        assert listed[1].split()[2].isdigit(), listed
        assert listed[2].startswith("n1    alive "), listed


async def test_replica_ids_never_repeat_across_failovers_and_restarts(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    async with control_plane(nats_url, prefix) as cp:
        first = await cp.start_fleet(["n0"], gpus=8)
        p = await cp.start_placement("a")
        await eventually(lambda: p.service.controller is not None, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
        )
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 1), timeout=20)
        await cp.start_fleet(["n1"], gpus=8)
        first.cancel()
        await eventually(lambda: _equal(ready_replicas(bus, "chat"), ["chat.r1"]), timeout=20)
        # A new placement (the old one gone) continues the numbers, and so does a re-created deployment.
        p.kill()
        await p.stopped.wait()
        q = await cp.start_placement("b")
        await eventually(lambda: q.service.controller is not None, timeout=20)
        await bus.delete(bus.names.deployments_bucket, "chat")
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 0), timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2)
        )
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 2), timeout=20)
        placed = await _placed(bus, "chat")
        assert len(placed) == len(set(placed)) == 4, placed
        assert sorted(await ready_replicas(bus, "chat")) != ["chat.r0", "chat.r1"]


async def _placed(bus: Bus, deployment: str) -> list[str]:
    decisions = await bus.history(bus.names.placement_event(deployment), PlacementDecision)
    return [d.replica for d in decisions if d.outcome == "placed"]


async def test_runtime_changes_survive_a_leader_change(bus: Bus, nats_url: str, prefix: str) -> None:
    """Regression: the standby rewrote a runtime scale (3) back to server.yaml's 2 and stopped a
    ready replica."""
    seeded = {"deployments": [{"name": "chat", "profile": "tp1", "replicas": 2}]}
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=8)
        a = await cp.start_placement("a", **seeded)
        await eventually(lambda: a.service.is_leader, timeout=20)
        b = await cp.start_placement("b", **seeded)
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 2), timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=3)
        )
        edited = msgspec.convert({**TP1, "args": ["--tokens-per-second", "99"]}, Profile)
        await bus.put(bus.names.catalog_bucket, "tp1", edited)

        async def rolled() -> bool:
            found = await replicas(bus)
            assert len(found) == 3, found
            assert all(r.state == "ready" and r.profile_fp == edited.fingerprint() for r in found.values()), (
                found
            )
            return True

        await eventually(rolled, timeout=40, interval=0.3)
        before = await ready_replicas(bus, "chat")
        a.kill()
        await eventually(lambda: b.service.is_leader, timeout=20)
        await passes(b.steps)
        got = await bus.get(bus.names.deployments_bucket, "chat", Deployment)
        assert got is not None
        assert got[0].replicas == 3
        profile = await bus.get(bus.names.catalog_bucket, "tp1", Profile)
        assert profile is not None
        assert profile[0].args == ("--tokens-per-second", "99")
        assert await ready_replicas(bus, "chat") == before
        assert cp.crashes() == []


async def test_a_placement_that_falls_behind_fails_no_node_over(bus: Bus, nats_url: str, prefix: str) -> None:
    """Regression: at 5,000 nodes placement fell behind on heartbeats, declared every node
    lost and failed the cluster over. Here its loop is blocked past node_timeout (as a long
    step or a starved CPU would): it says so once, and moves nothing."""
    import time

    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=8)
        p = await cp.start_placement("a")
        await eventually(lambda: p.service.controller is not None, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2)
        )
        await eventually(lambda: _count(ready_replicas(bus, "chat"), 2), timeout=20)
        before = await ready_replicas(bus, "chat")
        time.sleep(3.0)  # noqa: ASYNC251 - on purpose: placement (and the fleet beside it) hear nothing
        await passes(p.steps)
        assert p.service.behind
        assert p.service.stalls >= 1
        assert await ready_replicas(bus, "chat") == before, "nothing was failed over"
        assert cp.crashes() == []


async def test_a_late_write_of_an_ex_leader_is_removed(bus: Bus, nats_url: str, prefix: str) -> None:
    """Regression (chaos seed 1031254): a placement paused mid-commit sent its batch when it
    resumed, after the new leader had loaded the buckets; the record and shard spec it wrote
    were nobody's and stayed forever, the spec holding a GPU on its node."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0"], gpus=2)
        await cp.start_placement("a", reconcile_interval_s=1.0)
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
        await eventually(lambda: ready_replicas(bus, "chat"), timeout=30)
        profile = msgspec.convert(TP1, Profile)
        late = ShardSpec(
            replica="r7", shard="gone-r7-0", node="n0", profile=profile, gpus=(1,), deployment="gone"
        )
        await bus.put(bus.names.shards_bucket, "n0.gone-r7-0", late)
        await bus.put(
            bus.names.replicas_bucket,
            "gone.r7",
            ReplicaRecord(
                deployment="gone",
                replica="r7",
                profile="tp1",
                profile_fp=profile.fingerprint(),
                state="starting",
                shards=("n0.gone-r7-0",),
            ),
        )

        async def removed() -> bool:
            return set(await replicas(bus)) == {"chat.r0"} and set(
                await bus.keys(bus.names.shards_bucket)
            ) == {"n0.chat-r0-0"}

        await eventually(removed, timeout=20, interval=0.5)
        assert await ready_replicas(bus, "chat") == ["chat.r0"], "the leader's own replica stays"
        assert cp.crashes() == []


async def test_the_nodes_alive_in_one_pass_are_the_nodes_alive_one_by_one(bus: Bus, prefix: str) -> None:
    """`alive_nodes` (a step's one pass over every node) says what `alive` says of each node:
    before, during and long after the grace this placement gives after it could not hear."""
    config = server_config(bus.options.url, prefix, node_timeout_s=5.0, launcher_grace_s=30.0)
    state = ClusterState.empty()
    controller = Controller(config, bus, state)
    rng = random.Random(7)
    for i in range(2000):
        name = f"n{i:04d}"
        state.nodes[name] = NodeStatus(node=name, facts=NodeFacts(node=name))
        if rng.random() < 0.9:  # some were never heard
            state.last_seen[name] = 100.0 + rng.uniform(-10, 10)
        if rng.random() < 0.5:  # an installer that still beats gives a silent launcher its grace
            state.installer_seen[name] = 100.0 + rng.uniform(-10, 30)
    for heard_from in (None, 0.0, 99.0, 104.0):
        state.heard_from = heard_from
        for at in (95.0, 100.0, 104.9, 105.0, 108.0, 120.0, 135.0, 150.0):
            one_by_one = {n for n in state.nodes if controller.alive(n, at)[0]}
            assert controller.alive_nodes(at) == one_by_one, (heard_from, at)


async def test_an_idle_cluster_reconciles_empty_buckets_without_a_failed_step(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression: with no deployment yet, every reconcile (the shards and replicas buckets
    empty) failed its control step with `nats: no keys found`, and the steps' backoff then
    delayed the first deployment by up to a minute."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0"], gpus=1)
        p = await cp.start_placement("a", reconcile_interval_s=0.2)
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        assert await bus.keys(bus.names.replicas_bucket) == set()
        controller = p.service.controller
        assert controller is not None
        # Reconciles of the empty buckets keep succeeding for a second (about five of them).
        since = controller.clock()
        await eventually(lambda: controller._reconciled_at > since + 1.0, timeout=20, interval=0.1)
        assert p.service.step_failures == 0
        await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
        await eventually(lambda: ready_replicas(bus, "chat"), timeout=10, interval=0.2)
        assert cp.crashes() == []
