"""What every surface says when the cluster's truth is one a surface used to miss: a GPU gone from
a node under a replica that reads `ready`, a scale past capacity, a replica failed for a reason
its deployment did not quote.

Placement runs in-process on its own NATS connection over a simulated fleet, with its API and
page served on loopback; `ctl` runs in-process over the same NATS."""

from __future__ import annotations

import msgspec
import pytest

from llmgw.ctl._commands import request_replicas
from llmgw_core.bus import Bus
from llmgw_core.engines import ShardSpec
from llmgw_core.events import Deployment, ShardStatus
from tests.control_support import all_ready, control_plane, replicas
from tests.test_reconcile import World, placed_on, removed
from tests.truth_support import (
    count_on_page,
    describe,
    explain,
    get,
    last_status,
    replica_events,
    served,
)
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

FULL = "0 of 1 GPUs free, profile needs 1"


def test_a_ready_replica_on_a_gpu_its_node_no_longer_reports_is_failed_and_placed_again() -> None:
    """Regression (cell 24): only a replica already `failed` was checked against the GPUs its
    node reports; two replicas on GPUs 0 and 1 of a node that came back with one GPU stayed
    `ready`, and the page counted GPU 1 held on a node that has none."""
    w = World({"n0": 2, "n1": 2})
    for replica, gpu in (("r0", 0), ("r1", 1)):
        w.holds(replica, "n0", gpus=(gpu,))
        w.shard_status[f"n0.chat-{replica}-0"] = ShardStatus(
            node="n0", shard=f"chat-{replica}-0", replica=replica, state="ready", url="http://n0:1"
        )
    w.deploy(replicas=2)
    assert w.step().removals == [], "both GPUs are there: nothing moves"
    w.node("n0", 0)
    assert w.step().removals == [], "no GPU at all is a probe that failed: the serving replicas stay"
    w.node("n0", 1)  # the node restarted reporting one GPU
    plan = w.step()
    assert removed(plan) == [("r1", "failed", "GPU 1 is no longer on n0 (it reports 1 GPU: 0)")]
    assert placed_on(plan) == [("n1",)]


async def test_a_gpu_gone_from_a_node_is_said_and_its_replica_placed_where_a_gpu_is(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression (cell 24): node-a restarted reporting 1 GPU while its two replicas held GPUs 0
    and 1: both stayed `ready`, the page said `GPUs 1 held, 3 free` with two running, and
    nothing said a replica was pinned to a GPU the node no longer has."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["node-a", "node-b"], gpus=2)
        async with served(cp) as s:
            await eventually(lambda: s.placement.service.is_leader, timeout=20)
            await bus.put(
                bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2)
            )
            await eventually(lambda: all_ready(bus, 2), timeout=30, interval=0.3)
            specs = {
                c.value.gpus: c.value
                for c in (await bus.entries(bus.names.shards_bucket, ShardSpec)).values()
                if c.value is not None
            }
            assert {spec.node for spec in specs.values()} == {"node-a"}, "binpack: both on node-a"
            pinned = specs[(1,)]

            fleet = cp.fleets[0][0]
            fleet.gpus_per_node = 1
            await bus.put(bus.names.nodes_bucket, "node-a", fleet.status("node-a", 0))

            said = "GPU 1 is no longer on node-a (it reports 1 GPU: 0)"

            async def failed_in_words() -> bool:
                events = await replica_events(bus, "chat", pinned.replica)
                assert ("failed", said) in events, events
                return True

            await eventually(failed_in_words, timeout=30, interval=0.3)

            async def moved() -> dict[str, str]:
                found = await all_ready(bus, 2)
                where = {r.replica: r.members[0].node for r in found.values()}
                assert sorted(where.values()) == ["node-a", "node-b"], where
                assert pinned.replica not in where, "the pinned replica was removed, not kept"
                return where

            await eventually(moved, timeout=30, interval=0.3)

            async def summed() -> bool:
                status = await last_status(bus, "chat")
                assert status is not None
                assert status.summary == "chat: 2 of 2 ready", status
                return True

            await eventually(summed, timeout=10, interval=0.3)

            async def counted() -> bool:
                page = await s.page()
                # node-a: GPU 0 held; node-b: GPU 0 held, GPU 1 free.
                assert (count_on_page(page, "held"), count_on_page(page, "free")) == (2, 1), page
                return True

            await eventually(counted, timeout=10, interval=0.3)
            assert [g["index"] for g in (await s.nodes())["node-a"]["gpus"]] == [0]
            rows = await get(bus, "replica")
            assert f"chat/{pinned.replica} " not in rows, rows


async def test_scale_past_capacity_warns_with_placements_reasons_and_counts_each_replica_once(
    bus: Bus, nats_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (cell 18): `ctl scale chat --replicas 6` past capacity warned of nothing, and
    the first status said `1 of 6 ready; 6 placing` (the replicas placed in the step counted
    twice, so none was counted as unplaceable)."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1", "n2"], gpus=1)
        async with served(cp) as s:
            await eventually(lambda: s.placement.service.is_leader, timeout=20)
            chat = Deployment(name="chat", profile="tp1", replicas=1)
            await request_replicas(bus, chat, "requested")
            await eventually(lambda: all_ready(bus, 1), timeout=30, interval=0.3)
            capsys.readouterr()

            # `ctl scale` is `request_replicas` of the stored deployment with the new count.
            said = await request_replicas(bus, msgspec.structs.replace(chat, replicas=6), "requested")
            assert said == "deployment chat: 6 x tp1 requested", "exit 0: the write landed"
            reasons = f"n0: {FULL}; n1: {FULL}; n2: {FULL}"
            err = capsys.readouterr().err
            assert err == (
                "llmgw: warning: 3 of 6 replicas of chat cannot be placed now: "
                f"chat: 1 of 6 ready; 2 placing; 3 cannot be placed: {reasons}\n"
            ), err

            settled = f"chat: 3 of 6 ready; 3 cannot be placed: {reasons}"

            async def explained() -> str:
                text = await explain(bus, "chat")
                assert text.splitlines()[0] == settled, text
                return text

            text = await eventually(explained, timeout=30, interval=0.3)
            assert [line.split()[0] for line in text.splitlines()[1:]] == ["NODE", "n0", "n1", "n2"]
            assert f"Summary:      {settled}" in await describe(bus, "deployment", "chat")
            status = (await s.client.get("/api/explain/chat")).json()["status"]
            assert (status["ready"], status["pending"], status["unplaceable"]) == (3, 0, 3), status

            # `ctl deploy` of a deployment nothing can take warns the same way.
            await request_replicas(bus, Deployment(name="more", profile="tp1", replicas=2), "requested")
            err = capsys.readouterr().err
            assert err.startswith(
                "llmgw: warning: 2 of 2 replicas of more cannot be placed now: "
                "more: 0 of 2 ready; 2 cannot be placed: n0: "
            ), err


async def test_a_failed_replicas_reason_reaches_the_summary_and_explain(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression (cell 23): a replica failed on a gated repository (401) was said well on its
    shard and the page, but the deployment's summary and `explain` said only `1 failed`."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0"], gpus=1)
        async with served(cp) as s:
            await eventually(lambda: s.placement.service.is_leader, timeout=20)
            await bus.put(
                bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
            )
            [record] = (await eventually(lambda: all_ready(bus, 1), timeout=30, interval=0.3)).values()
            key = record.shards[0]
            found = await bus.get(bus.names.shard_status_bucket, key, ShardStatus)
            assert found is not None
            gated = (
                "weights hf://org/gated@main: org/gated is gated; accept its terms on the hub and "
                "set HF_TOKEN on the node"
            )
            # What the launcher writes when the hub answers 401: failed, not retried.
            await bus.put(
                bus.names.shard_status_bucket,
                key,
                msgspec.structs.replace(found[0], state="failed", reason=gated, retryable=False, url=""),
            )
            shard = key.split(".", 1)[1]
            summary = f"chat: 0 of 1 ready; 1 failed; {record.replica}: n0/{shard}: {gated}"

            async def explained() -> str:
                text = await explain(bus, "chat")
                assert text == summary, text
                return text

            await eventually(explained, timeout=30, interval=0.3)
            assert f"Summary:      {summary}" in await describe(bus, "deployment", "chat")
            status = (await s.client.get("/api/explain/chat")).json()["status"]
            assert status["summary"] == summary, status
            page = await s.page()
            assert summary in page, page
            assert (await replicas(bus))[f"chat.{record.replica}"].state == "failed"
