"""One record no decision can use costs that record, never placement's step.

Table cases over `reconcile` (no NATS), one per kind of record a step reads: a node's status,
a model's shape, a catalog profile, a deployment, a held replica. Each was a value that raised
out of the step (an OverflowError, a ValueError), so that no deployment in the cluster was
placed or scaled until it was deleted. Now the one it names is refused in words, and every
other deployment is placed in the same step."""

from __future__ import annotations

import msgspec

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState, ModelShape, NodeFacts, NodeStatus, ShardStatus
from llmgw_placement.plan import Plan
from tests.test_reconcile import H100, NOW, TP1, World, placed_on, removed, summaries

OTHER = msgspec.convert(
    {"name": "other", "engine": "sim", "model_path": "sim://other", "gpu_class": "H100-80G", "tp": 1}, Profile
)
SHAPE = ModelShape(
    format="gguf",
    weight_bytes=1 << 30,
    n_layer=2,
    n_head_kv=2,
    head_dim_k=16,
    head_dim_v=16,
    context_length=512,
)
BOMB = msgspec.structs.replace(SHAPE, weight_bytes=10**400)


def reasons(plan: Plan, deployment: str) -> list[tuple[str, str]]:
    return [r for f in plan.refusals if f.deployment == deployment for r in f.refusal.reasons]


def reported(world: World, node: str, shapes: dict[str, ModelShape] | None = None, **gpu: object) -> None:
    """Node `node` reports one GPU (`gpu` overrides its fields) and the model `shapes`."""
    fields: dict[str, object] = {"index": 0, "name": H100, "compute_capability": "9.0", "memory_mb": 81559}
    fields.update(gpu)
    facts = NodeFacts(node=node, gpus=(GPUInfo(**fields),), shapes=shapes or {})  # type: ignore[arg-type]
    engines = (EngineState(name="sim", state="configured", version="1"),)
    world.state.nodes[node] = NodeStatus(node=node, facts=facts, engines=engines)
    world.state.last_seen[node] = NOW
    world.state.dirty_nodes.add(node)


def test_a_node_status_no_view_can_be_made_of_refuses_that_node_only() -> None:
    # A GPU reporting 10**400 MB, with no memory in its name: its class cannot be told
    # (the division overflows), and the index raised out of the step.
    w = World({"n0": 1, "n1": 1})
    reported(w, "bad", name="NVIDIA H100", memory_mb=10**400)
    w.deploy(replicas=3)
    plan = w.step()
    assert placed_on(plan) == [("n0",), ("n1",)]
    assert reasons(plan, "chat") == [
        ("bad", "node status cannot be used: OverflowError: integer division result too large for a float"),
        ("n0", "0 of 1 GPUs free, profile needs 1"),
        ("n1", "0 of 1 GPUs free, profile needs 1"),
    ]


def test_a_models_shape_no_estimate_can_use_refuses_its_deployment_in_words_only() -> None:
    # A shape of 10**400 bytes (built in memory: on the bus it would not decode) overflowed
    # the estimate's floats.
    w = World({"n0": 2, "n1": 2})
    reported(w, "n0", shapes={TP1.weights_key: BOMB, OTHER.weights_key: SHAPE})
    w.state.nodes["n0"] = msgspec.structs.replace(
        w.state.nodes["n0"],
        facts=msgspec.structs.replace(
            w.state.nodes["n0"].facts,
            gpus=tuple(
                GPUInfo(index=i, name=H100, compute_capability="9.0", memory_mb=81559) for i in range(2)
            ),
        ),
    )
    w.catalog["other"] = OTHER
    w.deploy("chat", replicas=1)
    w.deploy("other", replicas=2, profile="other")
    plan = w.step()
    assert placed_on(plan) == [("n0",), ("n0",)], "the other deployment is placed in the same step"
    words = (
        "model sim://x: the model's shape cannot be used: weight_bytes 10**400 is outside 0 to "
        "1,125,899,906,842,624"
    )
    assert reasons(plan, "chat") == [("n0", words), ("n1", words)]
    assert summaries(plan)[0] == f"chat: 0 of 1 ready; 1 cannot be placed: n0: {words}; n1: {words}"


def test_a_profile_whose_context_overflows_the_estimate_refuses_its_deployment_only() -> None:
    w = World({"n0": 1, "n1": 1})
    reported(w, "n0", shapes={"sim://big": SHAPE})
    w.catalog["big"] = msgspec.convert(
        {
            "name": "big",
            "engine": "sim",
            "model_path": "sim://big",
            "gpu_class": "H100-80G",
            "tp": 1,
            "args": ["--kv-tokens", "1e308"],
        },
        Profile,
    )
    w.deploy("big", replicas=1, profile="big")
    w.deploy("chat", replicas=2)
    plan = w.step()
    assert placed_on(plan) == [("n0",), ("n1",)]
    words = "model sim://big: profile big: a context of over 10**308 tokens is past 4,294,967,296"
    assert reasons(plan, "big") == [("n0", words), ("n1", words)]


def test_a_deployment_the_port_range_cannot_hold_is_refused_and_the_rest_placed() -> None:
    # Two ranks must meet on one port free on both nodes: with none left, `decide` raised
    # ValueError out of the step.
    w = World({}, fabrics={"ib": {"nodes": ["f*"]}}, dist_port_range=[30000, 30000])
    for name in ("f0", "f1", "n0"):
        w.node(name, 2)
        status = w.state.nodes[name]
        engines = (*status.engines, EngineState(name="vllm", state="configured", version="0.9.0"))
        w.state.nodes[name] = msgspec.structs.replace(status, engines=engines)
    w.catalog["duo"] = msgspec.convert(
        {
            "name": "duo",
            "engine": "vllm",
            "model_path": "/m/duo",
            "gpu_class": "H100-80G",
            "tp": 2,
            "nodes": 2,
            "gpus_per_node": 1,
        },
        Profile,
    )
    w.deploy("duo", replicas=2, profile="duo")
    w.deploy("zeta", replicas=1)
    plan = w.step()
    assert placed_on(plan) == [("f0", "f1"), ("f0",)], "one replica of duo, then zeta"
    words = "no port of dist_port_range 30000-30000 free on every node of fabric ib"
    assert reasons(plan, "duo") == [("f0", words), ("f1", words)]


def test_a_held_replica_whose_fit_cannot_be_told_is_placed_again_in_words() -> None:
    # A replica that failed for good, whose shard spec's profile asks a context of 1e308
    # tokens, on a node that reports the model's shape: checking whether the node is now unfit
    # for it overflowed.
    w = World({"n0": 1, "n1": 1})
    reported(w, "n0", shapes={"sim://x": SHAPE})
    old = msgspec.structs.replace(TP1, args=("--kv-tokens", "1e308"))
    w.holds("r0", "n0", state="failed", profile=old)
    w.shard_status["n0.chat-r0-0"] = ShardStatus(
        node="n0", shard="chat-r0-0", replica="r0", state="failed", reason="out of memory", retryable=False
    )
    w.deploy(replicas=1)
    plan = w.step()
    words = "n0: model sim://x: profile tp1: a context of over 10**308 tokens is past 4,294,967,296"
    assert removed(plan) == [("r0", "failed", words)]
    assert placed_on(plan) == [("n0",)]


def test_a_deployment_that_faults_the_step_anywhere_is_refused_and_the_others_go_on() -> None:
    # Whatever a deployment holds that the step cannot handle (here a count no text can
    # print), it costs that deployment, told in words, and never the other deployments.
    w = World({"n0": 1, "n1": 1})
    w.deployments["a-huge"] = Deployment(name="a-huge", profile="gone", replicas=10**5000)
    w.deploy("chat", replicas=2)
    plan = w.step()
    said = [r for f in plan.refusals if f.deployment == "a-huge" for r in f.refusal.reasons]
    [(node, words)] = [r for r in said if r[1].startswith("placement cannot")]
    assert node == "-"
    assert words.startswith(
        "placement cannot place or scale deployment a-huge: ValueError: Exceeds the limit (4300 digits)"
    )
    assert len(words) < 400
    assert placed_on(plan) == [("n0",), ("n1",)]
    assert [r.status.summary for r in plan.reports] == ["chat: 0 of 2 ready; 2 placing"]


def test_a_shard_status_no_summary_can_be_made_of_costs_its_deployment_only() -> None:
    # A shard's restarts that no text can print: observing its replica raised out of the step.
    w = World({"n0": 1, "n1": 1})
    w.holds("r0", "n0", state="starting")
    w.shard_status["n0.chat-r0-0"] = ShardStatus(
        node="n0",
        shard="chat-r0-0",
        replica="r0",
        state="starting",
        restarts=10**5000,
        last_failure="out of memory",
        last_failure_at=1.0,
        profile_fp=TP1.fingerprint(),
    )
    w.catalog["other"] = OTHER
    w.deploy("chat", replicas=1)
    w.deploy("other", replicas=1, profile="other")
    plan = w.step()
    [(node, words)] = reasons(plan, "chat")
    assert node == "-"
    assert words.startswith("placement cannot place or scale deployment chat: ValueError: Exceeds the limit")
    assert placed_on(plan) == [("n1",)], "the other deployment is placed in the same step"
    assert removed(plan) == [], "the replica is kept as it was; the next step tries it again"


def test_an_autoscaled_deployment_whose_bounds_fault_keeps_its_count_and_the_others_scale() -> None:
    # A target of 0 requests per replica (built in memory; on the bus it does not decode):
    # following its demand divided by zero before any deployment was converged.
    from llmgw_core.events import Autoscale
    from llmgw_placement.controller import Controller

    w = World({"n0": 1})
    for name, target in (("a-bad", 0.0), ("b-good", 4.0)):
        w.state.deployments[name] = Deployment(
            name=name,
            profile="tp1",
            autoscale=Autoscale(min_replicas=2, max_replicas=4, target_in_flight=target),
        )
    controller = Controller(w.config, None, w.state, clock=lambda: NOW)  # type: ignore[arg-type]
    counts, told = controller._autoscale(dict(w.state.deployments), NOW)
    assert counts == {"b-good": 2}, "a-bad keeps no count of this step's; b-good follows its demand"
    assert told == []
