"""What every surface says of a node's own trouble, on a real cluster (NATS, a placement process,
installer and launcher processes or `llmgw fleet` nodes): a silent installer and its frozen
progress, a lost node's shards, a change that cannot roll out, a clock that is off.

Each is asserted where an operator reads it: `llmgw ctl` (a process), `/api/*` and the page."""

from __future__ import annotations

import calendar
import html
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from llmgw.fleet import Fleet
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.engines import Profile
from llmgw_core.events import EngineSpec, ReplicaRecord
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.installer_support import ASSET, TAG, build_server, pack, release_server, want
from tests.test_ctl import ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]


def row_of(c: Cluster, node: str) -> str:
    """The node's row in `ctl get nodes`."""
    rows = [line for line in ok(c, "get", "nodes").splitlines() if line.startswith(f"{node} ")]
    assert len(rows) == 1, rows
    return rows[0]


def shard_rows(c: Cluster, node: str) -> list[str]:
    return [line for line in ok(c, "get", "shards").splitlines() if line.startswith(f"{node}/")]


async def api_of(c: Cluster, identity: str = "p1") -> str:
    found = await eventually(
        lambda: re.search(r"API on (http://\S+)", c.log(f"placement-{identity}")), timeout=30
    )
    return found.group(1)


async def ready_on(bus: Bus, deployment: str) -> list[str]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted(
        r.members[0].node
        for c in found.values()
        if (r := c.value) is not None and r.deployment == deployment and r.state == "ready"
    )


async def test_a_silent_installer_is_said_and_a_lost_nodes_shards_read_unknown(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: with node-a's installer killed mid-download (its launcher alive) every surface
    said `alive` and showed `downloading … (…%, …)` frozen as if live; once the node was lost,
    `get shards` and `describe node` kept its shard `ready`."""
    padding = tmp_path / "padding.bin"
    padding.write_bytes(os.urandom(4_000_000))  # incompressible: half of it comes, then nothing
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b"), "padding.bin": padding})
    async with release_server() as rel:
        rel.add_file(archive, "stall")
        await want(bus, EngineSpec(name="llamacpp", version=TAG))
        with cluster(tmp_path, nats_url, prefix) as c:
            extra = {"github_api": rel.api, "allow_os_packages": False}
            c.start_node("node-a", gpus=1, extra=extra)
            c.start_node("node-b", gpus=1, extra=extra)
            c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
            await eventually(
                lambda: _expect(ready_on(bus, "chat"), ["node-a", "node-b"]), timeout=90, interval=0.5
            )
            await eventually(lambda: "downloading" in row_of(c, "node-a"), timeout=60, interval=0.5)
            assert "installer silent" not in row_of(c, "node-a")

            c.kill("installer-node-a")  # the process this test started, by its recorded pid

            async def said_in_ctl() -> str:
                row = row_of(c, "node-a")
                assert re.search(r"alive, installer silent \d+ s", row), row
                assert re.search(r"downloading \S+ \(.*\), stale: no word for \d+ s", row), row
                return row

            await eventually(said_in_ctl, timeout=30, interval=0.5)
            assert "installer silent" not in row_of(c, "node-b"), "node-b's installer beats"
            described = ok(c, "describe", "node", "node-a")
            assert re.search(
                r"^Warnings: +installer on node-a silent for \d+ s: install progress stale", described, re.M
            ), described
            assert re.search(r"^Install: +.*downloading .*, stale: no word for \d+ s$", described, re.M)

            api = await api_of(c)
            async with httpx.AsyncClient(base_url=api, timeout=10, headers=c.api_headers) as client:
                rows = {r["node"]: r for r in (await client.get("/api/nodes")).json()}
                a, b = rows["node-a"], rows["node-b"]
                assert a["alive"] is True
                [problem] = a["problems"]
                assert re.fullmatch(r"installer on node-a silent for \d+ s: install progress stale", problem)
                assert re.search(r", stale: no word for \d+ s$", a["install"]), a["install"]
                assert b["problems"] == [], b
                assert "stale" not in b["install"], b["install"]
                page = (await client.get("/")).text
                assert re.search(
                    r"<li data-problem='node-a'>installer on node-a silent for \d+ s: install progress stale",
                    page,
                ), page

                # Now the node is lost: its launcher and engines killed too.
                engines = c.engine_pids("node-a")
                c.kill("launcher-node-a")
                for pid in engines:
                    os.killpg(pid, signal.SIGKILL)

                async def unknown_in_ctl() -> list[str]:
                    [shard] = shard_rows(c, "node-a")
                    assert re.search(r"unknown \(node lost \d+ s ago\)", shard), shard
                    assert " ready " not in shard, shard
                    return [shard]

                await eventually(unknown_in_ctl, timeout=30, interval=0.5)
                [other] = shard_rows(c, "node-b")
                assert " ready " in other, other
                described = ok(c, "describe", "node", "node-a")
                shards = described.split("\nShards:\n", 1)[1].split("\nEvents:\n", 1)[0]
                assert re.search(r"node-a/\S+ +node-a +unknown \(node lost \d+ s ago\)", shards), shards
                assert " ready " not in shards, shards

                listed = (await client.get("/api/shards")).json()
                mine = [s for s in listed if s["node"] == "node-a"]
                assert len(mine) == 1, listed
                assert re.fullmatch(r"unknown \(node lost \d+ s ago\)", mine[0]["state"]), mine
                assert mine[0]["status"]["state"] == "ready", "the stored status is the node's last word"
                assert [s["state"] for s in listed if s["node"] == "node-b"] == ["ready"]
                page = (await client.get("/")).text
                assert re.search(
                    r"data-shard='node-a\.[^']+'>[^<]+: <span class=bad>unknown \(node lost \d+ s ago\)", page
                ), page


async def _expect(found: Any, wanted: list[str]) -> bool:
    got = await found
    assert got == wanted, got
    return True


async def test_a_profile_change_or_a_drain_that_cannot_proceed_is_said_everywhere(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a profile edit no node could satisfy, its replica serving on the old one, read
    `chat: 1 of 1 ready` everywhere, as did a drain with nowhere to go."""
    tiny = sim_catalog()
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", [tiny], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        await eventually(lambda: _expect(ready_on(bus, "chat"), ["node-1"]), timeout=90, interval=0.5)
        await bus.put(bus.names.catalog_bucket, "tiny", Profile(**{**tiny, "gpu_class": "A100-80G"}))

        rolled = (
            "chat: 1 of 1 ready; rolling update blocked: no node fits the new profile: "
            "node-1: GPU class H100-80G, profile needs A100-80G"
        )

        async def explained() -> str:
            text = ok(c, "explain", "chat")
            assert text.splitlines()[0] == rolled, text
            return text

        await eventually(explained, timeout=30, interval=0.5)
        assert await ready_on(bus, "chat") == ["node-1"], "the serving replica is left alone"
        assert f"Summary:      {rolled}" in ok(c, "describe", "deployment", "chat")
        api = await api_of(c)
        async with httpx.AsyncClient(base_url=api, timeout=10, headers=c.api_headers) as client:
            status = (await client.get("/api/explain/chat")).json()["status"]
            assert status["summary"] == rolled, status
            assert status["blocked"] == rolled.removeprefix("chat: 1 of 1 ready; "), status
            assert (status["ready"], status["unplaceable"]) == (1, 0), status
            page = (await client.get("/")).text
            assert f"<li data-problem='chat'>{rolled}</li>" in page, page

            # The edit undone: nothing is blocked any more.
            await bus.put(bus.names.catalog_bucket, "tiny", Profile(**tiny))
            await eventually(lambda: ok(c, "explain", "chat").strip() == "chat: 1 of 1 ready", timeout=30)

            said = ok(c, "drain", "node-1", "--reason", "disk swap")
            assert "node node-1 draining by " in said

            async def drain_blocked() -> str:
                first = ok(c, "explain", "chat").splitlines()[0]
                assert re.fullmatch(
                    r"chat: 1 of 1 ready; drain of node-1 blocked: no other node fits: "
                    r"node-1: draining by \S+ at [-0-9: ]+UTC: disk swap",
                    first,
                ), first
                return first

            first = await eventually(drain_blocked, timeout=30, interval=0.5)
            assert f"Summary:      {first}" in ok(c, "describe", "deployment", "chat")
            status = (await client.get("/api/explain/chat")).json()["status"]
            assert status["summary"] == first, status
            page = (await client.get("/")).text
            assert f"<li data-problem='chat'>{first}</li>" in page, page
            assert await ready_on(bus, "chat") == ["node-1"], "a drain never stops the only replica"


async def aok(c: Cluster, *args: str) -> str:
    """`ok` off the event loop: an in-process fleet beats on while ctl runs."""
    return await anyio.to_thread.run_sync(lambda: ok(c, *args))


async def arow_of(c: Cluster, node: str) -> str:
    return await anyio.to_thread.run_sync(row_of, c, node)


async def ashard_rows(c: Cluster, node: str) -> list[str]:
    return await anyio.to_thread.run_sync(shard_rows, c, node)


async def test_a_node_whose_clock_is_off_is_warned_of_and_its_ages_are_placements(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a node 10 minutes behind was `lost: no heartbeat since 18:07:47` at 18:17:47
    (the node's clock, quoted), and nothing said its clock was off."""
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        fleet_bus = await Bus.connect(BusOptions(**c.nats("fleet")), service="llmgw-fleet")
        fleet = Fleet(fleet_bus, ["sim-0"], gpus_per_node=1, heartbeat_interval_s=0.3, clock_skew_s=-600.0)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(fleet.run)
                warning = "clock 600 s behind placement's"

                async def warned() -> str:
                    row = await arow_of(c, "sim-0")
                    assert warning in row, row
                    return row

                await eventually(warned, timeout=60, interval=0.5)
                await eventually(lambda: _expect(ready_on(bus, "chat"), ["sim-0"]), timeout=60, interval=0.5)
                described = await aok(c, "describe", "node", "sim-0")
                assert re.search(rf"^Warnings: +{warning}$", described, re.M), described
                # Ages from placement's clock: the node stamped its probe and its shard ten
                # minutes in the past, and they read seconds old.
                assert re.search(r"^Probed: +\d+ s ago$", described, re.M), described
                [shard] = await ashard_rows(c, "sim-0")
                assert re.search(r" ready +chat/r0 +0 +\d+ s ", shard), shard
                api = await api_of(c)
                async with httpx.AsyncClient(base_url=api, timeout=10, headers=c.api_headers) as client:
                    [row] = (await client.get("/api/nodes")).json()
                    assert row["problems"] == [warning], row
                    page = (await client.get("/")).text
                    assert f"<div class=warn>{html.escape(warning)}</div>" in page, page
                    assert f"<li data-problem='sim-0'>{html.escape(warning)}</li>" in page, page

                    fleet.clock_skew_s = 0.0  # its time sync fixed

                    async def unwarned() -> bool:
                        # Alive and unwarned: a node briefly lost on a loaded machine shows no
                        # clock warning either, without its clock agreeing.
                        [row] = (await client.get("/api/nodes")).json()
                        return bool(row["alive"]) and row["problems"] == []

                    await eventually(unwarned, timeout=30, interval=0.5)
                    assert warning not in await arow_of(c, "sim-0")
                await eventually(
                    lambda: "node sim-0: its clock agrees with placement's again" in c.log("placement-p1"),
                    timeout=10,
                )
                log = c.log("placement-p1")
                assert log.count("node sim-0: its clock is 600 s behind placement's") == 1, log
                assert log.count("node sim-0: its clock agrees with placement's again") == 1, log

                # Off again, then lost: the refusal quotes when placement last heard it, by
                # placement's clock, not the node's.
                fleet.clock_skew_s = -600.0
                await eventually(warned, timeout=30, interval=0.5)
                tg.cancel_scope.cancel()

            async def lost() -> str:
                text = await aok(c, "explain", "chat")
                assert "sim-0: lost: no heartbeat since " in text, text
                return text

            text = await eventually(lost, timeout=60, interval=0.5)
            stamp = re.search(r"no heartbeat since (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) UTC", text)
            assert stamp, text
            heard = calendar.timegm(time.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S"))
            assert abs(time.time() - heard) < 120, (stamp.group(1), text)
        finally:
            await fleet_bus.close()


def test_a_clock_offset_is_a_warning_over_2_s_until_it_is_back_under_1_5_s() -> None:
    from llmgw_core.events import NodeLiveness
    from llmgw_placement.liveness import clock_off, clock_turn

    assert [clock_off(x, False) for x in (2.0, 2.1, -2.1, 600.0)] == [False, True, True, True]
    assert [clock_off(x, True) for x in (1.6, -1.6, 1.5, 0.2)] == [True, True, False, False]
    # A warning starts (or ends) only once the beats have said so for the settle time: a burst
    # of beats queued while placement was behind reads as a clock behind, and is no warning.
    assert clock_turn(-3.0, False, None, 10.0, 1.0) == (False, 10.0)
    assert clock_turn(-3.0, False, 10.0, 10.5, 1.0) == (False, 10.0)
    assert clock_turn(0.1, False, 10.0, 10.6, 1.0) == (False, None)
    assert clock_turn(-600.0, False, 10.0, 11.0, 1.0) == (True, None)
    assert clock_turn(-600.0, True, None, 12.0, 1.0) == (True, None)
    assert clock_turn(0.0, True, None, 13.0, 1.0) == (True, 13.0)
    assert clock_turn(0.0, True, 13.0, 14.0, 1.0) == (False, None)
    ahead = NodeLiveness(node="n", alive=True, silent_s=0.2, clock_offset_s=600.4)
    assert ahead.problems() == ("clock 600 s ahead of placement's",)
    behind = NodeLiveness(node="n", alive=True, silent_s=0.2, clock_offset_s=-3.0)
    assert behind.clock_words() == "clock 3 s behind placement's"
    stale = NodeLiveness(
        node="node-b", alive=True, silent_s=0.2, installer_silent_s=53.7, installer_stale=True
    )
    assert stale.problems() == ("installer on node-b silent for 53 s: install progress stale",)
    assert stale.install_shown("downloading x (92%, 6 MB of 7 MB)") == (
        "downloading x (92%, 6 MB of 7 MB), stale: no word for 53 s"
    )
    assert stale.install_shown("") == ""
    lost = NodeLiveness(node="n", alive=False, silent_s=13.2)
    assert (lost.shard_reading("ready"), ahead.shard_reading("ready")) == (
        "unknown (node lost 13 s ago)",
        "ready",
    )
