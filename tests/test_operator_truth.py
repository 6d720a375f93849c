"""What an operator reads about a deployment names the real cause, and changes only when it does.

Placement runs in-process on its own NATS connection over simulated fleets (or a
real installer and launcher for the install case); the texts asserted are those
published on the bus, which `ctl`, the API and the page all read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    EngineSpec,
    PlacementDecision,
    ReplicaStatus,
    decoder,
)
from tests.cluster_support import cluster, sim_catalog
from tests.control_support import TP1, control_plane, replicas
from tests.installer_support import ASSET, agent, build_server, installer, pack, release_server, want
from tests.launcher_support import running_launcher
from tests.waiting import eventually, passes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


async def last_status(bus: Bus, deployment: str) -> DeploymentStatus | None:
    found = await bus.history(bus.names.deployment_event(deployment), DeploymentStatus, idle_s=0.3)
    return found[-1] if found else None


def status_where(
    bus: Bus, deployment: str, test: Callable[[DeploymentStatus], bool]
) -> Callable[[], Awaitable[DeploymentStatus | None]]:
    """For `eventually`: the deployment's last published status once `test` holds for it."""

    async def probe() -> DeploymentStatus | None:
        found = await last_status(bus, deployment)
        return found if found is not None and test(found) else None

    return probe


def _catalog(*extra: dict[str, object]) -> list[dict[str, object]]:
    return [TP1, *extra]


async def test_a_deployment_says_how_many_are_ready_and_why_the_rest_cannot_be_placed(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Ten wanted, room for three: `3 of 10 ready; 7 cannot be placed: <each node's reason>`;
    scaled down to what fits, the refusal is gone from every view."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1", "n2"], gpus=1)
        await cp.start_placement("a")
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=10)
        )

        status = await eventually(status_where(bus, "chat", lambda s: s.ready == 3), timeout=30, interval=0.3)
        assert (status.desired, status.ready, status.pending, status.unplaceable) == (10, 3, 0, 7)
        assert status.summary.startswith("chat: 3 of 10 ready; 7 cannot be placed: "), status.summary
        for node in ("n0", "n1", "n2"):
            assert f"{node}: 0 of 1 GPUs free, profile needs 1" in status.summary
        assert {r.node for r in status.reasons} == {"n0", "n1", "n2"}

        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=3)
        )

        status = await eventually(
            status_where(bus, "chat", lambda s: s.desired == 3), timeout=20, interval=0.3
        )
        assert status.summary == "chat: 3 of 3 ready"
        assert (status.unplaceable, status.reasons) == (0, ())
        leader = cp.leaders()[0].service.controller
        assert leader is not None
        assert "chat" not in leader.decisions, "a refusal that no longer holds is still kept for explain"

        await (await bus.kv(bus.names.deployments_bucket)).delete("chat")
        gone = await eventually(status_where(bus, "chat", lambda s: s.desired == 0), timeout=20, interval=0.3)
        assert gone.summary == "chat: deleted"


@pytest.mark.parametrize(
    ("profile", "words"),
    [
        (
            {"name": "a100", "engine": "sim", "model_path": "sim://x", "gpu_class": "A100-80G", "tp": 1},
            "GPU class H100-80G, profile needs A100-80G",
        ),
        (
            {"name": "tp16", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 16},
            "8 of 8 GPUs free, profile needs 16",
        ),
        (
            {
                "name": "two-nodes",
                "engine": "sim",
                "model_path": "sim://x",
                "gpu_class": "H100-80G",
                "tp": 8,
                "nodes": 2,
                "gpus_per_node": 4,
            },
            "on no fabric; profile needs 2 nodes on one fabric",
        ),
        (
            {"name": "vl", "engine": "vllm", "model_path": "/m", "gpu_class": "H100-80G", "tp": 1},
            "engine vllm not installed",
        ),
    ],
    ids=["gpu-class", "over-capacity", "fabric", "engine-missing"],
)
async def test_a_refusal_names_each_nodes_cause(
    bus: Bus, nats_url: str, prefix: str, profile: dict[str, object], words: str
) -> None:
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=8)
        await cp.start_placement("a", catalog=_catalog(profile))
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        name = str(profile["name"])
        await bus.put(bus.names.deployments_bucket, "d", Deployment(name="d", profile=name, replicas=1))
        status = await eventually(
            status_where(bus, "d", lambda s: s.unplaceable == 1), timeout=20, interval=0.3
        )
        assert status.summary == f"d: 0 of 1 ready; 1 cannot be placed: n0: {words}; n1: {words}"
        [decision] = await bus.history(bus.names.placement_event("d"), PlacementDecision, idle_s=0.3)
        assert decision.outcome == "refused"
        assert {(r.node, r.reason) for r in decision.reasons} == {("n0", words), ("n1", words)}


async def test_an_unknown_profile_is_named_with_the_deployment(bus: Bus, nats_url: str, prefix: str) -> None:
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0"], gpus=8)
        await cp.start_placement("a")
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        await bus.put(bus.names.deployments_bucket, "d", Deployment(name="d", profile="nope", replicas=2))
        status = await eventually(
            status_where(bus, "d", lambda s: s.unplaceable == 2), timeout=20, interval=0.3
        )
        assert status.summary == "d: 0 of 2 ready; 2 cannot be placed: -: profile nope is not in the catalog"


async def test_a_lost_node_refuses_each_deployment_once_not_every_step(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression: a refusal quoting "lost N s ago" changed every second, so every refused
    deployment republished it every step (293 events in 78 s for 4 deployments)."""
    async with control_plane(nats_url, prefix) as cp:
        fleet = await cp.start_fleet(["n0"], gpus=1)
        # A full reconcile every second, so that the passes counted below include some.
        p = await cp.start_placement("a", reconcile_interval_s=1.0)
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        for i in range(4):
            await bus.put(bus.names.deployments_bucket, f"d{i}", Deployment(name=f"d{i}", profile="tp1"))

        # One of them holds the only GPU; the other three are refused.
        async def one_ready() -> bool:
            return sum(1 for r in (await replicas(bus)).values() if r.state == "ready") == 1

        await eventually(one_ready, timeout=30, interval=0.3)
        fleet.cancel()
        names = [f"d{i}" for i in range(4)]

        async def all_lost() -> bool:
            for name in names:
                s = await last_status(bus, name)
                if s is None or "lost: no heartbeat since" not in s.summary:
                    return False
            return True

        await eventually(all_lost, timeout=30, interval=0.5)
        before = {
            n: len(await bus.history(bus.names.placement_event(n), PlacementDecision, idle_s=0.2))
            for n in names
        }
        statuses = {
            n: len(await bus.history(bus.names.deployment_event(n), DeploymentStatus, idle_s=0.2))
            for n in names
        }
        # Passes that began once "lost N s ago" had changed twice and two full reconciles were due.
        await passes(p.steps, 5, since=time.monotonic() + 2.5)
        for n in names:
            after = await bus.history(bus.names.placement_event(n), PlacementDecision, idle_s=0.2)
            assert len(after) == before[n], f"{n}: {len(after) - before[n]} refusals republished while lost"
            again = await bus.history(bus.names.deployment_event(n), DeploymentStatus, idle_s=0.2)
            assert len(again) == statuses[n], [s.summary for s in again[statuses[n] :]]
            assert sum(1 for d in after if d.outcome == "refused" and "lost" in d.reasons[0].reason) <= 1


async def test_a_refusal_quotes_the_installers_own_progress(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: while a node downloaded its llama.cpp build, `ctl nodes` showed the
    download's progress but the refusal said only `engine llamacpp installing`."""
    padding = tmp_path / "padding.bin"
    padding.write_bytes(os.urandom(2_000_000))  # incompressible: the download takes a while
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b"), "padding.bin": padding})
    llama = {"name": "cpu", "engine": "llamacpp", "model_path": str(tmp_path / "m.gguf")}
    async with release_server() as rel, control_plane(nats_url, prefix) as cp:
        rel.add_file(archive, "slow")
        config = agent(tmp_path, nats_url, prefix, rel.api, heartbeat_interval_s=0.3)
        await cp.start_placement("a", catalog=_catalog(llama))
        await eventually(lambda: len(cp.leaders()) == 1, timeout=20)
        await want(bus, EngineSpec(name="llamacpp", version="b9999"))
        async with running_launcher(config), anyio.create_task_group() as tg:
            inst = installer(config, bus)
            await inst.load_desired()
            tg.start_soon(inst.converge_once)
            await bus.put(bus.names.deployments_bucket, "cpu", Deployment(name="cpu", profile="cpu"))

            status = await eventually(
                status_where(bus, "cpu", lambda s: "%, " in s.summary), timeout=60, interval=0.3
            )
            assert "node-a: engine llamacpp installing: downloading" in status.summary, status.summary
            tg.cancel_scope.cancel()
        events = await bus.history(bus.names.placement_event("cpu"), PlacementDecision, idle_s=0.3)
        assert any("engine llamacpp installing: downloading" in r.reason for d in events for r in d.reasons)


CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]
CRASHES = sim_catalog("--load-time", "30", "--exit-after", "0.3", "--exit-code", "42", name="crashes")
NEVER_HEALTHY = {**sim_catalog("--load-time", "600", name="silent"), "health_timeout_s": 1.5}


async def test_a_crashing_or_silent_engine_is_named_everywhere_and_never_ready(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a replica whose engine exited with code 42 again and again, or never answered
    health, read `placed on node-a` in ctl and had an empty reason between retries."""
    replica_events: list[ReplicaStatus] = []

    async def on_replica(msg: Msg) -> None:
        replica_events.append(decoder(ReplicaStatus).decode(msg.data))

    await bus.nc.subscribe(f"{prefix}.events.replica.>", cb=on_replica)
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement(
            "p1",
            [CRASHES, NEVER_HEALTHY],
            [{"name": "crashes", "profile": "crashes"}, {"name": "silent", "profile": "silent"}],
        )
        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:

            async def failed_twice() -> dict[str, Any] | None:
                found = (await client.get("/api/replicas")).json()
                both = [found.get("crashes.r0"), found.get("silent.r0")]
                if any(r is None or r["restarts"] < 2 or not r["last_failure"] for r in both):
                    return None
                return dict(found)

            found = await eventually(failed_twice, timeout=90, interval=0.5)
            # `explain` shows the failure in one line, and as fields.
            [explained] = (await client.get("/api/explain/crashes")).json()["replicas"]
            assert re.fullmatch(r"sim \(pid \d+\) exited with code 42", explained["last_failure"]), explained
            assert explained["failure"]["exit"] == 42, explained
        crashes, silent = found["crashes.r0"], found["silent.r0"]
        assert "exited with code 42" in crashes["last_failure"], crashes
        assert "llmgw-sim: exiting with code 42" in crashes["last_failure"], crashes
        assert "no health answer within 1.5 s" in silent["last_failure"], silent
        # The same failures as fields: an exit status where a process's exit ended the attempt.
        assert crashes["failure"]["exit"] == 42, crashes
        assert "llmgw-sim: exiting with code 42 after 0.3s" in crashes["failure"]["log_tail"], crashes
        assert silent["failure"]["exit"] is None, silent
        assert silent["failure"]["reason"].startswith("no health answer within 1.5 s from http://"), silent
        for record in (crashes, silent):
            assert record["state"] != "ready"
            assert record["since"] > 0
            if record["state"] == "starting":
                assert record["reason"].startswith(f"attempt {record['restarts'] + 1}; last: "), record
        # The same words in ctl, and in the events other systems read.
        for name, words in (("crashes", "exited with code 42"), ("silent", "no health answer within 1.5 s")):
            described = subprocess.run(
                [*CTL, "--prefix", prefix, "describe", "deployment", name],
                env=c.ctl_env(),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert described.returncode == 0, described.stderr
            assert words in described.stdout, described.stdout
            assert any(words in e.reason for e in replica_events if e.deployment == name), [
                e.reason for e in replica_events if e.deployment == name
            ]
        assert not any(e.state == "ready" for e in replica_events), (
            "a replica was ready without a health answer"
        )


async def test_a_deployment_status_never_counts_what_the_bucket_does_not_hold_yet(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """At the moment placement publishes a status, the replicas bucket already holds at least
    as many ready replicas as it says (statuses go out after the step's writes are committed)."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet([f"n{i}" for i in range(10)], gpus=4)
        await cp.start_placement("a")
        [leader] = await eventually(lambda: cp.leaders() or None, timeout=20)
        controller = await eventually(lambda: leader.service.controller, timeout=20)
        seen: list[tuple[int, int]] = []
        publish = controller.applier._event

        async def checked(subject: str, msg: Any) -> None:
            if isinstance(msg, DeploymentStatus):
                held = [r for r in (await replicas(bus)).values() if r.state == "ready"]
                seen.append((msg.ready, len(held)))
            await publish(subject, msg)

        controller.applier._event = checked  # type: ignore[method-assign]
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=40)
        )
        await eventually(status_where(bus, "chat", lambda s: s.ready == 40), timeout=60, interval=0.3)
        assert seen
        assert seen[-1][0] == 40
        early = [(said, held) for said, held in seen if held < said]
        assert not early, f"statuses said more ready than the bucket held (said, held): {early}"
