"""A model fits before it is placed: the node reads a staged model's shape from its headers, reports
it, and placement refuses the nodes whose GPUs (or memory) cannot hold the estimate, with the figures;
a node staging a profile's weights ranks after those holding them, and its words are quoted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import parse_source
from llmgw_core.events import Deployment, DeploymentStatus, EngineState, ModelShape, NodeStatus, ReplicaRecord
from llmgw_core.fit import read_shape
from llmgw_launcher.weights import Weights
from llmgw_placement.decide import Placement, Refusal, decide
from tests.cluster_support import cluster
from tests.hf_server import Hub, hf_hub
from tests.test_placement_decide import DEP, profile
from tests.test_placement_decide import node as vllm_node
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

MODEL = "hf://org/tiny/tiny.gguf"
KEY = f"{MODEL}@main"
# 2 layers x 2 KV heads x (16 + 16) x 2 bytes (f16): 256 bytes of KV cache per token.
SHAPE = ModelShape(
    format="gguf",
    weight_bytes=433920,
    n_layer=2,
    n_head_kv=2,
    head_dim_k=16,
    head_dim_v=16,
    context_length=512,
)


SIM = {"sim": EngineState(name="sim", state="configured")}


def node(name: str, **kw: Any) -> Any:
    return vllm_node(name, **{"engines": SIM, **kw})


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> bytes:
    return write_tiny_llama(tmp_path / "tiny.gguf", n_head_kv=2).read_bytes()


@pytest.fixture
def hub(tiny_gguf: bytes) -> object:
    with hf_hub() as h:
        h.add("org/tiny", {"tiny.gguf": tiny_gguf})
        yield h


# --- the decision, over plain data ---------------------------------------------------------------


def test_a_node_whose_gpus_cannot_hold_the_model_is_refused_with_the_figures() -> None:
    # gpu-01 reported the shape; gpu-02 never held the model and is fitted with it all the same.
    shapes = {KEY: SHAPE}
    long = profile(model=MODEL, model_path="", engine="sim", tp=1, args=("--kv-tokens", "419430400"))
    nodes = [
        node("gpu-01", weights=frozenset({KEY}), shapes=shapes),
        node("gpu-02", shapes=shapes),
    ]
    refused = decide(DEP, long, nodes)
    assert isinstance(refused, Refusal)
    figures = (
        "needs ~100.0 GiB per GPU (weights 0.0 GiB + KV cache 100.0 GiB at 409600k context), "
        "H100-80G has 79.1 GiB usable"
    )
    assert refused.reasons == (("gpu-01", figures), ("gpu-02", figures))
    # The same model at a context that fits goes where the weights are.
    short = profile(model=MODEL, model_path="", engine="sim", tp=1, args=("--kv-tokens", "4096"))
    placed = decide(DEP, short, nodes)
    assert isinstance(placed, Placement)
    assert placed.members[0].node == "gpu-01"
    # Without a shape reported by any node, nothing is estimated: the node is not refused for it.
    assert isinstance(decide(DEP, long, [node("gpu-02")]), Placement)


def test_a_cpu_profile_is_fitted_to_the_hosts_memory_where_the_node_reports_it() -> None:
    shapes = {KEY: SHAPE}
    cpu = profile(
        model=MODEL, model_path="", engine="sim", gpu_class="", tp=1, args=("--kv-tokens", "16777216")
    )
    small = node("cpu-01", gpus=(), memory_mb=4096, shapes=shapes, weights=frozenset({KEY}))
    big = node("cpu-02", gpus=(), memory_mb=65536, shapes=shapes)
    unknown = node("cpu-03", gpus=(), memory_mb=0, shapes=shapes)
    placed = decide(DEP, cpu, [small, big])
    # The holder of the weights is preferred only where the model fits.
    assert isinstance(placed, Placement)
    assert placed.members[0].node == "cpu-02"
    refused = decide(DEP, cpu, [small])
    assert isinstance(refused, Refusal)
    assert refused.reasons == (
        (
            "cpu-01",
            "needs ~4.0 GiB of memory (weights 0.0 GiB + KV cache 4.0 GiB at 16384k context), "
            "the node has 3.0 GiB usable of 4.0 GiB",
        ),
    )
    # A node that does not report its memory is not checked.
    assert isinstance(decide(DEP, cpu, [unknown]), Placement)


def test_a_node_staging_the_weights_ranks_after_those_holding_them_and_before_the_rest() -> None:
    p = profile(model=MODEL, model_path="", engine="sim")
    holding = node("gpu-03", weights=frozenset({KEY}))
    staging = node("gpu-02", coming=frozenset({KEY}))
    neither = node("gpu-01")
    for nodes, expected in (([neither, staging], "gpu-02"), ([neither, staging, holding], "gpu-03")):
        decision = decide(DEP, p, nodes)
        assert isinstance(decision, Placement)
        assert decision.members[0].node == expected
    # Spread spreads: a node only staging a deployment's weights does not draw its next replica.
    spread = msgspec.structs.replace(DEP, strategy="spread")
    one_there = node("gpu-02", coming=frozenset({KEY}), replicas_of={"chat": 1})
    decision = decide(spread, p, [neither, one_there])
    assert isinstance(decision, Placement)
    assert decision.members[0].node == "gpu-01"


# --- the node reports the shape it read once ------------------------------------------------------


@pytest.mark.anyio
async def test_the_node_reports_the_shape_of_each_model_it_staged(tmp_path: Path, hub: Hub) -> None:
    from llmgw_installer.service import node_facts
    from tests.launcher_support import agent_config

    commit = hub.state.repos["org/tiny"].commit
    weights = Weights(tmp_path / "agent" / "models", environ={"HF_ENDPOINT": hub.url})
    parsed = parse_source(MODEL, "")
    assert parsed is not None
    path = await weights.stage(parsed, lambda _w: None)
    facts = node_facts(agent_config("nats://127.0.0.1:1", "p", tmp_path / "agent"))
    assert facts.shapes == {KEY: SHAPE, f"{MODEL}@{commit}": SHAPE}
    assert read_shape(path) == SHAPE
    # Read once, when staged: the probe reads the file kept beside the view, never the model.
    kept = path.parent / f".{path.name}.shape.json"
    assert msgspec.json.decode(kept.read_bytes(), type=ModelShape) == SHAPE
    # A file that is not a model is staged all the same, and reported without a shape.
    hub.add("org/notes", {"notes.gguf": b"not a gguf at all" * 100})
    notes = parse_source("hf://org/notes/notes.gguf", "")
    assert notes is not None
    await weights.stage(notes, lambda _w: None)
    facts = node_facts(agent_config("nats://127.0.0.1:1", "p", tmp_path / "agent"))
    assert "hf://org/notes/notes.gguf@main" in facts.weights
    assert set(facts.shapes) == {KEY, f"{MODEL}@{commit}"}


# --- the whole path: real NATS, placement, installers and launchers -------------------------------


def catalog(name: str, kv_tokens: int, gpu_class: str = "H100-80G") -> dict[str, Any]:
    return {
        "name": name,
        "engine": "sim",
        "model": MODEL,
        "gpu_class": gpu_class,
        "tp": 1,
        "args": ["--load-time", "0.3", "--kv-tokens", str(kv_tokens)],
        "health_timeout_s": 30.0,
    }


async def status_of(bus: Bus, deployment: str) -> DeploymentStatus | None:
    from llmgw.ctl._read import deployment_status

    return await deployment_status(bus, deployment)


async def explain(bus: Bus, deployment: str) -> list[str]:
    from llmgw.ctl._commands import explain

    return (await explain(bus, deployment)).splitlines()


async def replicas(bus: Bus, deployment: str) -> list[ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted(
        (c.value for c in found.values() if c.value and c.value.deployment == deployment),
        key=lambda r: r.replica,
    )


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_a_model_too_big_for_the_nodes_is_refused_with_the_figures_and_placed_where_it_fits(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    with cluster(tmp_path / "c", nats_url, prefix) as c:
        # gpu-a: two H100s, 4 GiB of host memory; cpu-b: no GPU, 64 GiB.
        c.start_node("gpu-a", gpus=2, simulate={"memory_mb": 4096})
        c.start_node("cpu-b", gpus=0, simulate={"memory_mb": 65536})
        c.start_placement(
            "p1",
            [
                catalog("short", 4096),
                catalog("long", 419430400),
                catalog("cpu", 16777216, gpu_class=""),
                catalog("cpu-long", 268435456, gpu_class=""),
            ],
            [{"name": "chat", "profile": "short", "replicas": 1}],
        )
        # Nothing knows the model's shape yet: it is placed, staged, and its shape reported.
        await eventually(lambda: _ready(bus, "chat", "gpu-a"), timeout=90)

        async def shape_reported() -> bool:
            got = await bus.get(bus.names.nodes_bucket, "gpu-a", NodeStatus)
            return bool(got) and got[0].facts.shapes.get(KEY) == SHAPE

        await eventually(shape_reported, timeout=30)
        for name, prof in (("big", "long"), ("cpu", "cpu"), ("cpu-long", "cpu-long")):
            await bus.put(bus.names.deployments_bucket, name, Deployment(name=name, profile=prof))

        gpu_figures = (
            "needs ~100.0 GiB per GPU (weights 0.0 GiB + KV cache 100.0 GiB at 409600k context), "
            "H100-80G has 79.1 GiB usable"
        )

        async def big_refused() -> list[str]:
            lines = await explain(bus, "big")
            return lines if "cannot be placed" in lines[0] else []

        lines = await eventually(big_refused, timeout=30)
        assert lines == [
            "big: 0 of 1 ready; 1 cannot be placed: cpu-b: no GPUs, profile needs H100-80G; "
            f"gpu-a: {gpu_figures}",
            "NODE   REASON",
            "cpu-b  no GPUs, profile needs H100-80G",
            f"gpu-a  {gpu_figures}",
        ]
        # gpu-a holds the weights, but its memory cannot hold the cache: cpu-b gets it.
        await eventually(lambda: _ready(bus, "cpu", "cpu-b"), timeout=90)

        async def cpu_long_refused() -> DeploymentStatus | None:
            s = await status_of(bus, "cpu-long")
            return s if s is not None and s.unplaceable else None

        status = await eventually(cpu_long_refused, timeout=30)
        assert [(r.node, r.reason) for r in status.reasons] == [
            (
                "cpu-b",
                "needs ~64.0 GiB of memory (weights 0.0 GiB + KV cache 64.0 GiB at 262144k context), "
                "the node has 57.6 GiB usable of 64.0 GiB",
            ),
            (
                "gpu-a",
                "needs ~64.0 GiB of memory (weights 0.0 GiB + KV cache 64.0 GiB at 262144k context), "
                "the node has 3.0 GiB usable of 4.0 GiB",
            ),
        ]
        assert await replicas(bus, "big") == []


async def _ready(bus: Bus, deployment: str, on: str) -> bool:
    found = await replicas(bus, deployment)
    assert [(r.state, [m.node for m in r.members]) for r in found] == [("ready", [on])], [
        (r.replica, r.state, r.reason) for r in found
    ]
    return True


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_while_a_node_stages_the_weights_the_deployment_quotes_its_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.state.hang = True  # the hub answers the metadata, then sends no byte of the file
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    commit = hub.state.repos["org/tiny"].commit
    size = len(hub.state.repos["org/tiny"].files["tiny.gguf"])
    with cluster(tmp_path / "c", nats_url, prefix) as c:
        c.start_node("gpu-a", gpus=1)
        c.start_placement("p1", [catalog("short", 4096)], [{"name": "chat", "profile": "short"}])
        words = f"weights tiny@{commit[:6]}: downloading tiny.gguf (0%, 0.0 of {size / 1000:.1f} kB)"

        async def quoted() -> DeploymentStatus | None:
            s = await status_of(bus, "chat")
            return s if s is not None and "downloading" in s.summary else None

        status = await eventually(quoted, timeout=60)
        assert status.summary == f"chat: 0 of 1 ready; 1 starting; r0: gpu-a: {words}"
        assert await explain(bus, "chat") == [status.summary]
        (record,) = await replicas(bus, "chat")
        assert (record.state, record.reason) == ("starting", f"gpu-a: {words}")
