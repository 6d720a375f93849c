"""The run checker (tests/multihost/checker.py) over hand-made histories: each invariant is
caught when broken, with the records that show it, and passes when it holds; no bytes make
it raise anything but its own error."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.events import (
    Deployment,
    Member,
    PlacementDecision,
    Profile,
    ReplicaRecord,
    ReplicaStatus,
    ShardSpec,
)
from tests.cluster_support import cluster, sim_catalog
from tests.multihost.checker import (
    Ack,
    CheckerError,
    Convergence,
    Violation,
    acks_lost,
    assert_holds,
    check,
    engines_left,
    gpus_held_twice,
    not_converged,
    placed_twice,
    report,
    terms_shared,
)
from tests.multihost.history import Engine, Event, History, Recorder, Revision, read
from tests.waiting import eventually

PROFILE = msgspec.convert(sim_catalog(), Profile)
A, B = "a" * 32, "b" * 32


def spec(node: str, replica: str, gpus: tuple[int, ...] = (0,), dep: str = "chat") -> bytes:
    return msgspec.json.encode(
        ShardSpec(
            replica=replica, shard=f"{dep}-{replica}-0", node=node, profile=PROFILE, gpus=gpus, deployment=dep
        )
    )


def record(replica: str, node: str, state: str = "ready", dep: str = "chat") -> bytes:
    return msgspec.json.encode(
        ReplicaRecord(
            deployment=dep,
            replica=replica,
            profile="tiny",
            profile_fp="fp",
            state=state,  # type: ignore[arg-type]
            members=(Member(node=node, addr="10.0.0.1"),),
            shards=(f"{node}.{dep}-{replica}-0",),
        )
    )


def placed(replica: str, *nodes: str, writer: str = A, seq: int = 1, t: float = 10.0) -> Event:
    data = msgspec.json.encode(
        PlacementDecision(deployment="chat", replica=replica, outcome="placed", nodes=nodes)
    )
    return Event("placement.chat", seq, t, writer, data)


class Builder:
    """A history written in order: each revision gets the next sequence of its bucket."""

    def __init__(self) -> None:
        self.history = History(recorded=True)
        self.seq: dict[str, int] = {}
        self.t = 100.0

    def put(self, bucket: str, key: str, value: bytes | None, t: float | None = None) -> Revision:
        self.seq[bucket] = self.seq.get(bucket, 0) + 1
        self.t = self.t + 1 if t is None else t
        r = Revision(bucket, key, self.seq[bucket], self.t, value)
        self.history.revisions.append(r)
        return r

    def event(self, subject: str, writer: str, data: bytes = b"") -> Event:
        self.t += 1
        if not data and subject.startswith("replica."):
            _, dep, replica = subject.split(".")
            data = msgspec.json.encode(ReplicaStatus(deployment=dep, replica=replica, state="ready"))
        e = Event(subject, len(self.history.events) + 1, self.t, writer, data)
        self.history.events.append(e)
        return e


def failover() -> Builder:
    """chat/r1 on n1, n1 lost, chat/r2 on n2: every invariant holds."""
    b = Builder()
    b.put("leases", "placement", b"p1")
    b.put("shards", "n1.chat-r1-0", spec("n1", "r1"))
    b.put("replicas", "chat.r1", record("r1", "n1", "starting"))
    b.event("replica.chat.r1", A)
    b.put("replicas", "chat.r1", record("r1", "n1"))
    b.put("leases", "placement", b"p1")
    b.put("shards", "n1.chat-r1-0", None)
    b.put("replicas", "chat.r1", None)
    b.put("shards", "n2.chat-r2-0", spec("n2", "r2"))
    b.put("replicas", "chat.r2", record("r2", "n2"))
    b.event("replica.chat.r2", A)
    return b


def invariants(found: list[Violation]) -> list[str]:
    return [v.invariant for v in found]


def test_a_failover_that_loses_and_doubles_nothing_passes() -> None:
    b = failover()
    b.history.engines.append(Engine("n2", "n2.chat-r2-0", (10,), (10,), (0,)))
    b.history.engines.append(Engine("n1", "n1.chat-r1-0", (9,), (), (0,)))
    acks = [Ack("replicas", "chat.r2", 3, record("r2", "n2"))]
    assert check(b.history, acks=acks, converge=Convergence({"chat": 1}, 100.0, 30.0)) == []
    assert_holds(b.history, acks=acks)


def test_one_shard_live_on_two_nodes_is_a_replica_placed_twice() -> None:
    b = Builder()
    first = b.put("shards", "n1.chat-r1-0", spec("n1", "r1"))
    second = b.put("shards", "n2.chat-r1-0", spec("n2", "r1"))
    [v] = placed_twice(b.history)
    assert v.invariant == "placed twice"
    assert v.what == "shard chat/chat-r1-0 is live on 2 nodes at once (shards revision 2)"
    assert [r.split(" @")[0] for r in v.records] == [
        f"shards rev {first.revision} n1.chat-r1-0",
        f"shards rev {second.revision} n2.chat-r1-0",
    ]


def test_a_replica_record_that_moves_or_comes_back_is_an_id_used_twice() -> None:
    b = Builder()
    b.put("replicas", "chat.r1", record("r1", "n1"))
    b.put("replicas", "chat.r1", record("r1", "n2"))
    b.put("replicas", "chat.r1", None)
    b.put("replicas", "chat.r1", record("r1", "n2", "ready"))
    found = placed_twice(b.history)
    assert [v.what for v in found] == [
        "replica chat.r1 moved from ('n1',) to ('n2',) under one id",
        "replica chat.r1 was written again after it was removed: a replica id used twice",
    ]


def test_two_placed_decisions_of_one_id_on_different_nodes_are_caught_and_a_rewrite_is_not() -> None:
    history = History(
        events=[placed("r1", "n1"), placed("r1", "n1", seq=2), placed("r1", "n2", writer=B, seq=3)]
    )
    [v] = placed_twice(history)
    assert v.what == "replica chat/r1 was placed on ('n1',) and on ('n2',)"
    assert len(v.records) == 2
    assert "writer bbbbbbbb" in v.records[1]


def test_a_gpu_in_two_replicas_specs_at_once_is_caught() -> None:
    b = Builder()
    b.put("shards", "n1.chat-r1-0", spec("n1", "r1", (0, 1)))
    b.put("shards", "n1.chat-r2-0", spec("n1", "r2", (1, 2)))
    [v] = gpus_held_twice(b.history)
    assert v.what == "GPU 1 of n1 is held by chat/r1, chat/r2 at shards revision 2"
    # Freed first, then taken: held once at every revision.
    b = Builder()
    b.put("shards", "n1.chat-r1-0", spec("n1", "r1", (0, 1)))
    b.put("shards", "n1.chat-r1-0", None)
    b.put("shards", "n1.chat-r2-0", spec("n1", "r2", (1, 2)))
    assert gpus_held_twice(b.history) == []


def test_an_acknowledged_write_is_found_superseded_or_lost() -> None:
    b = Builder()
    b.put("replicas", "chat.r1", record("r1", "n1", "starting"))
    b.put("replicas", "chat.r1", record("r1", "n1"))
    b.put("replicas", "chat.r2", record("r2", "n1"))
    held = Ack("replicas", "chat.r2", 3, record("r2", "n1"))
    superseded = Ack("replicas", "chat.r1", 1, b"anything")
    lost = Ack("replicas", "chat.r3", 7, record("r3", "n1"))
    other = Ack("replicas", "chat.r1", 2, record("r1", "n2"))  # revision 2 holds another value
    found = acks_lost(b.history, [held, superseded, lost, other])
    assert [v.what for v in found] == [
        "replicas/chat.r3 revision 7 was acknowledged but the bucket holds no such revision and no later "
        "revision of the key",
        "replicas/chat.r1 revision 2 was acknowledged but the bucket holds another message at that "
        "revision and no later revision of the key",
    ]


def test_two_writers_in_one_term_and_one_writer_in_two_terms_are_caught() -> None:
    b = Builder()
    b.put("leases", "placement", b"p1")
    b.event("replica.chat.r1", A)
    b.event("replica.chat.r2", B)  # a second placement writes in p1's term
    [v] = terms_shared(b.history)
    assert v.what == "2 writers wrote placement's events in the term of 'p1' (lease revision 1)"
    assert len(v.records) == 3

    b = Builder()
    b.put("leases", "placement", b"p1")
    b.event("replica.chat.r1", A)
    b.put("leases", "placement", b"p2")  # p2 took over
    b.event("replica.chat.r2", B)
    b.event("replica.chat.r1", A)  # p1's late write lands in p2's term
    found = terms_shared(b.history)
    assert [v.what for v in found] == [
        "2 writers wrote placement's events in the term of 'p2' (lease revision 2)",
        "writer aaaaaaaa wrote in the terms of 2 holders: p1, p2",
    ]


def test_a_takeover_with_each_writer_in_its_own_term_passes() -> None:
    b = Builder()
    b.put("leases", "placement", b"p1")
    b.event("replica.chat.r1", A)
    b.put("leases", "placement", None)  # p1 released it: its term lasts until p2 takes it
    b.event("deployment.chat", B)  # not a fenced write
    b.put("leases", "placement", b"p2")
    b.event("replica.chat.r2", B)
    b.put("leases", "placement", b"p2")
    assert terms_shared(b.history) == []


def test_an_engine_running_for_a_spec_that_is_gone_is_left_running() -> None:
    b = failover()
    b.history.engines.append(Engine("n1", "n1.chat-r1-0", (9, 11), (11,), (0,)))
    [v] = engines_left(b.history)
    assert v.what == "n1 still runs n1.chat-r1-0 (pids 11) whose shard spec is gone"


def test_convergence_late_or_never_is_caught() -> None:
    b = failover()  # chat.r2 ready at t=110
    assert not_converged(b.history, Convergence({"chat": 1}, 104.0, 10.0)) == []
    [late] = not_converged(b.history, Convergence({"chat": 1}, 104.0, 3.0))
    assert late.what == "ready replicas reached those wanted (chat: 1) 6.0 s after the heal, over 3 s"
    [never] = not_converged(b.history, Convergence({"chat": 2}, 104.0, 60.0))
    assert never.what == "ready replicas at the end of the history (chat: 1) are not those wanted (chat: 2)"
    # Ready already at the heal, and still at the end.
    assert not_converged(b.history, Convergence({"chat": 1}, 200.0, 1.0)) == []
    with pytest.raises(CheckerError):
        not_converged(b.history, Convergence({}, 0.0, 1.0))


def test_a_record_that_does_not_decode_is_said_once_with_its_revision() -> None:
    b = Builder()
    b.put("shards", "n1.chat-r1-0", b"{not json")
    found = check(b.history)
    assert invariants(found) == ["unreadable"]
    assert found[0].records[0].startswith("shards rev 1 n1.chat-r1-0 @")


ROLES = st.sampled_from(["shards", "replicas", "leases", "shard-status", "nodes"])
VALUES = st.one_of(
    st.none(),
    st.binary(max_size=64),
    st.sampled_from([spec("n1", "r1"), spec("n2", "r1", (0, 1)), record("r1", "n1"), b"p1", b"p2"]),
)


@settings(max_examples=150, deadline=None)
@given(
    revisions=st.lists(
        st.tuples(
            ROLES, st.sampled_from(["placement", "n1.chat-r1-0", "chat.r1", "x"]), VALUES, st.floats(0, 1e6)
        ),
        max_size=25,
    ),
    events=st.lists(
        st.tuples(
            st.sampled_from(["placement.chat", "replica.chat.r1", "shard.n1.x", "other"]),
            st.sampled_from(["", A, B]),
            st.binary(max_size=64) | st.just(placed("r1", "n1").data),
            st.floats(0, 1e6),
        ),
        max_size=15,
    ),
    acks=st.lists(st.tuples(ROLES, st.text(max_size=8), st.integers(-5, 40)), max_size=5),
)
def test_no_history_makes_the_checker_raise(
    revisions: list[tuple[str, str, bytes | None, float]],
    events: list[tuple[str, str, bytes, float]],
    acks: list[tuple[str, str, int]],
) -> None:
    history = History(
        revisions=[Revision(b, k, i + 1, t, v) for i, (b, k, v, t) in enumerate(revisions)],
        events=[Event(s, i + 1, t, w, d) for i, (s, w, d, t) in enumerate(events)],
        engines=[Engine("n1", "n1.gone", (1,), (1,))],
    )
    found = check(
        history, acks=[Ack(b, k, r) for b, k, r in acks], converge=Convergence({"chat": 1}, 5e5, 10.0)
    )
    assert all(isinstance(v, Violation) and v.invariant for v in found)
    assert "engine left running" in invariants(found)
    assert len(found) <= 3 * (len(revisions) + len(events) + len(acks)) + 2


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_the_checker_reads_a_real_clusters_history_and_catches_a_shard_doubled_in_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """A replica fails over from a killed node: the recorder, the buckets and the launchers'
    records hold it all, and every invariant holds; a shard spec written on the dead node
    under the new replica's shard name is caught as placed twice, from the real history."""
    names = bus.names
    recorder = Recorder(bus, interval=0.3)
    async with anyio.create_task_group() as tg:
        await tg.start(recorder.run)
        with cluster(tmp_path, nats_url, prefix) as c:
            for node in ("node-1", "node-2"):
                c.start_node(node, gpus=1)
            c.start_placement("p1", [sim_catalog()], [])
            deployment = msgspec.convert({"name": "chat", "profile": "tiny", "replicas": 1}, Deployment)
            acked = Ack("deployments", "chat", await bus.put(names.deployments_bucket, "chat", deployment))
            [first] = await eventually(lambda: _ready_nodes(bus), timeout=60)
            c.kill_node(first)
            killed_at = time.time()
            [second] = await eventually(lambda: _ready_nodes(bus, not_on=first), timeout=60)
            history = await read(bus, [c.root / "node-1", c.root / "node-2"], recorder)
            tg.cancel_scope.cancel()

    assert history.recorded
    assert recorder.passes >= 2
    shards = history.of("shards")
    assert {r.key.split(".")[0] for r in shards if r.value is not None} == {first, second}
    assert [r.key for r in history.of("leases") if r.key == "placement"], "the lease's revisions were read"
    # Every change of state placement wrote came from its one process's batches.
    writers = {
        e.writer
        for e in history.events
        if e.subject.startswith("replica.chat.")
        and msgspec.json.decode(e.data, type=ReplicaStatus).state != "unplaceable"
    }
    [writer] = writers
    assert len(writer) == 32
    [engine] = [e for e in history.engines if e.running]
    assert engine.node == second
    assert_holds(history, acks=[acked], converge=Convergence({"chat": 1}, killed_at, 60.0))

    # The same history with the replica's shard also on the dead node: caught, with both records.
    live = next(r for r in reversed(shards) if r.value is not None and r.key.startswith(f"{second}."))
    shard = live.key.split(".", 1)[1]
    forged = Revision("shards", f"{first}.{shard}", live.revision + 1, live.time + 1, live.value)
    history.revisions.append(forged)
    [v] = check(history)
    assert v.invariant == "placed twice", report([v])
    assert v.what == f"shard chat/{shard} is live on 2 nodes at once (shards revision {forged.revision})"


async def _ready_nodes(bus: Bus, not_on: str = "") -> list[str]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    nodes = [m.node for c in found.values() if c.value and c.value.state == "ready" for m in c.value.members]
    assert len(nodes) == 1, nodes
    assert nodes[0] != not_on, nodes
    return nodes
