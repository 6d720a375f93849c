"""Storage is bounded and its exhaustion said: bucket limits from configuration, writes that
NATS refuses for space told apart as `StoreFull`, once per episode, until writes land again.

The NATS servers are real: the session's (its store is large, so the buckets' own limits are
what refuses) and servers of the test's own whose JetStream store is a few MiB, filled by a
stream without limits until nats-server refuses every write.
"""

from __future__ import annotations

import contextlib
import errno
import html
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js import api

from llmgw.auth import AuthDir
from llmgw.ctl import CannotStore
from llmgw.ctl._commands import request_replicas
from llmgw_core import store
from llmgw_core.bus import Bus, BusOptions, Writes
from llmgw_core.config import AgentConfig, loads
from llmgw_core.errors import BusError, ConfigError, StoreFull
from llmgw_core.events import (
    Deployment,
    DesiredEngines,
    NodeFacts,
    NodeStatus,
    ReplicaRecord,
    ShardStatus,
    now,
)
from llmgw_core.metrics import bus_metrics
from llmgw_core.natsd import NatsServer
from llmgw_core.subjects import Names
from llmgw_core.web import serve
from llmgw_placement.api import Api
from tests.auth_support import session_for
from tests.cluster_support import cluster, sim_catalog
from tests.control_support import control_plane, ready_replicas
from tests.metrics_support import value
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

FILLER = "FILLER"


def small(**options: Any) -> BusOptions:
    """A cluster of a few nodes: every bucket but keys and limits at its 1 MiB floor, 27.5 MiB in
    all with the streams."""
    return BusOptions(max_nodes=4, max_shards=8, max_deployments=4, events_max_bytes=4 << 20, **options)


def test_bucket_limits_follow_the_formula_and_its_overrides() -> None:
    names = Names("p")
    o = BusOptions()
    limits = store.stream_limits(o, names)
    # keys × bytes a value takes × (history + 1), at least 1 MiB.
    assert limits["KV_p-nodes"] == store.Limits(256 * 16 * 1024 * 6, 1 << 20)
    assert limits["KV_p-shards"].max_bytes == 2048 * 8 * 1024 * 6 == 96 << 20
    assert limits["KV_p-shard-status"].max_bytes == limits["KV_p-replicas"].max_bytes == 96 << 20
    assert limits["KV_p-config"].max_bytes == 1 << 20  # 16 keys × 8 KiB × 6 is under the floor
    assert limits["P_EVENTS"] == store.Limits(256 << 20)
    assert limits["P_DLQ"] == store.Limits(64 << 20)
    assert limits["P_USAGE"] == store.Limits(256 << 20)
    assert set(limits) == {"P_EVENTS", "P_DLQ", "P_USAGE", *(f"KV_{b}" for b in names.buckets())}
    assert names.buckets() == tuple(f"p-{b}" for b in store.BUCKETS)
    assert store.size(store.total_bytes(o, names)) == "979 MiB"

    few = small()
    assert {n: v.max_bytes for n, v in store.stream_limits(few, names).items() if n.startswith("KV_")} == {
        **{f"KV_{b}": 1 << 20 for b in names.buckets()},
        # Sized for 1,024 client keys, however small the cluster.
        "KV_p-keys": 6 << 20,
        "KV_p-limits": 3 << 19,
    }
    # The old 16 MiB, the usage stream (as large as the events stream), the two key buckets and
    # the node-intent and routing buckets' floors.
    assert store.total_bytes(few, names) == (16 << 20) + (4 << 20) + (6 << 20) + (3 << 19) + (2 << 20)
    bigger = BusOptions(max_nodes=10_000, bucket_max_bytes={"shard-status": 5 << 30})
    assert store.bucket_bytes(bigger, "nodes") == 10_000 * 16 * 1024 * 6
    assert store.bucket_bytes(bigger, "shard-status") == 5 << 30


def test_a_limit_for_a_bucket_that_does_not_exist_is_refused_naming_the_buckets() -> None:
    with pytest.raises(ConfigError) as err:
        loads("node: n1\nnats:\n  bucket_max_bytes: {shard_status: 1000}\n", AgentConfig, source="agent.yaml")
    assert str(err.value) == (
        "agent.yaml: bucket_max_bytes names no bucket: shard_status (the buckets: config, catalog, "
        "deployments, nodes, shards, shard-status, replicas, leases, keys, limits, node-intent, "
        "routing) - at `$.nats`"
    )
    with pytest.raises(ConfigError, match=r"Expected `int` >= 1 - at `\$.nats.max_shards`"):
        loads("node: n1\nnats: {max_shards: 0}\n", AgentConfig, source="agent.yaml")


def test_refusals_for_space_are_told_apart_by_nats_servers_own_codes() -> None:
    full = store.space_refusal(10023, "insufficient resources", stream="KV_p-shards")
    assert full == store.Refusal(
        "nats-server's JetStream store is at its limit (insufficient resources, error 10023)",
        server_wide=True,
    )
    bucket = store.space_refusal(10077, "maximum bytes exceeded", stream="KV_p-shards", limit=1 << 20)
    assert bucket == store.Refusal("KV_p-shards holds its limit of 1 MiB (maximum bytes exceeded)", False)
    reserve = store.space_refusal(10047, "insufficient storage resources available", stream="P_DLQ")
    assert reserve is not None
    assert not reserve.server_wide
    assert reserve.reason.startswith("P_DLQ's limit does not fit what nats-server's JetStream store has left")
    disk = store.space_refusal(10077, "write …/1.blk: no space left on device", stream="KV_p-leases")
    assert disk is not None
    assert "disk under nats-server's store is full" in disk.reason
    # Not refusals for space: a wrong revision, a value over the size limit, no such stream.
    assert store.space_refusal(10071, "wrong last sequence: 3", stream="KV_p-leases") is None
    assert store.space_refusal(10054, "message size exceeds maximum allowed", stream="KV_p-nodes") is None
    assert store.space_refusal(10059, "stream not found", stream="KV_p-nodes") is None


def test_an_episode_is_said_once_and_ends_with_the_first_write_that_lands() -> None:
    watch = store.StoreWatch()
    server = store.Refusal("the store is at its limit", server_wide=True)
    bucket = store.Refusal("KV_p-shards holds its limit of 1 MiB", server_wide=False)
    at = 1_700_000_000.0
    assert watch.refused("KV_p-leases", server, at) is True  # the episode starts: said
    assert watch.refused("KV_p-replicas", server, at + 1) is False  # the same reason: not news
    assert watch.refused("KV_p-shards", bucket, at + 2) is True  # a reason of its own: said
    assert watch.refused("KV_p-shards", bucket, at + 3) is False
    since = store.clock(at)
    assert watch.banner() == (
        "NATS store full: the store is at its limit (KV_p-leases, KV_p-replicas); "
        f"KV_p-shards holds its limit of 1 MiB: writes refused since {since}"
    )
    # Any write that lands shows the server has room: the server-wide refusals are over; the
    # bucket at its own limit is over only when a write to it lands.
    assert watch.stored("KV_p-events") is None
    assert (
        watch.banner()
        == f"NATS store full: KV_p-shards holds its limit of 1 MiB: writes refused since {since}"
    )
    ended = watch.stored("KV_p-shards")
    assert ended is not None
    assert ended.refused == 4
    assert (watch.full, watch.banner(), watch.refused_total, watch.episodes) == (False, "", 4, 1)
    assert watch.stored("KV_p-shards") is None


async def test_ensure_sizes_every_stream_and_only_ever_raises_a_limit(nats_url: str, prefix: str) -> None:
    async def limits(bus: Bus) -> dict[str, tuple[int, int]]:
        out = {}
        for stream in bus.limits:
            config = (await bus.js.stream_info(stream)).config
            out[stream] = (config.max_bytes or -1, config.max_msg_size or -1)
        return out

    few = await Bus.connect(small(url=nats_url, prefix=prefix), service="test")
    try:
        # A bucket an older llmgw made, without limits: it gets them.
        await few.js.create_key_value(api.KeyValueConfig(bucket=few.names.nodes_bucket, history=5))
        await few.ensure()
        assert await limits(few) == {s: (v.max_bytes, v.max_msg_size) for s, v in few.limits.items()}
        assert (await limits(few))[f"KV_{prefix}-shards"] == (1 << 20, 1 << 20)
        larger = BusOptions(url=nats_url, prefix=prefix, max_shards=64, max_value_bytes=2 << 20)
        async with await Bus.connect(larger, service="test") as bigger:
            await bigger.ensure()
            assert (await limits(bigger))[f"KV_{prefix}-shards"] == (64 * 8 * 1024 * 6, 2 << 20)
        # The small configuration again (a node agent's, say): nothing is lowered.
        await few.ensure()
        assert (await limits(few))[f"KV_{prefix}-shards"] == (64 * 8 * 1024 * 6, 2 << 20)
        assert (await limits(few))[f"{prefix.upper()}_EVENTS"] == (4 << 20, -1)
    finally:
        await few.close()


@pytest.fixture
def small_store(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server whose JetStream store holds 48 MiB: llmgw's streams reserve 27.5 of it."""
    server = NatsServer(store_dir=tmp_path / "nats", max_store="48M")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def fill(url: str) -> int:
    """Write a stream without limits until nats-server refuses (its store is full); the bytes."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.add_stream(api.StreamConfig(name=FILLER, subjects=["filler"]))
        chunk = b"x" * (64 << 10)
        written = 0
        refused: nats.js.errors.APIError | None = None
        while refused is None:
            try:
                await js.publish("filler", chunk)
                written += len(chunk)
            except nats.js.errors.APIError as exc:
                refused = exc
        assert refused.err_code == store.INSUFFICIENT_RESOURCES, refused
        return written
    finally:
        await nc.close()


async def free(url: str) -> None:
    nc = await nats.connect(url)
    try:
        await nc.jetstream().delete_stream(FILLER)
    finally:
        await nc.close()


@pytest.fixture
async def small_bus(small_store: NatsServer) -> AsyncIterator[Bus]:
    bus = await Bus.connect(small(url=small_store.url, prefix="c", insecure=True), service="svc")
    await bus.ensure()
    try:
        yield bus
    finally:
        await bus.close()


def _store_metrics(bus: Bus) -> dict[str, float]:
    return {
        s.name: s.value for m in bus_metrics(bus) for s in m.samples if "store" in s.name or "space" in s.name
    }


async def test_a_full_store_refuses_writes_as_store_full_said_once_until_one_lands(
    small_store: NatsServer, small_bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    bus = small_bus
    names = bus.names
    dep = Deployment(name="chat", profile="tiny")
    await bus.put(names.deployments_bucket, "chat", dep)
    assert await fill(small_store.url) > 8 << 20
    caplog.set_level(logging.WARNING, logger="llmgw.bus")

    refused: list[StoreFull] = []
    for _ in range(3):
        with pytest.raises(StoreFull) as err:
            await bus.put(names.deployments_bucket, "chat", dep)
        refused.append(err.value)
    writes = Writes()
    writes.put(names.replicas_bucket, "chat.r0", dep)
    writes.publish(names.deployment_event("chat"), dep)
    with pytest.raises(StoreFull):
        await bus.commit(writes)
    with pytest.raises(StoreFull) as published:
        await bus.publish(names.placement_event("chat"), dep)
    since = store.clock(bus.store.episode.since if bus.store.episode else 0)
    reason = "nats-server's JetStream store is at its limit (insufficient resources, error 10023)"
    assert str(refused[0]) == f"write c-deployments/chat refused: NATS store full: {reason}"
    assert published.value.banner == bus.store.banner()
    assert bus.store.banner() == (
        f"NATS store full: {reason} (C_EVENTS, KV_c-deployments, KV_c-replicas): writes refused since {since}"
    )
    # Said once, however many writes were refused, and counted.
    said = [r.getMessage() for r in caplog.records if "NATS store full" in r.getMessage()]
    assert said == [
        f"svc: NATS store full: {reason} (KV_c-deployments): writes refused since {since}; free space in "
        "NATS's store or raise the limit (docs/operations.md)"
    ]
    assert _store_metrics(bus) == {"llmgw_bus_store_full": 1, "llmgw_bus_writes_refused_for_space_total": 5}
    # Nothing refused was stored.
    assert (await bus.get(names.deployments_bucket, "chat", Deployment)) == (dep, 1)

    await free(small_store.url)
    await bus.put(names.deployments_bucket, "chat", dep)
    assert not bus.store.full
    assert bus.store.banner() == ""
    again = [r.getMessage() for r in caplog.records if "NATS stores again" in r.getMessage()]
    assert len(again) == 1
    assert again[0].startswith("svc: NATS stores again: writes work after ")
    assert again[0].endswith(f" (5 refused since {since})")
    assert _store_metrics(bus) == {"llmgw_bus_store_full": 0, "llmgw_bus_writes_refused_for_space_total": 5}
    await bus.commit(writes)


async def test_streams_that_do_not_fit_the_store_are_refused_saying_what_they_need(tmp_path: Path) -> None:
    server = NatsServer(store_dir=tmp_path / "nats", max_store="64M")
    server.start()
    try:
        # The default sizes, on a 64 MiB store.
        async with await Bus.connect(
            BusOptions(url=server.url, prefix="d", insecure=True), service="svc"
        ) as bus:
            with pytest.raises(StoreFull) as err:
                await bus.ensure()
    finally:
        server.stop()
    assert str(err.value) == (
        "creating D_EVENTS (256 MiB) refused: NATS store full: D_EVENTS's limit does not fit what "
        "nats-server's JetStream store has left (insufficient storage resources available, error 10047); "
        "llmgw's streams need 979 MiB in all on each NATS server that holds them: give its JetStream store "
        "more room (jetstream { max_file_store }, a larger disk) or size llmgw for a smaller cluster (nats: "
        "max_nodes, max_shards, max_deployments, events_max_bytes; docs/operations.md)"
    )


async def test_a_node_writing_50000_keys_of_its_own_is_refused_at_its_buckets_limit(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: buckets had no byte limit, and one node identity wrote 50,000 keys of its own
    (shard statuses under its node) in 14 s, on its way to filling the store under every bucket."""
    session = session_for(nats_url)
    if session is None:
        pytest.skip("needs the session's own nats-server (identities are added to its configuration)")
    auth: AuthDir = session.identities(prefix, tmp_path / "auth", ["gpu-1"])
    placement = await Bus.connect(
        small(url=session.url, prefix=prefix, nkey_seed_file=str(auth.seed("placement"))), service="placement"
    )
    node = await Bus.connect(
        BusOptions(url=session.url, prefix=prefix, nkey_seed_file=str(auth.seed("node-gpu-1"))),
        service="node",
    )
    try:
        await placement.ensure()
        names = node.names
        stream = f"KV_{names.shard_status_bucket}"
        written = 0
        refused: StoreFull | None = None
        # 500 at a time while whole batches fit, then one by one: every key it can.
        for size in (500, 1):
            refused = None
            while written < 50_000 and refused is None:
                writes = Writes()
                for i in range(written, written + size):
                    status = ShardStatus(node="gpu-1", shard=f"s{i}", replica="r0", state="ready", at=now())
                    writes.put(names.shard_status_bucket, f"gpu-1.s{i}", status)
                try:
                    await node.commit(writes)
                    written += size
                except StoreFull as exc:
                    refused = exc
        assert refused is not None, f"{written} keys written, none refused"
        assert 1000 < written < 10_000
        assert str(refused) == (
            f"a write to $KV.{names.shard_status_bucket}.gpu-1.s{written} refused: NATS store full: "
            f"{stream} holds its limit of 1 MiB (maximum bytes exceeded)"
        )
        info = await placement.js.stream_info(stream)
        assert info.state.bytes <= 1 << 20
        # The write refused, tried again as it was written (the same batch): refused for as
        # long as it keeps trying. Any other message, a plain put of the same value included,
        # may differ by a few bytes and fit what the bucket has left. Its bucket alone is
        # full, not the store.
        for _ in range(3):
            with pytest.raises(StoreFull):
                await node.commit(writes)
        facts = NodeFacts(node="gpu-1")
        await node.put(names.nodes_bucket, "gpu-1", NodeStatus(node="gpu-1", facts=facts))
        await placement.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
    finally:
        await node.close()
        await placement.close()


def _lines(log: str, text: str) -> list[str]:
    return [line for line in log.splitlines() if text in line]


@pytest.mark.timeout(300)
async def test_a_full_nats_store_is_said_refused_to_users_and_outlived_without_a_restart(
    small_store: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """Regression: with the store full, placement looped re-placing one replica (ids r2…r17 used
    up), `ctl scale` returned 0 with nothing acted on, and nothing said the store was full."""
    url = small_store.url
    sizes = {"max_nodes": 4, "max_shards": 8, "max_deployments": 4, "events_max_bytes": 4 << 20}
    async with await Bus.connect(small(url=url, prefix=prefix, insecure=True), service="test") as bus:
        with cluster(tmp_path, url, prefix) as c:
            c.nats_options = sizes
            for node in ("n1", "n2", "n3"):
                c.start_node(node, gpus=1)
            c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 2}])
            await eventually(lambda: _ready(bus, "chat", 2), timeout=120, interval=1.0)
            found = re.search(r"API on (http://\S+)", c.log("placement-p1"))
            assert found is not None
            before = await _replicas(bus, "chat")
            assert sorted(r.replica for r in before) == ["r0", "r1"]
            on = {r.replica: r.members[0].node for r in before}
            lost, kept = on["r0"], on["r1"]
            running = {name: proc.pid for name, proc in c.procs.items()}
            ctl = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]
            env = c.ctl_env()

            async with httpx.AsyncClient(base_url=found.group(1), timeout=30) as api:
                await fill(url)
                # r0's node is lost (placement must place it again), r1's engine is killed (its
                # launcher restarts it and writes the statuses): none of it can be stored.
                c.kill_node(lost)
                (engine,) = c.engine_pids(kept)
                os.killpg(engine, signal.SIGKILL)

                posted = await api.post(
                    "/api/deployments", json={"name": "chat", "profile": "tiny", "replicas": 3}
                )
                assert posted.status_code == 507
                reason = "nats-server's JetStream store is at its limit (insufficient resources, error 10023)"
                assert posted.json() == {
                    "error": f"write {prefix}-deployments/chat refused: NATS store full: {reason}"
                }
                scaled = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [*ctl, "--prefix", prefix, "scale", "chat", "--replicas", "3"],
                        capture_output=True,
                        text=True,
                        env=env,
                        timeout=60,
                    )
                )
                assert (scaled.returncode, scaled.stdout) == (6, ""), scaled.stderr
                assert scaled.stderr == (
                    f"llmgw: write {prefix}-deployments/chat refused: NATS store full: {reason}; "
                    "nothing was changed (docs/operations.md)\n"
                )

                # Placement fails the node over in memory and keeps failing to write it, with
                # backoff: the same replica every time, no new ids.
                seen: set[str] = set()

                async def steps_failed(n: int) -> bool:
                    seen.update((await api.get("/api/replicas")).json())
                    metrics = (await api.get("/metrics")).text
                    return value(metrics, "llmgw_placement_step_failures_total") >= n

                await eventually(lambda: steps_failed(1), timeout=30)
                said = len(_lines(c.log("placement-p1"), "NATS store full"))
                await eventually(lambda: steps_failed(6), timeout=60, interval=0.2)
                assert seen == {"chat.r0", "chat.r1", "chat.r2"}, seen
                placing = (await api.get("/api/replicas")).json()["chat.r2"]
                assert placing["state"] == "placing"
                assert {m["node"] for m in placing["members"]} == {({"n1", "n2", "n3"} - {lost, kept}).pop()}
                log = c.log("placement-p1")
                assert len(_lines(log, "NATS store full")) == said, "said again, not once"
                episode = _lines(log, "writes refused since")
                assert len(episode) == 1, log
                assert f"placement: NATS store full: {reason}" in episode[0]
                store_api = (await api.get("/api/store")).json()
                assert store_api["full"] is True
                since = f"writes refused since {store.clock(store_api['since'])}"
                assert store_api["banner"].startswith(f"NATS store full: {reason} (")
                assert store_api["banner"].endswith(since)
                assert since in episode[0]
                page = (await api.get("/")).text
                assert f"<p class=alert id=store>{html.escape(store_api['banner'])}</p>" in page
                assert value((await api.get("/metrics")).text, "llmgw_bus_store_full") == 1
                # The launcher whose engine restarted said it once, too.
                launcher = c.log(f"launcher-{kept}")
                assert len(_lines(launcher, "writes refused since")) == 1, launcher

                await free(url)
                # Nothing restarted: the writes land, r0 goes, r2 starts, r1's status catches up.
                await eventually(lambda: _ready(bus, "chat", 2, {"r1", "r2"}), timeout=120, interval=1.0)
                assert (await api.get("/api/store")).json()["full"] is False
                assert "id=store" not in (await api.get("/")).text
                assert len(_lines(c.log("placement-p1"), "NATS stores again")) == 1
                await eventually(lambda: _lines(c.log(f"launcher-{kept}"), "NATS stores again"), timeout=30)
                statuses = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
                restarted = next(s.value for s in statuses.values() if s.value and s.value.replica == "r1")
                assert (restarted.state, restarted.restarts >= 1) == ("ready", True)

                # The scale refused above, now that it is stored, onto a new node: the next id.
                c.start_node("n4", gpus=1)
                scaled = await anyio.to_thread.run_sync(
                    lambda: subprocess.run(
                        [*ctl, "--prefix", prefix, "scale", "chat", "--replicas", "3"],
                        capture_output=True,
                        text=True,
                        env=env,
                        timeout=60,
                    )
                )
                assert (scaled.returncode, scaled.stdout) == (0, "deployment chat: 3 x tiny requested\n"), (
                    scaled.stderr
                )
                await eventually(
                    lambda: _ready(bus, "chat", 3, {"r1", "r2", "r3"}), timeout=120, interval=1.0
                )
            for name, pid in running.items():
                if not name.endswith(lost):
                    assert (c.procs[name].pid, c.procs[name].poll()) == (pid, None), f"{name} restarted"


async def _replicas(bus: Bus, deployment: str) -> list[ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted((c.value for c in found.values() if c.value and c.value.deployment == deployment), key=str)


async def _ready(bus: Bus, deployment: str, n: int, ids: set[str] | None = None) -> bool:
    """`n` replicas of `deployment` ready (and, given `ids`, those and no others in the bucket)."""
    found = await _replicas(bus, deployment)
    ready = {r.replica for r in found if r.state == "ready"}
    assert len(ready) == n, found
    if ids is not None:
        assert {r.replica for r in found} == ids, found
    return True


async def test_a_change_stored_while_placement_cannot_write_is_not_said_done(
    nats_url: str, prefix: str
) -> None:
    """The write lands, but nothing acts on it: placement's own bucket is at its limit. `ctl`
    exits 6 and the API answers 503, each with placement's words; both work again once the
    bucket has room, with no restart."""
    async with control_plane(nats_url, prefix) as cp:
        harness = await cp.connect(
            "test", max_nodes=4, max_shards=8, max_deployments=4, events_max_bytes=4 << 20
        )
        await harness.ensure()
        names = harness.names
        await cp.start_fleet(["n0", "n1"], gpus=1)
        p = await cp.start_placement("a", http={"insecure": True})
        port = await cp.tg.start(serve, Api(p.service).app(), "127.0.0.1", 0)
        await harness.put(
            names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
        )
        await eventually(lambda: ready_replicas(harness, "chat"), timeout=60)

        # Values nobody placed fill the shards bucket to its limit, to the last few bytes.
        filled = 0
        for reason in ("x" * 4000, ""):
            junk = ShardStatus(node="x", shard="x", replica="r0", state="ready", reason=reason)
            while True:
                try:
                    await harness.put(names.shards_bucket, f"junk.s{filled}", junk)
                except StoreFull:
                    break
                filled += 1
        assert 200 < filled < 2000

        with pytest.raises(CannotStore) as err:
            await request_replicas(harness, Deployment(name="chat", profile="tp1", replicas=2), "requested")
        blocked = p.service.cannot_write()
        stream = f"KV_{names.shards_bucket}"
        assert blocked.startswith(
            f"NATS store full: {stream} holds its limit of 1 MiB (maximum bytes exceeded)"
        )
        assert str(err.value) == (
            f"deployment chat: 2 x tp1 written, but placement cannot act on it: {blocked}; it does once NATS "
            "stores again (docs/operations.md)"
        )
        stored = await harness.get(names.deployments_bucket, "chat", Deployment)
        assert stored is not None
        assert stored[0].replicas == 2
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as api:
            posted = await api.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1", "replicas": 2}
            )
            assert (posted.status_code, posted.json()) == (
                503,
                {
                    "error": f"deployment chat written, but placement cannot act on it: {blocked}",
                    "stored": True,
                },
            )
            # The operator removes what filled it: placement writes the second replica, unprompted.
            await harness.js.purge_stream(stream, subject=f"$KV.{names.shards_bucket}.junk.>")
            await eventually(lambda: _ready(harness, "chat", 2, {"r0", "r1"}), timeout=60, interval=1.0)
            assert p.service.cannot_write() == ""
            posted = await api.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1", "replicas": 2}
            )
            assert posted.status_code == 200
        await request_replicas(harness, Deployment(name="chat", profile="tp1", replicas=2), "requested")
        assert cp.crashes() == []


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (root only): a disk that really fills."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs for the NATS store needs root")
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill_disk(ballast: Path) -> None:
    """Write zeros until the disk refuses (ENOSPC)."""
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError, match="No space left") as full:  # noqa: PT012 (until the disk refuses)
            while True:
                os.write(fd, b"\0" * 65536)
    finally:
        os.close(fd)
    assert full.value.errno == errno.ENOSPC, full.value


@pytest.mark.timeout(400)
@pytest.mark.slow  # a real filesystem filled to its last byte under NATS, then freed
async def test_a_real_full_disk_is_never_acknowledged_and_outlived_without_an_llmgw_restart(
    tmp_path: Path, prefix: str
) -> None:
    """nats-server's store on a disk that fills for real (ENOSPC, not its own limit).

    nats-server 2.15 answers an atomic batch it cannot stage `incomplete`; a plain write that
    hits ENOSPC gets no answer, and its stream none from then on, even once space is freed,
    until nats-server restarts (docs/operations.md says to). Small writes that fit the space its
    files hold already land.
    """
    with small_disk(tmp_path / "disk", "40m") as disk:
        server = NatsServer(store_dir=disk / "nats", max_store="1G")  # more than the disk holds
        server.start()
        try:
            async with control_plane(server.url, prefix) as cp:
                sizes = {"max_nodes": 4, "max_shards": 8, "max_deployments": 4, "events_max_bytes": 4 << 20}
                harness = await cp.connect("test", **sizes)
                await harness.ensure()
                names = harness.names
                await cp.start_fleet(["n0", "n1"], gpus=1)
                p = await cp.start_placement("a")
                await harness.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
                await eventually(lambda: ready_replicas(harness, "chat"), timeout=60)

                fill_disk(disk / "ballast")
                # A plain write too large for what the files hold: no answer, and its stream stops.
                config = f"KV_{names.config_bucket}"
                with pytest.raises(nats.errors.TimeoutError):
                    await harness.js.publish(f"$KV.{names.config_bucket}.big", b"x" * 200_000, timeout=5)
                engines = DesiredEngines()
                with pytest.raises(StoreFull) as stuck:
                    await harness.put(names.config_bucket, "engines", engines)
                assert str(stuck.value) == (
                    f"write {names.config_bucket}/engines refused: NATS store full: "
                    f"{store.unacknowledged(config).reason}"
                )
                # A scale: whether its own small write lands or not, it is not said done.
                with pytest.raises((CannotStore, BusError)):
                    await request_replicas(
                        harness, Deployment(name="chat", profile="tp1", replicas=2), "requested"
                    )
                seen: set[str] = set()

                async def blocked() -> str:
                    controller = p.service.controller
                    seen.update(controller.replicas if controller else ())
                    return p.service.cannot_write()

                # Which of placement's streams it names (its batches, unstaged; the lease, unanswered)
                # depends on which write met the full disk first.
                said = await eventually(blocked, timeout=120, interval=0.5)
                assert said.startswith("NATS store full: "), said
                assert re.search(r": writes refused since \d\d:\d\d:\d\d$", said), said

                (disk / "ballast").unlink()
                # Room again, but the stream that hit ENOSPC stays silent until nats-server
                # restarts, and is said to.
                with pytest.raises(StoreFull):
                    await harness.put(names.config_bucket, "engines", engines)
                assert harness.store.banner().startswith(
                    f"NATS store full: writes to {config} get no acknowledgement while nats-server answers"
                )
                server.restart()
                # No llmgw process restarts: each reconnects, writes what it could not, and says so.
                await eventually(lambda: _ready(harness, "chat", 2, {"r0", "r1"}), timeout=120, interval=1.0)
                assert seen <= {"chat.r0", "chat.r1"}, seen
                await eventually(lambda: p.service.cannot_write() == "", timeout=30)
                await harness.put(names.config_bucket, "engines", engines)
                assert not harness.store.full
                assert cp.crashes() == []
        finally:
            server.stop()
