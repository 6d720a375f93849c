"""Autoscaling through the real path: NATS, placement, installer and launcher processes, sim
engines. The test publishes `Demand` on the bus as a gateway does (every 0.3 s), and
asserts what an operator sees: the count in the replicas bucket, the `ScaleDecision`
events and their words, replicas `draining` before they stop, `ctl describe deployment`."""

from __future__ import annotations

import re
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import (
    Demand,
    Deployment,
    DeploymentDemand,
    ReplicaRecord,
    ReplicaStatus,
    ScaleDecision,
    decoder,
)
from tests.cluster_support import cluster, sim_catalog
from tests.test_ctl import ctl, ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

# Short windows, so that a test sees a minute's behaviour in seconds.
AUTOSCALER = {
    "autoscaler": {"stable_window_s": 3.0, "panic_window_s": 1.0, "drain_timeout_s": 20.0},
}
CHAT = {
    "name": "chat",
    "profile": "tiny",
    "autoscale": {"min_replicas": 1, "max_replicas": 3, "target_in_flight": 2, "scale_down_after_s": 3},
}


class Gateway:
    """Reports demand as a gateway does: the latest numbers, every interval, until stopped."""

    def __init__(self, bus: Bus, name: str = "gw-test") -> None:
        self.bus = bus
        self.name = name
        self.in_flight = 0
        self.queued = 0

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            report = Demand(
                gateway=self.name,
                deployments=(
                    DeploymentDemand(deployment="chat", in_flight=self.in_flight, queued=self.queued),
                ),
                interval_s=0.3,
            )
            await self.bus.publish_core(self.bus.names.demand(self.name), report)
            await anyio.sleep(0.3)


async def records(bus: Bus) -> list[ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted(
        (c.value for c in found.values() if c.value and c.value.deployment == "chat"), key=lambda r: r.replica
    )


async def test_demand_raises_the_count_says_why_and_its_end_lowers_it_through_draining(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    decisions: list[ScaleDecision] = []
    states: list[tuple[str, str, str]] = []

    async def on_scale(msg: object) -> None:
        decisions.append(decoder(ScaleDecision).decode(msg.data))  # type: ignore[attr-defined]

    async def on_replica(msg: object) -> None:
        s = decoder(ReplicaStatus).decode(msg.data)  # type: ignore[attr-defined]
        states.append((s.replica, s.state, s.reason))

    subs = [
        await bus.nc.subscribe(bus.names.scale_event("chat"), cb=on_scale),
        await bus.nc.subscribe(bus.names.replica_event("chat", "*"), cb=on_replica),
    ]
    gateway = Gateway(bus)
    try:
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_node("node-1", gpus=3)
            c.start_placement("p1", [sim_catalog()], [CHAT], AUTOSCALER)

            async def serving(n: int) -> bool:
                rs = await records(bus)
                assert [r.state for r in rs] == ["ready"] * n, rs
                return True

            await eventually(lambda: serving(1), timeout=60, interval=0.5)
            assert decisions == [], "min_replicas is where it starts: nothing to say"
            async with anyio.create_task_group() as tg:
                await tg.start(gateway.run)
                # 6 in flight at a target of 2 per replica: 3 replicas (the maximum).
                gateway.in_flight = 6
                await eventually(lambda: serving(3), timeout=60, interval=0.5)
                first = decisions[0]
                assert (first.deployment, first.before) == ("chat", 1)
                assert first.reason.startswith(f"scaled 1 → {first.after}: "), first.reason
                assert re.search(r" requests in flight per replica over [13] s, target 2", first.reason), (
                    first
                )

                assert decisions[-1].after == 3

                described = ok(c, "describe", "deployment", "chat")
                assert (
                    "Autoscale:    1 to 3 replicas, 2 requests in flight per replica, down after 3 s"
                    in described
                )
                assert f"Last scaled:  {decisions[-1].reason} (" in described, described
                assert "following demand, 1 to 3 replicas" in described

                # Demand gone: after the delay the count goes back to 1, each replica stopped
                # only after draining.
                gateway.in_flight = 0
                await eventually(lambda: serving(1), timeout=60, interval=0.5)
                tg.cancel_scope.cancel()
            down = decisions[-1]
            assert down.after == 1, decisions
            assert ", for " in down.reason, down.reason
            drained = [(r, why) for r, state, why in states if state == "draining"]
            stopped = [r for r, state, _ in states if state == "stopping"]
            assert len(drained) == 2, states
            assert all(why.startswith("draining: scaled down to ") for _, why in drained), drained
            assert sorted(r for r, _ in drained) == sorted(stopped), states
            for replica in stopped:
                order = [state for r, state, _ in states if r == replica]
                assert order.index("draining") < order.index("stopping"), (replica, order)
                [why] = [w for r, state, w in states if r == replica and state == "stopping"]
                assert why.startswith("scaled down to "), why
                assert why.endswith("; drained"), why
            events = ok(c, "events", "--deployment", "chat")
            assert down.reason in events, events
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def test_a_request_held_at_zero_wakes_a_replica_and_none_for_the_delay_parks_it_again(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    decisions: list[ScaleDecision] = []

    async def on_scale(msg: object) -> None:
        decisions.append(decoder(ScaleDecision).decode(msg.data))  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(bus.names.scale_event("chat"), cb=on_scale)
    idle = {**CHAT, "autoscale": {**CHAT["autoscale"], "min_replicas": 0, "scale_down_after_s": 2}}  # type: ignore[dict-item]
    gateway = Gateway(bus)
    try:
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_node("node-1", gpus=1)
            c.start_placement("p1", [sim_catalog()], [idle], AUTOSCALER)
            await eventually(lambda: "active placement" in c.log("placement-p1"), timeout=30)
            async with anyio.create_task_group() as tg:
                await tg.start(gateway.run)
                # At zero, with nothing asked: nothing is placed.
                before = await eventually(lambda: c.steps("p1"), timeout=30)

                async def stepped() -> bool:
                    return await c.steps("p1") >= before + 3

                await eventually(stepped, timeout=30, interval=0.3)
                assert await records(bus) == []
                gateway.queued = 1  # a gateway holds a request for it

                async def woken() -> bool:
                    assert [r.state for r in await records(bus)] == ["ready"]
                    return True

                await eventually(woken, timeout=60, interval=0.3)
                assert decisions[0].reason == "scaled 0 → 1: 1 request waiting with no replica, target 2"
                gateway.queued = 0

                async def parked() -> bool:
                    assert await records(bus) == []
                    return True

                await eventually(parked, timeout=60, interval=0.5)
                tg.cancel_scope.cancel()
            assert re.fullmatch(r"scaled to 0 after \d+ s without requests", decisions[-1].reason), decisions
            assert (decisions[-1].before, decisions[-1].after) == (1, 0)
    finally:
        await sub.unsubscribe()


async def test_a_new_leader_starts_from_the_replicas_that_exist_and_changes_nothing_under_the_same_load(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    decisions: list[ScaleDecision] = []

    async def on_scale(msg: object) -> None:
        decisions.append(decoder(ScaleDecision).decode(msg.data))  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(bus.names.scale_event("chat"), cb=on_scale)
    gateway = Gateway(bus)
    try:
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_node("node-1", gpus=2)
            c.start_placement("p1", [sim_catalog()], [CHAT], AUTOSCALER)
            async with anyio.create_task_group() as tg:
                await tg.start(gateway.run)
                gateway.in_flight = 4  # 2 replicas at 2 each

                async def two() -> bool:
                    assert [r.state for r in await records(bus)] == ["ready", "ready"]
                    return True

                await eventually(two, timeout=60, interval=0.5)
                told = len(decisions)
                ids = [r.replica for r in await records(bus)]
                c.kill("placement-p1")
                c.start_placement("p2", [sim_catalog()], [CHAT], AUTOSCALER)
                await eventually(lambda: "active placement" in c.log("placement-p2"), timeout=30)
                before = await eventually(lambda: c.steps("p2"), timeout=30)

                async def stepped() -> bool:
                    return await c.steps("p2") >= before + 10

                await eventually(stepped, timeout=60, interval=0.5)
                tg.cancel_scope.cancel()
            assert len(decisions) == told, decisions[told:]
            assert [r.replica for r in await records(bus)] == ids, "nothing stopped or started"
            assert [r.state for r in await records(bus)] == ["ready", "ready"]
    finally:
        await sub.unsubscribe()


@pytest.mark.parametrize(
    ("flags", "rule"),
    [
        (
            ["--min-replicas", "3", "--max-replicas", "2"],
            "deployment chat: autoscale min_replicas 3 is above max_replicas 2: "
            "min_replicas must be at most max_replicas",
        ),
        (
            ["--min-replicas", "-1", "--max-replicas", "2"],
            "deployment chat: autoscale min_replicas is -1: it is 0 (scale to zero) or more",
        ),
        (
            ["--min-replicas", "0", "--max-replicas", "2", "--target-in-flight", "0"],
            "deployment chat: autoscale target_in_flight is 0: the requests in flight per replica "
            "it aims at is more than 0 (4 is a fair start)",
        ),
        (
            ["--min-replicas", "0", "--max-replicas", "2", "--scale-down-after", "-5"],
            "deployment chat: autoscale scale_down_after_s is -5: it is 0 seconds or more",
        ),
    ],
)
async def test_bad_bounds_are_refused_at_write_with_the_rule_exit_4(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, flags: list[str], rule: str
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        done = ctl(c, "deploy", "chat", "--profile", "tiny", *flags)
        assert done.returncode == 4, (done.returncode, done.stdout, done.stderr)
        assert rule in done.stderr, done.stderr
        assert await bus.entries(bus.names.deployments_bucket, Deployment) == {}, "nothing was written"


async def test_bounds_are_written_as_given_through_ctl_and_the_api_and_bad_ones_refused_by_both(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("p1", [sim_catalog()], [], AUTOSCALER)
        await eventually(lambda: "seeded from server.yaml" in c.log("placement-p1"), timeout=30)
        said = ok(
            c,
            *("deploy", "chat", "--profile", "tiny", "--min-replicas", "0", "--max-replicas", "4"),
            *("--target-in-flight", "8", "--scale-down-after", "120"),
        )
        assert (
            "deployment chat: 0 to 4 x tiny requested, following demand (8 requests in flight per replica)"
            in said
        )
        [stored] = [e.value for e in (await bus.entries(bus.names.deployments_bucket, Deployment)).values()]
        assert stored is not None
        assert stored.autoscale is not None
        assert (stored.autoscale.min_replicas, stored.autoscale.max_replicas) == (0, 4)
        assert (stored.autoscale.target_in_flight, stored.autoscale.scale_down_after_s) == (8.0, 120.0)
        scaled = ctl(c, "scale", "chat", "--replicas", "3")
        assert scaled.returncode == 4, scaled.stderr
        assert (
            "deployment chat follows demand (0 to 4 replicas): its count is placement's to choose"
            in scaled.stderr
        )

        def listed() -> bool:
            [row] = [line for line in ok(c, "get", "deployments").splitlines() if line.startswith("chat ")]
            assert re.match(r"chat +tiny +0 \(0-4\) ", row), row
            return True

        await eventually(listed, timeout=30, interval=0.5)
        half = ctl(c, "deploy", "chat", "--profile", "tiny", "--max-replicas", "4")
        assert half.returncode == 2, half.stderr
        assert "--min-replicas is missing: following demand needs both bounds" in half.stderr

        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:
            bad = await client.post(
                "/api/deployments",
                json={"name": "chat", "profile": "tiny", "autoscale": {"min_replicas": 5, "max_replicas": 2}},
            )
            assert bad.status_code == 400, bad.text
            assert bad.json()["error"] == (
                "invalid deployment: deployment chat: autoscale min_replicas 5 is above max_replicas 2: "
                "min_replicas must be at most max_replicas"
            )

            async def chosen() -> bool:
                body = (await client.get("/api/explain/chat")).json()
                auto = body["autoscale"]
                assert auto["bounds"]["max_replicas"] == 4, auto
                # Nothing asked for it: min_replicas 0 is where it stays, the count never written back.
                assert auto["count"] == 0, auto
                return True

            await eventually(chosen, timeout=30, interval=0.5)
        [stored] = [e.value for e in (await bus.entries(bus.names.deployments_bucket, Deployment)).values()]
        assert stored is not None
        assert stored.replicas == 1, "the count placement chose is never written into the deployment"
