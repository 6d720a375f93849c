"""A launcher whose spec watch goes quiet while alive still stops an engine whose spec was
deleted: it reads its specs afresh every `spec_resync_s` and takes what the watch missed.

The quiet watch is made for real: the watch's consumer is paused on the server
(`$JS.API.CONSUMER.PAUSE`), which delivers nothing and goes on sending idle heartbeats, so the
client library never opens it again. A node whose only NATS server was cut from the others and
healed was seen to do the same: its engine served on after its replica had moved.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmgw_core.bus import Bus, KVChange
from llmgw_core.subjects import Names
from llmgw_launcher.desired import Desired
from tests.launcher_support import agent_config, pid_alive, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually


async def pause_watches(bus: Bus, bucket: str, keys: str) -> list[str]:
    """Pause every consumer of `bucket` filtered on `keys` for an hour; their names."""
    stream = f"KV_{bucket}"
    subject = Names.kv_subject(bucket, keys)
    paused = []
    for info in await bus.nc.jetstream().consumers_info(stream):
        if info.config.filter_subject != subject:
            continue
        until = (datetime.now(UTC) + timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        pause = json.dumps({"pause_until": until}).encode()
        reply = await bus.nc.request(f"$JS.API.CONSUMER.PAUSE.{stream}.{info.name}", pause, timeout=5)
        answer = json.loads(reply.data)
        assert answer.get("paused") is True, answer
        paused.append(info.name)
    return paused


@pytest.mark.anyio
async def test_a_spec_deleted_behind_a_paused_watch_is_read_afresh_and_its_engine_stopped(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent", spec_resync_s=1.0)
    spec = shard("node-a", "s1", sim_profile("--load-time", "0.2"))
    caplog.set_level(logging.WARNING, logger="llmgw.launcher")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.s1", spec)
        await eventually(lambda: events.states("s1")[-1:] == ["ready"], timeout=20)
        ready = events.last("s1")
        assert ready is not None
        [pid] = ready.pids
        assert await pause_watches(bus, bus.names.shards_bucket, "node-a.*")

        await bus.delete(bus.names.shards_bucket, "node-a.s1")
        await eventually(lambda: events.states("s1")[-1:] == ["stopped"], timeout=15)
        assert not pid_alive(pid)
        said = [r.getMessage() for r in caplog.records if "missed" in r.getMessage()]
        assert said, "the stop came from the fresh read, not the paused watch"
        assert "node-a.s1 deleted at revision" in said[0], said


def spec_change(key: str, revision: int, *, deleted: bool = False, error: str = "") -> KVChange:  # type: ignore[type-arg]
    value = None if deleted or error else shard("n", key.split(".")[1], sim_profile())
    return KVChange(key, value, revision, error=error)


@pytest.mark.fast
def test_a_fresh_read_gives_what_the_watch_has_not_heard_and_nothing_else() -> None:
    desired = Desired()
    for key, revision in (("n.a", 5), ("n.b", 6), ("n.c", 7), ("n.d", 8)):
        desired.heard(key, revision)
        desired.specs[key] = shard("n", key[2:], sim_profile())
    fresh = {
        "n.a": spec_change("n.a", 5),  # heard already
        "n.b": spec_change("n.b", 9),  # a newer value
        "n.c": spec_change("n.c", 10, deleted=True),  # deleted since
        "n.e": spec_change("n.e", 11),  # new
        "n.f": spec_change("n.f", 12, deleted=True),  # the delete of a spec never held
        "n.g": spec_change("n.g", 13, error="does not decode"),  # a bad write is no delete
    }
    # n.d is missing from the read, which saw up to revision 13: its marker was removed.
    missed = desired.missed(fresh, through=13)
    assert [(c.key, c.value is None, c.revision) for c in missed] == [
        ("n.b", False, 9),
        ("n.c", True, 10),
        ("n.e", False, 11),
        ("n.d", True, 13),
    ]
    # A read from a server behind this node's watch (it saw only up to revision 7) deletes
    # nothing the watch heard after it.
    behind = {key: spec_change(key, revision) for key, revision in (("n.a", 5), ("n.b", 6), ("n.c", 7))}
    assert desired.missed(behind, through=7) == []
    # Gone with its store (revision 0): forgotten, so the new store's revisions count again.
    desired.heard("n.a", 0)
    assert [c.key for c in desired.missed({"n.a": spec_change("n.a", 1)}, through=1)] == ["n.a"]
