"""A NATS store lost under a running cluster: the test's own nats-server stopped, its store
deleted, and started again on the same port (a lost disk). Nothing else is touched.

Regressions pinned here: every launcher exited (`permission to publish to
$JS.API.STREAM.CREATE…`: a node identity made a missing bucket on first use, was refused,
and the refusal ended it); placement's commits were refused (`atomic publish is disabled`:
buckets made on first use with default settings, no events stream) while its `/healthz`
said leader; after the loss placement knew no node until each installer's 600 s recheck;
gateways kept accepting a deleted key and routing to vanished replicas (a watch took the new
bucket's revision 1 for one it had seen, and never heard the old keys go).
"""

from __future__ import annotations

import gc
import re
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus, BusOptions, KVChange, Writes
from llmgw_core.config import AgentConfig
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, InstallProgress, ShardStatus
from llmgw_core.natsd import NatsServer
from llmgw_core.subjects import ONE, Names
from tests.auth_support import SessionNats
from tests.cluster_support import Cluster, sim_catalog
from tests.gateway_support import gateway_process
from tests.launcher_support import running_launcher, shard, sim_profile
from tests.test_gateway_keys import chat, ctl, new_key, refusal
from tests.waiting import eventually

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(120),
    # nats-py drops the transport of a reconnect attempt made while the server was starting
    # without closing it (see tests/test_nats_faults.py): collected here, with this test.
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <(socket\\.socket|function StreamWriter\\.__del__|"
        "function _SelectorTransport\\.__del__):pytest.PytestUnraisableExceptionWarning"
    ),
]


@pytest.fixture(autouse=True)
def _collect_leaked_transports() -> Iterator[None]:
    yield
    gc.collect()


def empty_store(server: NatsServer) -> None:
    """The server stopped, its JetStream store deleted, and started again on the same port."""
    server.stop()
    shutil.rmtree(server.store_dir / "jetstream", ignore_errors=True)
    server.start()


@pytest.fixture
def auth_nats(tmp_path: Path) -> Iterator[SessionNats]:
    """A server of the test's own with identities on, as a deployed cluster runs."""
    session = SessionNats.start(tmp_path / "nats")
    try:
        yield session
    finally:
        session.stop()


async def connect(url: str, prefix: str, service: str, **options: object) -> Bus:
    return await Bus.connect(BusOptions(url=url, prefix=prefix, **options), service=service)  # type: ignore[arg-type]


@pytest.fixture
async def placement_bus(own_nats: NatsServer, prefix: str) -> AsyncIterator[Bus]:
    bus = await connect(own_nats.url, prefix, "placement", insecure=True)
    await bus.ensure()
    try:
        yield bus
    finally:
        await bus.close()


async def test_rebuild_makes_every_lost_stream_again_with_its_limits_before_a_write(
    own_nats: NatsServer, placement_bus: Bus
) -> None:
    bus = placement_bus
    before = {s: (await bus.stream_info(s)).config for s in bus.streams.names()}
    assert await bus.rebuild() == [], "nothing is lost: nothing is made"
    empty_store(own_nats)
    await eventually(lambda: bus.connected, timeout=15)
    gone = await bus.rebuild()
    assert sorted(gone) == sorted(before)
    for stream, config in before.items():
        now = (await bus.stream_info(stream)).config
        assert (now.max_bytes, now.max_msg_size, now.allow_atomic) == (
            config.max_bytes,
            config.max_msg_size,
            config.allow_atomic,
        ), stream
    assert all(before[f"KV_{b}"].allow_atomic for b in bus.names.buckets())
    # A step's commit lands as one atomic batch again (it failed: `atomic publish is disabled`).
    writes = Writes()
    writes.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1))
    writes.publish(bus.names.deployment_event("chat"), Deployment(name="chat", profile="tp1", replicas=1))
    await bus.commit(writes)
    assert set(await bus.keys(bus.names.deployments_bucket)) == {"chat"}
    lost = bus.losses.last
    assert lost is not None
    assert lost.rebuilt is not None
    assert sorted(lost.streams) == sorted(before)
    assert lost.words().startswith("NATS store lost: ")
    assert "store emptied or replaced" in lost.words()


async def test_a_rebuild_cut_short_is_finished_by_the_next_one_though_nothing_is_gone_then(
    own_nats: NatsServer, placement_bus: Bus
) -> None:
    """A lost lease cancels the step a rebuild runs in: the next rebuild (at the next lead) finds
    the streams made so far, makes every one whole (limits, atomic batches) and closes the loss,
    which otherwise stayed `not rebuilt yet` on /healthz for good."""
    bus = placement_bus
    empty_store(own_nats)
    await eventually(lambda: bus.connected, timeout=15)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.rebuild)
        # The loss is noticed just before the streams are made: a few are made, then it is cut.
        await eventually(lambda: bus.losses.last is not None, timeout=15, interval=0.005)
        await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    lost = bus.losses.last
    assert lost is not None
    if lost.rebuilt is None:  # cut short, as a lost lease cuts it
        await bus.rebuild()
    assert lost.rebuilt is not None, lost.words()
    for b in bus.names.buckets():
        assert (await bus.stream_info(f"KV_{b}")).config.allow_atomic, b


async def test_a_watch_over_an_emptied_store_drops_every_key_then_reads_the_new_ones(
    own_nats: NatsServer, placement_bus: Bus, prefix: str
) -> None:
    """The gateway's keys and replicas, as a watch yields them: a key gone with the store is
    yielded deleted; a key written anew at revision 1 is yielded (it was skipped as seen)."""
    bus = placement_bus
    bucket = bus.names.deployments_bucket
    for name in ("old-a", "old-b", "old-c"):
        await bus.put(bucket, name, Deployment(name=name, profile="tp1", replicas=1))
    watcher = await connect(own_nats.url, prefix, "gateway", insecure=True)
    seen: list[KVChange[Deployment]] = []
    back: list[int] = []
    watcher.losses.on_lost.append(lambda: back.append(len(seen)))
    try:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                async for change in watcher.watch(bucket, Deployment):
                    seen.append(change)

            tg.start_soon(watch)
            await eventually(lambda: len(seen) == 3, timeout=10)
            empty_store(own_nats)
            await eventually(lambda: bus.connected and watcher.connected, timeout=15)
            await bus.rebuild()
            await bus.put(bucket, "new", Deployment(name="new", profile="tp1", replicas=1))

            def settled() -> bool:
                current: dict[str, Deployment | None] = {}
                for change in seen:
                    current[change.key] = change.value
                assert {k for k, v in current.items() if v is not None} == {"new"}, seen
                return True

            await eventually(settled, timeout=20)
            tg.cancel_scope.cancel()
        gone = [c.key for c in seen[3:] if c.value is None]
        assert sorted(gone) == ["old-a", "old-b", "old-c"]
        assert back, "the watcher's hooks heard the bucket back"
        assert watcher.losses.last is not None
        assert f"KV_{bucket}" in watcher.losses.last.streams
    finally:
        await watcher.close()


async def test_a_node_identity_waits_for_a_lost_bucket_saying_so_and_never_ends(
    auth_nats: SessionNats, prefix: str, tmp_path: Path
) -> None:
    """A node may not make buckets: it was refused making a lost one on first use, and the
    refusal ended the launcher. Now it is a retryable BusError that says what it waits for,
    and a watch goes on once placement made the bucket again."""
    auth = auth_nats.identities(prefix, tmp_path / "auth", ["n1"])
    placement = await connect(auth_nats.url, prefix, "placement", nkey_seed_file=str(auth.seed("placement")))
    node = await connect(auth_nats.url, prefix, "launcher", nkey_seed_file=str(auth.seed("node-n1")))
    try:
        await placement.ensure()
        names = node.names
        shards, statuses = names.shards_bucket, names.shard_status_bucket
        spec = InstallProgress(node="n1", engine="sim", step="spec", message="a shard spec")
        await placement.put(shards, "n1.s1", spec)
        seen: list[KVChange[InstallProgress]] = []
        async with anyio.create_task_group() as tg:

            async def watch() -> None:  # as the launcher watches its shard specs
                async for change in node.watch(shards, InstallProgress, names.shard_key("n1", ONE)):
                    seen.append(change)

            tg.start_soon(watch)
            await eventually(lambda: len(seen) == 1, timeout=10)
            empty_store(auth_nats.server)
            await eventually(lambda: node.connected and placement.connected, timeout=15)
            with pytest.raises(BusError) as refused:
                await node.put(statuses, "n1.s1", spec)
            assert refused.value.retryable
            said = str(refused.value)
            assert said.startswith(f"launcher: bucket {statuses} does not exist; placement makes llmgw's")
            assert "was NATS's store emptied?" in said
            assert node.losses.last is not None
            assert node.losses.last.rebuilt is None
            assert await placement.rebuild()
            await eventually(lambda: [c.value for c in seen[1:]] == [None], timeout=15)
            await placement.put(shards, "n1.s2", spec)
            fresh = lambda: [c.key for c in seen[2:] if c.value is not None] == ["n1.s2"]  # noqa: E731
            await eventually(fresh, timeout=15)
            await node.put(statuses, "n1.s2", spec)
            tg.cancel_scope.cancel()
        assert not node.lost.is_set()
    finally:
        await node.close()
        await placement.close()


# Within this long of its buckets coming back, a launcher has written its running shards'
# statuses again: its watches retry a missing bucket at most 5 s apart (`Watches._ordered`).
REANNOUNCED_WITHIN_S = 10.0


async def test_a_launcher_writes_its_running_shards_status_again_once_its_buckets_are_back(
    auth_nats: SessionNats, prefix: str, tmp_path: Path
) -> None:
    """A launcher (node identity n1) runs a sim engine; the store is emptied and its buckets made
    again by placement's identity, which writes no status. The first word of the shard in the
    rebuilt status bucket is the launcher's own: `ready`, the engine's pids from before the loss,
    within REANNOUNCED_WITHIN_S. No status change stands behind it: load reads are off (0) and
    the status audit runs every 15 s (heartbeats 5 s apart). The spec went with the store, so
    the launcher then stops the engine and its status goes, as docs/operations.md says; without
    the re-announce that `stopping` was the first word the bucket had of the shard."""
    auth = auth_nats.identities(prefix, tmp_path / "auth", ["n1"])
    placement = await connect(auth_nats.url, prefix, "placement", nkey_seed_file=str(auth.seed("placement")))
    node = {"url": auth_nats.url, "prefix": prefix, "nkey_seed_file": str(auth.seed("node-n1"))}
    config = msgspec.convert(
        {
            "node": "n1",
            "state_dir": str(tmp_path / "n1"),
            "nats": node,
            "stop_grace_s": 3.0,
            "health_interval_s": 0.3,
            "heartbeat_interval_s": 5.0,
            "load_interval_s": 0,
            "mgmt_addr": "127.0.0.1",
        },
        AgentConfig,
    )
    names = placement.names
    key = names.shard_key("n1", "s0")
    try:
        await placement.ensure()
        async with running_launcher(config, gpus=[]):
            await placement.put(names.shards_bucket, key, shard("n1", "s0", sim_profile()))

            async def ready() -> ShardStatus:
                got = await placement.get(names.shard_status_bucket, key, ShardStatus)
                assert got is not None, "no status yet"
                assert got[0].state == "ready", got
                return got[0]

            before = await eventually(ready, timeout=30, interval=0.1)
            empty_store(auth_nats.server)
            await eventually(lambda: placement.connected, timeout=15)
            # The launcher's watches find their buckets gone before placement makes them again.
            await anyio.sleep(1.0)
            assert await placement.rebuild()
            back = time.time()
            gone: list[ShardStatus | None] = []
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    async for change in placement.watch(names.shard_status_bucket, ShardStatus):
                        if change.key == key:
                            gone.append(change.value)

                tg.start_soon(watch)
                await eventually(lambda: gone and gone[-1] is None, timeout=30, interval=0.1)
                tg.cancel_scope.cancel()
            # Every word the rebuilt bucket stored of the shard, in order (the delete stores no
            # status): what a watch opened at any moment would have been told since the rebuild.
            subject = Names.kv_subject(names.shard_status_bucket, key)
            seen = [r async for r in placement.replay(subject, ShardStatus) if r is not None]
            states = [r.value.state for r in seen]
            said = [(round(r.time - back, 2), r.value.state) for r in seen]
            assert seen, said
            first = seen[0].value
            assert (first.state, first.pids, first.restarts) == ("ready", before.pids, 0), said
            assert seen[0].time - back < REANNOUNCED_WITHIN_S, said
            # Then the engine no spec asks for is stopped (and its status went: the watch above).
            assert "stopping" in states[1:], said
    finally:
        await placement.close()


# --- a cluster of real processes ------------------------------------------------------


def placement_api(c: Cluster) -> str:
    found = re.findall(r"API on (http://\S+)", c.log("placement-p1"))
    assert found, c.log("placement-p1")
    return str(found[-1])


@pytest.mark.timeout(180)
async def test_a_cluster_outlives_a_lost_store_and_serves_the_same_keys_once_restored(
    auth_nats: SessionNats, prefix: str, tmp_path: Path
) -> None:
    root = tmp_path / "cluster"
    root.mkdir()
    c = Cluster(root=root, nats_url=auth_nats.harness_url, prefix=prefix)
    c.session, c.auth = auth_nats, auth_nats.identities(prefix, root / "auth")
    harness = await Bus.connect(BusOptions(url=auth_nats.harness_url, prefix=prefix), service="test")
    try:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", [sim_catalog()], [])

        def deployed() -> bool:  # once placement has seeded the catalog from its server.yaml
            done = ctl(c, "deploy", "chat", "--profile", "tiny", "--replicas", "1")
            assert done.returncode == 0, done.stderr
            return True

        await eventually(deployed, timeout=30, interval=0.5)
        secret = new_key(c, "team", "--models", "chat")
        with gateway_process(c, tmp_path / "gw", http={"require_api_key": True}) as gateway:
            url = await gateway.endpoint()

            async def served() -> bool:
                return bool((await chat(url, secret)).choices[0].message.content)

            await eventually(served, timeout=60, interval=0.3)
            kept = tmp_path / "backup.json"
            done = ctl(c, "backup", "-o", str(kept))
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith("backup of the engines, 1 profiles, 1 deployments, 1 keys, 0 node")
            assert secret not in kept.read_text(), "a backup holds a key's hash, never its secret"

            empty_store(auth_nats.server)
            api = placement_api(c)
            async with httpx.AsyncClient(timeout=10, headers=c.api_headers) as client:

                async def rebuilt() -> dict[str, Any]:
                    health = (await client.get(f"{api}/healthz")).json()
                    assert health.get("leader") is True, health
                    assert health.get("store", "").startswith("NATS store lost: "), health
                    lost = (await client.get(f"{api}/api/store")).json()["lost"]
                    assert lost is not None, lost
                    assert lost["rebuilt"] is not None, lost
                    return dict(lost)

                lost = await eventually(rebuilt, timeout=30, interval=0.3)
                warnings = (await client.get(f"{api}/api/warnings")).json()["warnings"]
                assert warnings[0] == lost["banner"], warnings
                assert f"KV_{prefix}-deployments" in lost["streams"]
                assert "gone at" in lost["banner"]
                assert "llmgw ctl restore -f BACKUP" in lost["banner"]
                # Every bucket is back with its limits and atomic batches.
                for bucket in harness.names.buckets():
                    info = await harness.stream_info(f"KV_{bucket}")
                    assert info.config.allow_atomic, bucket
                    assert info.config.max_bytes == harness.limits[f"KV_{bucket}"].max_bytes, bucket

            # The node reports itself again at once, not at its installer's 600 s recheck.
            async def node_known() -> bool:
                return "node-1" in await harness.keys(harness.names.nodes_bucket)

            await eventually(node_known, timeout=30, interval=0.3)
            # The gateway no longer takes the key that went with the store, nor routes to the
            # replica that did.
            body = await eventually(lambda: refusal(url, secret), timeout=30, interval=0.3)
            assert body["code"] == "invalid_api_key", body
            # Without a backup, ctl says what was lost.
            said = ctl(c, "get", "deployments")
            assert said.returncode == 0, said.stderr
            assert said.stderr.startswith("llmgw: deployments: none stored since "), said.stderr
            assert "(store emptied? `llmgw ctl restore -f BACKUP`" in said.stderr

            # A backup of a format this llmgw does not read is refused, naming it, writing nothing.
            future = tmp_path / "future.json"
            future.write_text('{"version": 7, "written_at": 1}')
            refused = ctl(c, "restore", "-f", str(future))
            assert refused.returncode == 2, (refused.stdout, refused.stderr)
            assert f"{future}: backup format version 7 is not one this llmgw reads" in refused.stderr

            done = ctl(c, "restore", "-f", str(kept))
            assert done.returncode == 0, done.stderr
            assert "deployment chat" in done.stdout, done.stdout
            assert "key team" in done.stdout, done.stdout
            await eventually(served, timeout=60, interval=0.3)

            # A change made after the backup is not undone without --force, and is named.
            assert ctl(c, "scale", "chat", "--replicas", "0").returncode == 0
            refused = ctl(c, "restore", "-f", str(kept))
            assert refused.returncode == 4, (refused.stdout, refused.stderr)
            assert "1 records in the store are newer than the backup" in refused.stderr
            assert "deployment chat (stored " in refused.stderr
            forced = ctl(c, "restore", "-f", str(kept), "--force")
            assert forced.returncode == 0, forced.stderr
            assert forced.stdout.startswith(f"restored 1 records from {kept}: deployment chat"), forced.stdout

            # No process ended on the way.
            for name, proc in c.procs.items():
                assert proc.poll() is None, (name, c.log(name)[-3000:])
            assert gateway.proc.poll() is None, gateway.text()[-3000:]
    finally:
        c.close()
        await harness.close()
