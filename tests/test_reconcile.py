"""`reconcile` without NATS: one control step's plan from a snapshot, as a table of cases.

Each case is a cluster (nodes, when each was last heard, the replicas placement holds,
the shards' statuses) and the entries the step must plan: the same cases the end-to-end
placement tests drive through processes, here in the plan's own terms and words.

Every step of every case is decided twice from the same inputs (`World.step`): the two
plans must be equal and the inputs (what placement holds, the kept index) unchanged, as
`reconcile` is pure. The plan is then taken into memory as if every write landed."""

from __future__ import annotations

import copy

import msgspec
import pytest

from llmgw_core.engines import GPUInfo, Member, Profile, ShardSpec
from llmgw_core.events import (
    Autoscale,
    Deployment,
    DeploymentStatus,
    EngineState,
    NodeFacts,
    NodeIntent,
    NodeStatus,
    PlacementDecision,
    ShardStatus,
)
from llmgw_core.events import ReplicaRecord as Record
from llmgw_placement.apply import BATCH_MAX
from llmgw_placement.config import ServerConfig
from llmgw_placement.held import Held, key
from llmgw_placement.index import KeptIndex
from llmgw_placement.liveness import Liveness
from llmgw_placement.plan import Plan, Refuse
from llmgw_placement.reconcile import Snapshot, reconcile, steps
from llmgw_placement.state import ClusterState

NOW = 1000.0
H100 = "NVIDIA H100 80GB HBM3"
TP1 = msgspec.convert(
    {"name": "tp1", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 1}, Profile
)
TP1_EDITED = msgspec.convert(
    {"name": "tp1", "engine": "sim", "model_path": "sim://y", "gpu_class": "H100-80G", "tp": 1}, Profile
)


class World:
    """A cluster as placement would hold it, without a bus."""

    def __init__(self, nodes: dict[str, int], **config: object) -> None:
        self.config = msgspec.convert(
            {"node_timeout_s": 5.0, "launcher_grace_s": 30.0, **config}, ServerConfig
        )
        self.state = ClusterState.empty()
        for name, gpus in nodes.items():
            self.node(name, gpus)
        self.liveness = Liveness(self.config, self.state)
        self.held = Held()
        self.index = KeptIndex(self.config, self.state, self.liveness)
        self.catalog = {"tp1": TP1}
        self.deployments: dict[str, Deployment] = {}
        self.shard_status: dict[str, ShardStatus] = {}

    def node(self, name: str, gpus: int) -> None:
        facts = NodeFacts(
            node=name,
            gpus=tuple(
                GPUInfo(index=i, name=H100, compute_capability="9.0", memory_mb=81559) for i in range(gpus)
            ),
        )
        engines = (EngineState(name="sim", state="configured", version="1"),)
        self.state.nodes[name] = NodeStatus(node=name, facts=facts, engines=engines)
        self.state.last_seen[name] = NOW
        self.state.dirty_nodes.add(name)

    def deploy(
        self, name: str = "chat", replicas: int = 1, profile: str = "tp1", pool: str = ""
    ) -> Deployment:
        dep = Deployment(name=name, profile=profile, replicas=replicas, pool=pool)
        self.deployments[name] = dep
        return dep

    def holds(
        self,
        replica: str,
        node: str,
        *,
        state: str = "ready",
        profile: Profile = TP1,
        gpus: tuple[int, ...] = (0,),
    ) -> Record:
        """A replica of `chat` placement loaded from the buckets."""
        shard = f"chat-{replica}-0"
        spec = ShardSpec(
            replica=replica,
            shard=shard,
            node=node,
            profile=profile,
            gpus=gpus,
            profile_fp=profile.fingerprint(),
            deployment="chat",
        )
        record = Record(
            deployment="chat",
            replica=replica,
            profile=profile.name,
            profile_fp=profile.fingerprint(),
            state=state,  # type: ignore[arg-type]
            members=(Member(node=node, addr="127.0.0.1"),),
            shards=(f"{node}.{shard}",),
        )
        self.held.shards[f"{node}.{shard}"] = spec
        self.held.replicas[f"chat.{replica}"] = record
        self.index.reset(self.held.shards.values())
        return record

    def intend(self, node: str, *, drain: bool = False) -> NodeIntent:
        """The operator cordons (or drains) `node`, as the node-intent bucket's watcher keeps it."""
        intent = NodeIntent(node=node, drain=drain, by="ops", at=1_800_000_000.0, reason="disk swap")
        self.state.intents[node] = intent
        self.state.dirty_nodes.add(node)
        return intent

    def step(
        self, at: float = NOW, *, quiet: frozenset[str] = frozenset(), counts: dict[str, int] | None = None
    ) -> Plan:
        alive = self.index.refresh(at)
        snap = Snapshot(
            deployments=dict(self.deployments),
            catalog=dict(self.catalog),
            shard_status=dict(self.shard_status),
            nodes=dict(self.state.nodes),
            alive=alive,
            liveness=self.liveness,
            config=self.config,
            intents=dict(self.state.intents),
            counts=counts or {},
            quiet=quiet,
        )
        before = self.memory()
        plan = reconcile(snap, self.held, self.index, at)
        assert self.memory() == before, "reconcile changed what placement holds"
        again = reconcile(snap, self.held, self.index, at)
        assert again == plan, "the same snapshot, replicas and index gave another plan"
        assert self.memory() == before, "reconcile changed what placement holds"
        self.landed(plan)
        return plan

    def memory(self) -> tuple[object, ...]:
        """What placement holds, as values: `Held`, what the kept index counts taken (as the
        views read it), its generation, and which view object is each node's."""
        usage = self.index.usage
        return (
            copy.deepcopy(self.held),
            {n: g for n, g in usage.gpus.items() if g},
            {n: p for n, p in usage.ports.items() if p},
            +usage.shards,
            {n: +c for n, c in usage.replicas_of.items() if +c},
            {n: +c for n, c in usage.weights.items() if +c},
            self.index.index.generation,
            {n: id(v) for n, v in self.index.index.views.items()},
        )

    def landed(self, plan: Plan) -> None:
        """As the applier does once every write of `plan` landed (placements stay unnamed)."""
        proposed = plan.proposed
        assert proposed is not None
        proposed.removed(plan.removals)
        gone = {key(r.record) for r in plan.removals}
        proposed.saved([s for s in plan.saves if key(s.after) not in gone])
        proposed.settle()


def placed_on(plan: Plan) -> list[tuple[str, ...]]:
    return [tuple(a.node for a in p.placement.members) for p in plan.places]


def removed(plan: Plan) -> list[tuple[str, str, str]]:
    return [(r.record.replica, r.state, r.why) for r in plan.removals]


def summaries(plan: Plan) -> list[str]:
    return [r.status.summary for r in plan.reports]


def test_a_new_deployment_is_placed_binpacked_and_reported_placing() -> None:
    w = World({"n0": 2, "n1": 2})
    w.deploy(replicas=3)
    plan = w.step()
    assert placed_on(plan) == [("n0",), ("n0",), ("n1",)]
    assert [p.wanted for p in plan.places] == [3, 2, 1], (
        "the id block asked for is the replicas still to place"
    )
    assert [a.gpus for p in plan.places for a in p.placement.members] == [(0,), (1,), (0,)]
    assert (plan.removals, plan.refusals, plan.dead_letters) == ([], [], [])
    assert summaries(plan) == ["chat: 0 of 3 ready; 3 placing"]


def test_what_does_not_fit_is_refused_in_every_nodes_words_and_reported() -> None:
    w = World({"n0": 1, "n1": 1})
    w.deploy(replicas=3)
    plan = w.step()
    assert placed_on(plan) == [("n0",), ("n1",)]
    [refuse] = plan.refusals
    assert (refuse.deployment, refuse.replica, refuse.wanted, refuse.tell) == ("chat", "", 1, True)
    assert refuse.refusal.reasons == (
        ("n0", "0 of 1 GPUs free, profile needs 1"),
        ("n1", "0 of 1 GPUs free, profile needs 1"),
    )
    assert summaries(plan) == [
        "chat: 0 of 3 ready; 2 placing; 1 cannot be placed: "
        "n0: 0 of 1 GPUs free, profile needs 1; n1: 0 of 1 GPUs free, profile needs 1"
    ]
    status = plan.reports[0].status
    assert (status.desired, status.pending, status.unplaceable) == (3, 2, 1)


def test_a_refusal_unchanged_since_the_last_step_is_not_told_again() -> None:
    w = World({"n0": 1})
    w.deploy(replicas=1)
    w.holds("r0", "n0")
    w.deploy(replicas=2)
    first = w.step()
    assert [r.tell for r in first.refusals] == [True]
    # What the applier keeps of it: the decision `explain` shows.
    w.held.decisions["chat"] = PlacementDecision(
        deployment="chat", replica="r1", outcome="refused", reasons=first.refusals[0].reasons
    )
    w.held.statuses["chat"] = first.reports[0].status
    again = w.step()
    assert again.refusals == [], "nothing moved: the refusal computed last still holds, nothing is decided"
    assert again.reports == [], "the same status is not published again"


def test_an_unknown_profile_is_refused_and_dead_lettered_once() -> None:
    w = World({"n0": 1})
    w.deploy(profile="nope")
    plan = w.step()
    assert plan.places == []
    assert plan.refusals == [
        Refuse("chat", plan.refusals[0].refusal, replica="-", wanted=1, tell=True),
    ]
    assert plan.refusals[0].refusal.reasons == (("-", "profile nope is not in the catalog"),)
    [letter] = plan.dead_letters
    assert letter.subject == "$KV.deployments.chat"
    assert letter.error == "deployment chat: profile nope is not in the catalog (tp1)"
    assert summaries(plan) == [
        "chat: 0 of 1 ready; 1 cannot be placed: -: profile nope is not in the catalog"
    ]
    assert w.step().dead_letters == [], "the same value is dead-lettered once"


def test_scaling_down_removes_the_newest_replicas() -> None:
    w = World({"n0": 2})
    w.holds("r0", "n0", gpus=(0,))
    w.holds("r1", "n0", gpus=(1,))
    w.deploy(replicas=1)
    plan = w.step()
    assert removed(plan) == [("r1", "stopping", "scaled down to 1")]
    assert plan.places == []
    assert set(w.held.replicas) == {"chat.r0"}


def test_a_lost_node_fails_its_replicas_over_whole() -> None:
    w = World({"n0": 1, "n1": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.state.last_seen["n0"] = NOW - 6.0  # past node_timeout_s, no installer heard
    plan = w.step()
    assert removed(plan) == [("r0", "failed", "node n0 lost")]
    assert placed_on(plan) == [("n1",)]


def test_a_silent_launcher_whose_installer_beats_is_in_its_grace_then_fails_over() -> None:
    w = World({"n0": 1, "n1": 1})
    w.holds("r0", "n0")
    w.shard_status["n0.chat-r0-0"] = ShardStatus(
        node="n0",
        shard="chat-r0-0",
        replica="r0",
        state="ready",
        url="http://n0:1",
        profile_fp=TP1.fingerprint(),
    )
    w.deploy(replicas=1)
    w.state.last_seen["n0"] = NOW - 10.0
    w.state.installer_seen["n0"] = NOW
    plan = w.step()
    assert plan.removals == [], "within launcher_grace_s nothing moves"
    assert plan.places == []
    [save] = plan.saves
    assert save.after.state == "unknown"
    assert save.after.url == "http://n0:1", "its last known URL is kept: the gateway may still route to it"
    assert save.after.reason == (
        "launcher on n0 silent: readiness unknown; its installer still beats (an agent restart?): its "
        "engines are routed to for up to launcher_grace_s (30 s) before it fails over"
    )
    w.state.last_seen["n0"] = NOW + 25.0 - 31.0  # the grace spent
    w.state.last_seen["n1"] = NOW + 25.0
    later = w.step(NOW + 25.0)
    assert removed(later) == [("r0", "failed", "node n0 lost")]
    assert placed_on(later) == [("n1",)]


@pytest.mark.parametrize(
    ("status", "state", "reason", "url"),
    [
        (dict(state="ready", url="http://n0:1"), "ready", "", "http://n0:1"),
        (dict(state="ready"), "starting", "", ""),
        (dict(state="failed", reason="boom", retryable=False), "failed", "n0/chat-r0-0: boom", ""),
        (dict(state="failed", reason="oom", retryable=True), "degraded", "n0/chat-r0-0: oom", ""),
        (
            dict(
                state="starting",
                restarts=2,
                last_failure="exit 1; last log lines:\nTraceback",
                last_failure_at=5.0,
            ),
            "starting",
            "attempt 3; last: exit 1",
            "",
        ),
    ],
)
def test_a_replica_is_observed_from_its_shards(
    status: dict[str, object], state: str, reason: str, url: str
) -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0", state="starting")
    w.shard_status["n0.chat-r0-0"] = msgspec.convert(
        {"node": "n0", "shard": "chat-r0-0", "replica": "r0", "profile_fp": TP1.fingerprint(), **status},
        ShardStatus,
    )
    w.deploy(replicas=1)
    plan = w.step()
    if state == "starting" and not reason:
        assert plan.saves == [], "nothing changed: nothing is written"
        return
    [save] = plan.saves
    assert (save.after.state, save.after.reason, save.after.url) == (state, reason, url)
    assert w.held.replicas["chat.r0"] is save.after, "taken in memory once written"
    assert plan.places == []
    assert plan.removals == []


def test_a_replica_failed_for_a_gpu_its_node_no_longer_has_is_placed_again() -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0", state="failed", gpus=(1,))
    w.shard_status["n0.chat-r0-0"] = ShardStatus(
        node="n0", shard="chat-r0-0", replica="r0", state="failed", reason="no GPU 1", retryable=False
    )
    w.deploy(replicas=1)
    plan = w.step()
    assert removed(plan) == [("r0", "failed", "GPU 1 is no longer on n0 (it reports 1 GPU: 0)")]
    assert placed_on(plan) == [("n0",)]


def test_a_profile_change_places_a_new_replica_before_the_old_one_goes() -> None:
    w = World({"n0": 1, "n1": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.catalog["tp1"] = TP1_EDITED
    plan = w.step()
    assert placed_on(plan) == [("n1",)]
    assert plan.removals == []
    assert plan.places[0].fp == TP1_EDITED.fingerprint()


def test_a_profile_change_without_room_replaces_in_place_and_one_that_fits_nowhere_removes_nothing() -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.catalog["tp1"] = TP1_EDITED
    plan = w.step()
    assert removed(plan) == [("r0", "stopping", "replaced in place: no room for a new replica first")]
    assert plan.refusals[0].refusal.reasons == (("n0", "0 of 1 GPUs free, profile needs 1"),)

    w = World({"n0": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.catalog["tp1"] = msgspec.convert(
        {"name": "tp1", "engine": "sim", "model_path": "sim://x", "gpu_class": "A100-80G", "tp": 1}, Profile
    )
    plan = w.step()
    assert plan.removals == [], "a profile that fits nowhere must not take the serving replica down"
    assert plan.refusals[0].refusal.reasons == (("n0", "GPU class H100-80G, profile needs A100-80G"),)
    # Said, not left at `1 of 1 ready` as if nothing were waiting.
    [report] = plan.reports
    blocked = (
        "rolling update blocked: no node fits the new profile: n0: GPU class H100-80G, profile needs A100-80G"
    )
    assert report.status.blocked == blocked
    assert report.status.summary.endswith(f"; {blocked}"), report.status.summary


def test_a_pool_places_only_on_the_nodes_its_patterns_name() -> None:
    w = World({"n0": 1, "gpu-1": 1, "gpu-2": 1}, pools={"big": ["gpu-*"]})
    w.deploy(replicas=3, pool="big")
    plan = w.step()
    assert placed_on(plan) == [("gpu-1",), ("gpu-2",)]
    assert plan.refusals[0].refusal.reasons == (
        ("gpu-1", "0 of 1 GPUs free, profile needs 1"),
        ("gpu-2", "0 of 1 GPUs free, profile needs 1"),
        ("n0", "not in pool big"),
    )


def test_a_deleted_deployment_loses_its_replicas_and_is_reported_deleted() -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0")
    w.held.statuses["chat"] = DeploymentStatus(
        deployment="chat", desired=1, ready=1, summary="chat: 1 of 1 ready"
    )
    plan = w.step()
    # A ready replica drains first: gateways send it nothing new, its requests finish.
    assert plan.removals == []
    assert [(x.after.replica, x.after.state, x.after.reason) for x in plan.saves] == [
        ("r0", "draining", "draining: deployment deleted")
    ]
    assert [(r.status.summary, r.gone) for r in plan.reports] == [("chat: deleted", True)]
    assert w.step(NOW + 1).removals == [], "requests may still be in flight on it"
    plan = w.step(NOW + 2, quiet=frozenset({"chat.r0"}))
    assert removed(plan) == [("r0", "stopping", "deployment deleted; drained")]


def test_a_replica_left_placing_by_a_fault_is_removed_and_placed_again() -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0", state="placing")
    w.deploy(replicas=1)
    plan = w.step()
    assert removed(plan) == [("r0", "stopping", "placement was interrupted; placing it again")]
    assert placed_on(plan) == [("n0",)], "the GPUs its removal freed are placed on again"


def test_a_lost_node_is_refused_in_words_that_say_since_when() -> None:
    w = World({"n0": 1})
    w.state.last_seen["n0"] = NOW - 6.0
    w.state.last_seen_wall["n0"] = 1_700_000_000.0
    w.deploy(replicas=1)
    plan = w.step()
    assert plan.refusals[0].refusal.reasons == (("n0", "lost: no heartbeat since 2023-11-14 22:13:20 UTC"),)
    w.state.last_seen_wall.clear()
    w.state.dirty_nodes.add("n0")
    again = w.step()
    assert again.refusals[0].refusal.reasons == (("n0", "lost: no heartbeat since this placement started"),)


def test_a_status_counts_every_placement_of_the_step_however_many_batches_were_written() -> None:
    """The controller writes what is queued every BATCH_MAX placements (taking it out of the
    plan); the step's status still counts all it placed, and only the rest as unplaceable."""
    w = World({f"n{i:03d}": 8 for i in range(100)})
    w.deploy(replicas=1000)
    alive = w.index.refresh(NOW)
    snap = Snapshot(
        deployments=dict(w.deployments),
        catalog=dict(w.catalog),
        shard_status={},
        nodes=dict(w.state.nodes),
        alive=alive,
        liveness=w.liveness,
        config=w.config,
    )

    def run() -> tuple[list[int], Plan]:
        plan, batches = Plan(), []
        for _ in steps(snap, w.held, w.index, NOW, plan):
            if plan.full(BATCH_MAX):
                batches.append(len(plan.take().places))
        return batches, plan

    before = w.memory()
    batches, plan = run()
    assert w.memory() == before, "reconcile changed what placement holds"
    assert run() == (batches, plan), "the same snapshot, replicas and index gave another plan"
    assert w.memory() == before, "reconcile changed what placement holds"
    assert batches == [BATCH_MAX], "the first 512 were handed over to be written mid-step"
    assert len(plan.places) == 800 - BATCH_MAX
    [report] = plan.reports
    assert report.status.summary.startswith("chat: 0 of 1000 ready; 800 placing; 200 cannot be placed: ")
    assert (report.status.pending, report.status.unplaceable) == (800, 200)


def shard(w: World, replica: str, node: str, state: str) -> None:
    """The shard of `chat`'s `replica` reports `state` (ready with a URL)."""
    url = "http://127.0.0.1:1" if state == "ready" else ""
    w.shard_status[f"{node}.chat-{replica}-0"] = ShardStatus(
        node=node,
        shard=f"chat-{replica}-0",
        replica=replica,
        deployment="chat",
        state=state,
        url=url,
        profile_fp=TP1.fingerprint(),
    )  # type: ignore[arg-type]


def test_a_cordoned_node_takes_no_new_replica_in_words_that_say_who_when_and_why() -> None:
    w = World({"n0": 1, "n1": 1})
    w.holds("r0", "n0")
    shard(w, "r0", "n0", "ready")
    w.intend("n0")
    w.intend("n1")
    w.deploy(replicas=2)
    plan = w.step()
    assert plan.places == []
    assert plan.removals == [], "a cordon keeps the replicas it has"
    words = "cordoned by ops at 2027-01-15 08:00:00 UTC: disk swap"
    assert plan.refusals[0].refusal.reasons == (("n0", words), ("n1", words))
    assert summaries(plan) == [f"chat: 1 of 2 ready; 1 cannot be placed: n0: {words}; n1: {words}"]
    del w.state.intents["n1"]  # uncordoned
    w.state.dirty_nodes.add("n1")
    assert placed_on(w.step()) == [("n1",)]


def test_a_drained_nodes_replica_is_replaced_elsewhere_before_it_goes() -> None:
    w = World({"n0": 1, "n1": 1}, autoscaler={"drain_timeout_s": 2.0})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.intend("n0", drain=True)
    plan = w.step()
    assert placed_on(plan) == [("n1",)]
    assert plan.removals == [], "the old replica serves until its replacement is ready"
    # The replacement placed and starting: the old one still stays.
    w.held = Held()
    w.holds("r0", "n0")
    w.holds("r1", "n1", state="starting")
    shard(w, "r0", "n0", "ready")
    shard(w, "r1", "n1", "starting")
    plan = w.step()
    assert plan.removals == []
    assert plan.places == []
    shard(w, "r1", "n1", "ready")
    plan = w.step()
    assert [(x.after.replica, x.after.state) for x in plan.saves] == [("r1", "ready")]
    assert plan.removals == [], (
        "the old replica goes only once the new one's ready is written: the removal would land first"
    )
    plan = w.step()
    assert plan.removals == []
    why = "node n0 draining: replaced by a replica placed elsewhere"
    assert [(x.after.replica, x.after.state, x.after.reason) for x in plan.saves] == [
        ("r0", "draining", f"draining: {why}")
    ]
    # Requests still in flight on it past the drain timeout: it goes anyway.
    plan = w.step(NOW + 3)
    assert removed(plan) == [("r0", "stopping", f"{why}; drain timed out after 2 s with requests in flight")]


def test_a_drain_with_no_room_elsewhere_stops_nothing_and_says_why() -> None:
    w = World({"n0": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    w.intend("n0", drain=True)
    plan = w.step()
    assert plan.removals == [], "a drain must not take the only serving replica down"
    assert plan.refusals[0].refusal.reasons == (
        ("n0", "draining by ops at 2027-01-15 08:00:00 UTC: disk swap"),
    )
    [report] = plan.reports
    assert report.status.blocked == (
        "drain of n0 blocked: no other node fits: n0: draining by ops at 2027-01-15 08:00:00 UTC: disk swap"
    )


def test_an_autoscaled_deployment_keeps_the_chosen_count_and_drains_what_it_scales_down() -> None:
    w = World({"n0": 3})
    w.deployments["chat"] = Deployment(
        name="chat", profile="tp1", replicas=1, autoscale=Autoscale(min_replicas=0, max_replicas=3)
    )
    for i in range(3):
        w.holds(f"r{i}", "n0", gpus=(i,))
    for i in range(3):
        shard(w, f"r{i}", "n0", "ready")
    w.step(counts={"chat": 3})
    # The autoscaler asks for 1: `replicas` (1) was never the count; the two newest drain.
    plan = w.step(counts={"chat": 1})
    assert plan.removals == []
    assert sorted((x.after.replica, x.after.state, x.after.reason) for x in plan.saves) == [
        ("r1", "draining", "draining: scaled down to 1"),
        ("r2", "draining", "draining: scaled down to 1"),
    ]
    assert summaries(plan) == ["chat: 1 of 1 ready; 2 draining; following demand, 0 to 3 replicas"]
    plan = w.step(NOW + 1, counts={"chat": 1}, quiet=frozenset({"chat.r2"}))
    assert removed(plan) == [("r2", "stopping", "scaled down to 1; drained")]
    # Demand back while r1 drains: it serves on, and nothing new is placed.
    plan = w.step(NOW + 2, counts={"chat": 2})
    assert plan.places == []
    assert plan.removals == []
    assert [(x.after.replica, x.after.state, x.after.reason) for x in plan.saves] == [("r1", "ready", "")]
    assert "chat.r1" not in w.held.draining


def test_a_replica_that_never_served_goes_at_once_without_draining() -> None:
    w = World({"n0": 2})
    w.holds("r0", "n0", gpus=(0,))
    w.holds("r1", "n0", gpus=(1,), state="starting")
    shard(w, "r0", "n0", "ready")
    shard(w, "r1", "n0", "starting")
    w.deploy(replicas=1)
    plan = w.step()
    assert removed(plan) == [("r1", "stopping", "scaled down to 1")]
    assert "draining" not in [x.after.state for x in plan.saves]


def test_a_profile_change_drains_the_old_replica_once_the_new_is_ready_and_waits_for_it() -> None:
    w = World({"n0": 1, "n1": 1, "n2": 1})
    w.holds("r0", "n0")
    w.deploy(replicas=1)
    shard(w, "r0", "n0", "ready")
    w.step()
    w.catalog["tp1"] = TP1_EDITED
    w.held.replicas["chat.r1"] = Record(
        deployment="chat",
        replica="r1",
        profile="tp1",
        profile_fp=TP1_EDITED.fingerprint(),
        state="ready",
        members=(Member(node="n1", addr="127.0.0.1"),),
        shards=("n1.chat-r1-0",),
    )
    w.held.shards["n1.chat-r1-0"] = ShardSpec(
        replica="r1", shard="chat-r1-0", node="n1", profile=TP1_EDITED, profile_fp=TP1_EDITED.fingerprint()
    )
    w.index.reset(w.held.shards.values())
    w.shard_status["n1.chat-r1-0"] = msgspec.structs.replace(
        w.shard_status["n0.chat-r0-0"],
        node="n1",
        shard="chat-r1-0",
        replica="r1",
        profile_fp=TP1_EDITED.fingerprint(),
    )
    plan = w.step()
    assert plan.removals == []
    assert [(x.after.replica, x.after.reason) for x in plan.saves if x.after.state == "draining"] == [
        ("r0", "draining: replaced by a replica of the new profile")
    ]
    assert summaries(plan) == ["chat: 1 of 1 ready; 1 draining"]
    # While r0 drains it still serves: nothing else moves, and the status counts it.
    plan = w.step(NOW + 1)
    assert plan.removals == []
    assert plan.places == []
    plan = w.step(NOW + 2, quiet=frozenset({"chat.r0"}))
    assert removed(plan) == [("r0", "stopping", "replaced by a replica of the new profile; drained")]
