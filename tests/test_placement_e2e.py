"""The whole cluster, end to end: real NATS, real placement, installer and launcher processes, sim engines."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import ShardSpec
from llmgw_core.events import Deployment, Profile, ReplicaRecord
from tests.cluster_support import cluster, sim_catalog
from tests.metrics_support import value
from tests.replica_watch import ready_replicas_of
from tests.waiting import eventually, passes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]


async def replicas(bus: Bus, deployment: str) -> list[ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted(
        (c.value for c in found.values() if c.value and c.value.deployment == deployment),
        key=lambda r: r.replica,
    )


async def ready_replicas(bus: Bus, deployment: str, n: int) -> list[ReplicaRecord]:
    found = [r for r in await replicas(bus, deployment) if r.state == "ready"]
    assert len(found) == n, [(r.replica, r.state, r.reason) for r in await replicas(bus, deployment)]
    return found


async def test_two_replicas_go_ready_and_fail_over_when_a_node_dies(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        for node in ("node-1", "node-2", "node-3"):
            c.start_node(node, gpus=1)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
        ready = await eventually(lambda: ready_replicas(bus, "chat", 2), timeout=60)
        nodes = sorted(r.members[0].node for r in ready)
        assert len(set(nodes)) == 2, "one GPU per node: the replicas are on two nodes"
        async with httpx.AsyncClient(timeout=10) as client:
            for r in ready:
                answer = await client.post(
                    f"{r.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
                assert answer.status_code == 200

        victim = nodes[0]
        killed_at = time.monotonic()
        c.kill_node(victim)
        after = await eventually(lambda: _ready_elsewhere(bus, victim), timeout=60)
        failover = time.monotonic() - killed_at
        print(
            f"\nfailover: {victim} killed, 2 replicas ready again in {failover:.1f}s "
            f"(node_timeout {c.node_timeout_s}s)"
        )
        survivors = sorted(r.members[0].node for r in after)
        assert victim not in survivors
        assert set(survivors) | {victim} == {"node-1", "node-2", "node-3"}


async def _ready_elsewhere(bus: Bus, victim: str) -> list[ReplicaRecord]:
    found = await ready_replicas(bus, "chat", 2)
    assert all(r.members[0].node != victim for r in found)
    return found


async def test_a_restarted_placement_moves_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        for node in ("node-1", "node-2"):
            c.start_node(node, gpus=1)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
        await eventually(lambda: ready_replicas(bus, "chat", 2), timeout=60)
        before = {k: v.revision for k, v in (await bus.entries(bus.names.shards_bucket, ShardSpec)).items()}
        c.kill("placement-p1")
        c.start_placement("p2", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
        # The new placement takes the lease once the old one's stops moving, then runs its loop.
        await eventually(lambda: "active placement" in c.log("placement-p2"), timeout=30)
        # Passes that judged after the full node_timeout it grants every node on taking over.
        await passes(lambda: c.steps("p2"), since=time.monotonic() + c.node_timeout_s)
        after = {k: v.revision for k, v in (await bus.entries(bus.names.shards_bucket, ShardSpec)).items()}
        assert after == before, "a restarted placement rewrote or moved shards"
        await ready_replicas(bus, "chat", 2)


async def test_the_standby_takes_over_and_places_exactly_once(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=4)
        c.start_placement("p1", [sim_catalog()], [])
        await eventually(lambda: "active placement" in c.log("placement-p1"), timeout=30)
        c.start_placement("p2", [sim_catalog()], [])
        await eventually(lambda: "API on" in c.log("placement-p2"), timeout=30)
        assert "active placement" not in c.log("placement-p2")
        c.kill("placement-p1")
        await eventually(lambda: "active placement" in c.log("placement-p2"), timeout=30)
        await bus.put(
            bus.names.deployments_bucket, "late", Deployment(name="late", profile="tiny", replicas=1)
        )
        await eventually(lambda: ready_replicas(bus, "late", 1), timeout=60)
        shards = await bus.entries(bus.names.shards_bucket, ShardSpec)
        assert len([k for k in shards if ".late-" in k]) == 1
        assert len(await replicas(bus, "late")) == 1


async def test_a_catalog_change_rolls_replicas_one_at_a_time_never_to_zero_ready(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with ready_replicas_of(bus, "chat") as watch:
        with cluster(tmp_path, nats_url, prefix) as c:
            for node in ("node-1", "node-2", "node-3", "node-4"):
                c.start_node(node, gpus=1)
            c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
            first = await eventually(lambda: ready_replicas(bus, "chat", 2), timeout=60)
            await eventually(lambda: len(watch.ready) == 2, timeout=10)
            watch.watching = True
            changed = msgspec.convert(sim_catalog("--tokens-per-second", "100"), Profile)
            await bus.put(bus.names.catalog_bucket, "tiny", changed)
            new_fp = changed.fingerprint()

            async def rolled() -> list[ReplicaRecord]:
                found = await ready_replicas(bus, "chat", 2)
                assert all(r.profile_fp == new_fp for r in found)
                assert len(await replicas(bus, "chat")) == 2
                return found

            after = await eventually(rolled, timeout=90)
            assert {r.replica for r in after}.isdisjoint({r.replica for r in first})
            assert watch.counts, "replica events were seen during the roll"
            assert min(watch.counts) >= 1, f"ready replicas during the roll: {watch.counts}"
            # One at a time: never more than one replica above the count.
            assert max(watch.counts) <= 3


async def test_api_ctl_and_a_refusal_in_the_nodes_own_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    import re
    import subprocess
    import sys

    from llmgw_core.events import ReplicaStatus, decoder

    big = {**sim_catalog(name="big"), "gpu_class": "A100-80G"}
    unplaceable: list[ReplicaStatus] = []

    async def on_replica(msg: object) -> None:
        status = decoder(ReplicaStatus).decode(msg.data)  # type: ignore[attr-defined]
        if status.state == "unplaceable":
            unplaceable.append(status)

    await bus.nc.subscribe(f"{prefix}.events.replica.huge.*", cb=on_replica)
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement(
            "p1",
            [sim_catalog(), big],
            [
                {"name": "chat", "profile": "tiny", "replicas": 1},
                {"name": "huge", "profile": "big", "replicas": 1},
            ],
        )
        await eventually(lambda: ready_replicas(bus, "chat", 1), timeout=60)
        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=10)
        async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:
            nodes = (await client.get("/api/nodes")).json()
            assert [(n["node"], n["alive"], len(n["gpus"])) for n in nodes] == [("node-1", True, 2)]
            assert [e["name"] for e in nodes[0]["engines"]] == ["sim"]
            assert set((await client.get("/api/deployments")).json()) == {"chat", "huge"}
            replicas_api = (await client.get("/api/replicas")).json()
            assert replicas_api["chat.r0"]["state"] == "ready"
            explain = (await client.get("/api/explain/huge")).json()
            assert explain["next_replica"] == {
                "outcome": "refused",
                "reasons": [{"node": "node-1", "reason": "GPU class H100-80G, profile needs A100-80G"}],
            }
            # What stands now: the published status, and no replica (the what-if is separate).
            assert explain["status"]["summary"].startswith("huge: 0 of 1 ready; 1 cannot be placed: ")
            assert explain["replicas"] == []
            chat_explain = (await client.get("/api/explain/chat")).json()
            assert chat_explain["replicas"] == [
                {
                    "replica": "r0",
                    "state": "ready",
                    "nodes": ["node-1"],
                    "reason": "",
                    "last_failure": "",
                    "failure": None,
                }
            ]
            assert chat_explain["status"]["summary"] == "chat: 1 of 1 ready"
            metrics = (await client.get("/metrics")).text
            assert value(metrics, "llmgw_placement_replicas", deployment="chat", state="ready") == 1
            assert value(metrics, "llmgw_placement_leader") == 1
            assert (await client.get("/api/explain/nope")).status_code == 404
        expected = ("r0", "node-1: GPU class H100-80G, profile needs A100-80G")
        await eventually(lambda: [(u.replica, u.reason) for u in unplaceable][-1:] == [expected], timeout=10)

        env = c.ctl_env()
        ctl = [
            sys.executable,
            "-c",
            "import sys; from llmgw.cli import main; sys.exit(main())",
            "ctl",
            "--prefix",
            prefix,
        ]
        explained = subprocess.run(
            [*ctl, "explain", "huge"], capture_output=True, text=True, env=env, timeout=60
        )
        assert explained.returncode == 0, explained.stderr
        assert explained.stdout.splitlines() == [
            "huge: 0 of 1 ready; 1 cannot be placed: node-1: GPU class H100-80G, profile needs A100-80G",
            "NODE    REASON",
            "node-1  GPU class H100-80G, profile needs A100-80G",
        ]
        missing = subprocess.run(
            [*ctl, "explain", "nope"], capture_output=True, text=True, env=env, timeout=60
        )
        assert (missing.returncode, missing.stderr) == (
            3,
            "llmgw: no deployment nope (`llmgw ctl get deployments` lists them)\n",
        )
        deployed = subprocess.run(
            [*ctl, "deploy", "more", "--profile", "tiny", "--replicas", "1"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert deployed.stdout == "deployment more: 1 x tiny requested\n", deployed.stderr
        await eventually(lambda: ready_replicas(bus, "more", 1), timeout=60)
        listed = subprocess.run([*ctl, "nodes"], capture_output=True, text=True, env=env, timeout=60)
        assert listed.returncode == 0, listed.stderr
        header, row = listed.stdout.splitlines()
        assert header.split() == ["NODE", "STATE", "GPUS", "ENGINES", "INSTALL", "WARNINGS"]
        assert row.startswith("node-1  alive  2x NVIDIA H100 80GB HBM3  sim 0.1.0 (configured)")

        # The operator deletes a deployment, then applies a server.yaml: as the ctl identity.
        deleted = subprocess.run(
            [*ctl, "delete", "deployment", "more"], capture_output=True, text=True, env=env, timeout=60
        )
        assert deleted.stdout == "deployment more deleted: its replicas stop\n", deleted.stderr
        await eventually(lambda: _none_of(bus, "more"), timeout=60)
        missing = subprocess.run(
            [*ctl, "delete", "deployment", "more"], capture_output=True, text=True, env=env, timeout=60
        )
        assert (missing.returncode, missing.stderr) == (3, "llmgw: no deployment more\n")
        applied_file = tmp_path / "apply.yaml"
        applied_file.write_text(
            "engines: []\n"
            "catalog:\n  - {name: tiny, engine: sim, model_path: sim://tiny, gpu_class: H100-80G}\n"
            "deployments:\n  - {name: chat, profile: tiny, replicas: 2}\n"
        )
        applied = subprocess.run(
            [*ctl, "apply", "-f", str(applied_file)], capture_output=True, text=True, env=env, timeout=60
        )
        assert applied.returncode == 0, applied.stderr
        said = applied.stdout.splitlines()
        assert "deployment chat: changed (replicas: 1 -> 2)" in said, said
        assert "deployment huge: not in the file, kept (--prune deletes it)" in said, said
        assert said[-1] == f"applied {applied_file}: 0 added, 2 changed, 0 deleted, 1 unchanged", said
        await eventually(lambda: ready_replicas(bus, "chat", 2), timeout=60)


async def _none_of(bus: Bus, deployment: str) -> bool:
    assert await replicas(bus, deployment) == []
    return True


async def test_a_paused_leader_is_fenced_and_never_places_twice(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    import os
    import signal

    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=4)
        p1 = c.start_placement("p1", [sim_catalog()], [])
        await eventually(lambda: "active placement" in c.log("placement-p1"), timeout=30)
        c.start_placement("p2", [sim_catalog()], [])
        await eventually(lambda: "API on" in c.log("placement-p2"), timeout=30)
        # p1 freezes (a GC pause, a stalled VM): p2 takes over once the lease stops moving.
        os.kill(p1.pid, signal.SIGSTOP)
        try:
            await eventually(lambda: "active placement" in c.log("placement-p2"), timeout=30)
            await bus.put(
                bus.names.deployments_bucket, "late", Deployment(name="late", profile="tiny", replicas=1)
            )
            await eventually(lambda: ready_replicas(bus, "late", 1), timeout=60)
        finally:
            os.kill(p1.pid, signal.SIGCONT)
        # p1 wakes up still believing it leads; its next write is fenced off.
        await eventually(
            lambda: "the placement lease was taken by another process" in c.log("placement-p1"), timeout=30
        )
        await passes(lambda: c.steps("p2"))
        assert [r.replica for r in await replicas(bus, "late")] == ["r0"]
        shards = await bus.entries(bus.names.shards_bucket, ShardSpec)
        assert [k for k in shards if ".late-" in k] == ["node-1.late-r0-0"]


async def test_a_catalog_change_that_fits_nowhere_leaves_the_old_replicas_serving(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        [before] = await eventually(lambda: ready_replicas(bus, "chat", 1), timeout=60)
        impossible = msgspec.convert({**sim_catalog(), "gpu_class": "A100-80G"}, Profile)
        await bus.put(bus.names.catalog_bucket, "tiny", impossible)
        await eventually(
            lambda: (
                "cannot place chat: node-1: GPU class H100-80G, profile needs A100-80G"
                in c.log("placement-p1")
            ),
            timeout=30,
        )
        await passes(lambda: c.steps("p1"))
        # Ready again if a loaded machine delayed the launcher's beat (readiness unknown meanwhile).
        [after] = await eventually(lambda: ready_replicas(bus, "chat", 1), timeout=30)
        assert (after.replica, after.profile_fp) == (before.replica, before.profile_fp)


async def test_without_room_for_a_new_replica_first_the_roll_is_in_place(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        [before] = await eventually(lambda: ready_replicas(bus, "chat", 1), timeout=60)
        changed = msgspec.convert(sim_catalog("--tokens-per-second", "100"), Profile)
        await bus.put(bus.names.catalog_bucket, "tiny", changed)

        async def rolled() -> ReplicaRecord:
            [r] = await ready_replicas(bus, "chat", 1)
            assert r.profile_fp == changed.fingerprint()
            return r

        after = await eventually(rolled, timeout=60)
        assert after.replica != before.replica
        assert "replaced in place: no room for a new replica first" in c.log("placement-p1")
