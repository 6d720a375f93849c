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
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    EngineState,
    ModelShape,
    NodeStatus,
    ReplicaRecord,
    ShardStatus,
)
from llmgw_core.fit import read_shape
from llmgw_launcher.weights import Weights
from llmgw_placement.decide import Placement, Refusal, decide
from tests.cluster_support import cluster
from tests.hf_server import Hub, hf_hub
from tests.test_placement_decide import DEP, profile
from tests.test_placement_decide import node as vllm_node
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually, passes

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


# --- the first replica of a model no node has staged: fitted on the node before its engine starts --

# Two L40S nodes: gpu-a's cards report 45700 MiB (44.1 GiB usable), gpu-b's 46068 (44.5 GiB).
L40S = {"gpu_name": "NVIDIA L40S", "gpu_capability": "8.9"}
SMALL_L40S, L40S_MB = 45700, 46068
# 256 bytes of KV cache per token: 44.3 GiB at 181440k (only gpu-b holds it), 46.0 GiB at 188416k.
FITS_B, FITS_NONE = 181440 * 1024, 188416 * 1024


def transitions(states: list[str]) -> list[str]:
    """The states in order, a status sent again (the launcher re-publishing what it runs) once."""
    return [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]


def too_big(kv: str, usable: str) -> str:
    return (
        f"needs ~{kv} GiB per GPU (weights 0.0 GiB + KV cache {kv} GiB at "
        f"{'181440k' if kv == '44.3' else '188416k'} context), L40S-45G has {usable} GiB usable"
    )


def test_one_rule_fits_a_shard_to_the_gpus_it_gets_or_the_hosts_memory() -> None:
    from llmgw_core.engines import GPUInfo
    from llmgw_core.fit import check_shard

    gpu = profile(
        model=MODEL,
        model_path="",
        engine="sim",
        tp=1,
        gpu_class="L40S-45G",
        args=("--kv-tokens", str(FITS_B)),
    )
    small, big = (
        GPUInfo(index=i, name="NVIDIA L40S", memory_mb=mb) for i, mb in enumerate((SMALL_L40S, L40S_MB))
    )
    assert check_shard(SHAPE, gpu, [big]) is None
    # The smallest of the shard's GPUs decides.
    assert check_shard(SHAPE, gpu, [big, small]) == too_big("44.3", "44.1")
    # A GPU that reports no memory, or no GPU at all, is not checked.
    assert check_shard(SHAPE, gpu, [GPUInfo(index=0, name="NVIDIA L40S")]) is None
    assert check_shard(SHAPE, gpu, []) is None
    cpu = msgspec.structs.replace(gpu, gpu_class="", args=("--kv-tokens", "16777216"))
    assert check_shard(SHAPE, cpu, [big], memory_mb=65536) is None
    assert check_shard(SHAPE, cpu, memory_mb=4096) == (
        "needs ~4.0 GiB of memory (weights 0.0 GiB + KV cache 4.0 GiB at 16384k context), "
        "the node has 3.0 GiB usable of 4.0 GiB"
    )
    assert check_shard(SHAPE, cpu) is None


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_staged_model_its_gpus_or_memory_cannot_hold_fails_once_before_any_engine_starts(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the launcher alone: the shape read when staged is fitted to the GPUs the shard is pinned
    to (a CPU profile to the host's memory) by placement's rule; a shard that cannot fit fails
    once, for good, with the figures, and no engine process is started."""
    from nats.aio.msg import Msg

    from llmgw_core.engines import GPUInfo
    from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    gpus = [
        GPUInfo(index=i, name="NVIDIA L40S", compute_capability="8.9", memory_mb=mb)
        for i, mb in enumerate((L40S_MB, SMALL_L40S))
    ]

    def gpu_profile(kv_tokens: int) -> Any:
        return sim_profile("--kv-tokens", str(kv_tokens), model=MODEL, model_path="", gpu_class="L40S-45G")

    specs = {
        # Fits GPU 0, not GPU 1: the GPUs the shard is pinned to are those fitted.
        "fits": shard("node-a", "fits", gpu_profile(FITS_B), gpus=[0]),
        "small-gpu": shard("node-a", "small-gpu", gpu_profile(FITS_B), gpus=[1]),
        "cpu": shard("node-a", "cpu", sim_profile("--kv-tokens", "16777216", model=MODEL, model_path="")),
    }
    beats: list[bytes] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(msg.data)

    await bus.nc.subscribe(bus.names.heartbeat("node-a", "launcher"), cb=on_beat)
    config = agent_config(nats_url, prefix, tmp_path / "agent", simulate={"memory_mb": 4096})
    async with shard_events(bus) as events, running_launcher(config, gpus=gpus):
        for name, spec in specs.items():
            await bus.put(bus.names.shards_bucket, f"node-a.{name}", spec)
        await eventually(lambda: events.states("fits")[-1:] == ["ready"], timeout=60)
        for name in ("small-gpu", "cpu"):
            await eventually(lambda name=name: events.states(name)[-1:] == ["failed"], timeout=60)
        # Several heartbeats (and restart backoffs) later, still one attempt each.
        await passes(lambda: len(beats), 4, timeout=30)
        expected = {
            "small-gpu": too_big("44.3", "44.1"),
            "cpu": "needs ~4.0 GiB of memory (weights 0.0 GiB + KV cache 4.0 GiB at 16384k context), "
            "the node has 3.0 GiB usable of 4.0 GiB",
        }
        for name, reason in expected.items():
            assert transitions(events.states(name)) == ["pending", "waiting", "failed"], events.states(name)
            last = events.last(name)
            assert last is not None
            assert (last.reason, last.retryable, last.pids, last.restarts) == (reason, False, (), 0)
    # No engine was started for them: only the shard that fits has process logs.
    assert sorted(p.name for p in (tmp_path / "agent" / "logs").iterdir()) == ["node-a.fits"]


@pytest.mark.anyio
@pytest.mark.timeout(300)
async def test_the_first_replica_of_a_model_too_big_for_its_node_fails_there_once_and_goes_where_it_fits(
    bus: Bus,
    nats_url: str,
    prefix: str,
    tmp_path: Path,
    tiny_gguf: bytes,
    hub: Hub,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a replica placed before any node had reported its model's shape was not
    checked; on GPUs too small its engine failed to allocate, in its own words, and was
    restarted. Now the node fits it before the engine starts and fails it once with the figures;
    the node reports the shape, and placement removes the replica and places it on a node that
    fits, or, where none does, says every node's figures."""
    from nats.aio.msg import Msg

    from llmgw_core.events import ReplicaStatus, decoder
    from tests.launcher_support import shard_events

    hub.add("org/big", {"big.gguf": tiny_gguf})
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    replica_events: list[ReplicaStatus] = []

    async def on_replica(msg: Msg) -> None:
        replica_events.append(decoder(ReplicaStatus).decode(msg.data))

    await bus.nc.subscribe(f"{prefix}.events.replica.>", cb=on_replica)
    chat = catalog("chat", FITS_B, gpu_class="L40S-45G")
    big = {**catalog("big", FITS_NONE, gpu_class="L40S-45G"), "model": "hf://org/big/big.gguf"}
    with cluster(tmp_path / "c", nats_url, prefix) as c:
        c.start_node("gpu-a", gpus=2, simulate={**L40S, "gpu_memory_mb": SMALL_L40S})
        c.start_node("gpu-b", gpus=2, simulate={**L40S, "gpu_memory_mb": L40S_MB})

        async def nodes_up() -> bool:
            found = await bus.entries(bus.names.nodes_bucket, NodeStatus)
            return {k for k, v in found.items() if v.value and v.value.engines} >= {"gpu-a", "gpu-b"}

        await eventually(nodes_up, timeout=60, interval=0.3)
        async with shard_events(bus) as events:
            # Binpack ties break by name: nothing knows the model's shape, so gpu-a gets it.
            c.start_placement("p1", [chat, big], [{"name": "chat", "profile": "chat"}])
            await eventually(lambda: _ready(bus, "chat", "gpu-b"), timeout=120)

            def chat_on_a() -> list[ShardStatus]:
                found = [s for s in events.items if s.deployment == "chat" and s.node == "gpu-a"]
                return found if found and found[-1].state == "stopped" else []

            on_a = await eventually(chat_on_a, timeout=30)
            # Failed once, never restarted, then stopped: the replica went elsewhere.
            states = transitions([s.state for s in on_a])
            assert states == ["pending", "waiting", "failed", "stopping", "stopped"], [
                (s.state, s.reason) for s in on_a
            ]
            failed = next(s for s in reversed(on_a) if s.state == "failed")
            assert (failed.reason, failed.retryable, failed.pids, failed.restarts) == (
                too_big("44.3", "44.1"),
                False,
                (),
                0,
            )
            assert any(
                e.deployment == "chat"
                and e.state == "failed"
                and e.reason == f"gpu-a: {too_big('44.3', '44.1')}"
                for e in replica_events
            ), [(e.deployment, e.state, e.reason) for e in replica_events]

            async def ready_said() -> bool:
                # The status is published in the step after the replica's `ready`.
                said = (await explain(bus, "chat"))[0]
                assert said == "chat: 1 of 1 ready", said
                return True

            await eventually(ready_said, timeout=30, interval=0.5)

            # A model no node fits: it fails once on the node it went to first (gpu-b, the
            # tighter fit), and then every node is refused with its own figures.
            await bus.put(bus.names.deployments_bucket, "big", Deployment(name="big", profile="big"))

            async def big_refused() -> list[str]:
                lines = await explain(bus, "big")
                return lines if "cannot be placed" in lines[0] else []

            lines = await eventually(big_refused, timeout=120, interval=0.3)
            a, b = too_big("46.0", "44.1"), too_big("46.0", "44.5")
            assert lines == [
                f"big: 0 of 1 ready; 1 cannot be placed: gpu-a: {a}; gpu-b: {b}",
                "NODE   REASON",
                f"gpu-a  {a}",
                f"gpu-b  {b}",
            ]
            tried = [
                s for s in events.items if s.deployment == "big" and s.state not in ("stopping", "stopped")
            ]
            assert {s.node for s in tried} == {"gpu-b"}, [(s.node, s.state, s.reason) for s in tried]
            assert transitions([s.state for s in tried]) == ["pending", "waiting", "failed"], [
                (s.node, s.state, s.reason) for s in tried
            ]
            assert (tried[-1].reason, tried[-1].pids, tried[-1].restarts) == (b, (), 0)
            assert await replicas(bus, "big") == []


def test_only_weights_a_node_stages_itself_are_ever_on_their_way_to_it() -> None:
    """Regression: a node running a replica of a `model_path` profile counted as staging that
    path for good (it never reports holding it), and outranked a tighter fit."""
    from llmgw_core.events import Profile

    sha = "ab" * 32
    hub = Profile(name="a", engine="llamacpp", model="hf://org/repo/x.gguf")
    url = Profile(name="b", engine="llamacpp", model="https://example.invalid/x.gguf", model_sha256=sha)
    assert hub.staged_key == hub.weights_key == "hf://org/repo/x.gguf@main"
    assert url.staged_key == url.weights_key == f"sha256:{sha}"
    for held in (
        Profile(name="c", engine="llamacpp", model="file:///models/x.gguf"),
        Profile(name="d", engine="llamacpp", model_path="/models/x.gguf"),
        Profile(name="e", engine="vllm", model_path="org/repo"),
    ):
        assert held.staged_key == "", held
        assert held.weights_key != ""
