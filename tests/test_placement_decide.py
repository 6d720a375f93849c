"""Table tests of the pure placement decision."""

from __future__ import annotations

import msgspec
import pytest

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineState
from llmgw_placement.decide import NodeView, Placement, Refusal, choose_gpus, decide
from llmgw_placement.gpuclass import gpu_class

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def gpus(n: int, name: str = H100, cap: str = "9.0") -> tuple[GPUInfo, ...]:
    return tuple(GPUInfo(index=i, name=name, compute_capability=cap, memory_mb=81559) for i in range(n))


VLLM_OK = {"vllm": EngineState(name="vllm", state="configured", version="0.11.1")}


def node(name: str, **kw: object) -> NodeView:
    fields: dict[str, object] = {
        "node": name,
        "gpus": gpus(8),
        "engines": VLLM_OK,
        "pools": frozenset({"default"}),
        "mgmt_addr": f"10.0.0.{int(name.split('-')[1])}",
    }
    fields.update(kw)
    return NodeView(**fields)  # type: ignore[arg-type]


def profile(**kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "llama-70b",
        "engine": "vllm",
        "model_path": "/models/llama-70b",
        "gpu_class": "H100-80G",
        "tp": 4,
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


DEP = Deployment(name="chat", profile="llama-70b", replicas=1, pool="default")


def test_gpu_classes() -> None:
    assert gpu_class(GPUInfo(index=0, name=H100, memory_mb=81559)) == "H100-80G"
    assert gpu_class(GPUInfo(index=0, name=A100, memory_mb=81920)) == "A100-80G"
    assert gpu_class(GPUInfo(index=0, name="NVIDIA L40S", memory_mb=46068)) == "L40S-45G"
    assert gpu_class(GPUInfo(index=0, name="NVIDIA A100-SXM4-40GB", memory_mb=40960)) == "A100-40G"


def test_every_refusal_reason_word_for_word() -> None:
    nodes = [
        node("gpu-03", used_gpus=frozenset(range(6))),
        node(
            "gpu-07", engines={}, install="installing: downloading llama-b10991-bin-ubuntu-x64.tar.gz (16 MB)"
        ),
        node("gpu-09", gpus=gpus(8, A100, "8.0")),
        node("gpu-11", alive=False, lost_for_s=12.4),
        node("gpu-12", pools=frozenset({"batch"})),
        node(
            "gpu-13",
            engines={
                "vllm": EngineState(
                    name="vllm", state="broken", detail="libcudart.so.12 not found (needed by python)"
                )
            },
        ),
        node("gpu-14", gpus=()),
        node(
            "cpu-01",
            gpus=(),
            avx2=False,
            engines={"llamacpp": EngineState(name="llamacpp", state="installed")},
        ),
    ]
    decision = decide(DEP, profile(), nodes)
    assert isinstance(decision, Refusal)
    assert decision.reasons == (
        ("cpu-01", "engine vllm not installed"),
        ("gpu-03", "2 of 8 GPUs free, profile needs 4"),
        ("gpu-07", "installing: downloading llama-b10991-bin-ubuntu-x64.tar.gz (16 MB)"),
        ("gpu-09", "GPU class A100-80G, profile needs H100-80G"),
        ("gpu-11", "lost 12 s ago"),
        ("gpu-12", "not in pool default"),
        ("gpu-13", "engine vllm broken: libcudart.so.12 not found (needed by python)"),
        ("gpu-14", "no GPUs, profile needs H100-80G"),
    )
    cpu = profile(engine="llamacpp", gpu_class="", tp=1)
    refused = decide(DEP, cpu, [nodes[-1]])
    assert isinstance(refused, Refusal)
    assert refused.text() == (
        "cpu-01: no AVX2: llama.cpp's CPU build would run several times slower here; "
        "place CPU profiles on nodes with AVX2 (`llmgw ctl nodes` marks those without), "
        "or give the profile a gpu_class"
    )


def test_no_avx2_refuses_only_cpu_profiles_of_real_engines() -> None:
    llama = {"llamacpp": EngineState(name="llamacpp", state="installed", version="b11434")}
    old_cpu = node("gpu-05", avx2=False, engines={**llama, **VLLM_OK})
    # GPU profiles run on the GPUs: the CPU's vector width does not matter there.
    assert isinstance(decide(DEP, profile(), [old_cpu]), Placement)
    assert isinstance(decide(DEP, profile(engine="llamacpp", tp=1), [old_cpu]), Placement)
    refused = decide(DEP, profile(gpu_class="", tp=1), [old_cpu])
    assert isinstance(refused, Refusal)
    assert refused.text().startswith("gpu-05: no AVX2: vLLM's CPU build would run several times slower here")
    # A CPU node with AVX2 takes the same CPU profile.
    assert isinstance(
        decide(DEP, profile(engine="llamacpp", gpu_class="", tp=1), [node("cpu-02", gpus=(), engines=llama)]),
        Placement,
    )


def test_compute_capability_refusal() -> None:
    p = profile(gpu_class="A100-80G", tp=1, args=["--quantization", "fp8"])
    decision = decide(DEP, p, [node("gpu-09", gpus=gpus(8, A100, "8.0"))])
    assert isinstance(decision, Refusal)
    assert (
        decision.text() == "gpu-09: fp8 needs compute capability 8.9, GPU 0 (NVIDIA A100-SXM4-80GB) has 8.0"
    )


def test_binpack_takes_the_tightest_node_and_contiguous_gpus() -> None:
    nodes = [
        node("gpu-01"),
        node("gpu-02", used_gpus=frozenset({0, 1, 6, 7})),
        node("gpu-03", used_gpus=frozenset({0})),
    ]
    decision = decide(DEP, profile(), nodes)
    assert isinstance(decision, Placement)
    [member] = decision.members
    assert (member.node, member.gpus, member.addr) == ("gpu-02", (2, 3, 4, 5), "10.0.0.2")
    # GPUs 1-4 are the first contiguous run on gpu-03.
    third = decide(DEP, profile(), [nodes[2]])
    assert isinstance(third, Placement)
    assert third.members[0].gpus == (1, 2, 3, 4)


def test_scattered_gpus_when_no_run_is_free() -> None:
    n = node("gpu-01", used_gpus=frozenset({1, 3, 5, 7}))
    decision = decide(DEP, profile(), [n])
    assert isinstance(decision, Placement)
    assert decision.members[0].gpus == (0, 2, 4, 6)


def test_spread_takes_the_node_with_fewest_replicas_of_the_deployment() -> None:
    spread = msgspec.structs.replace(DEP, strategy="spread")
    nodes = [
        node("gpu-01", replicas_of={"chat": 1}, used_gpus=frozenset({0, 1, 2, 3})),
        node("gpu-02", used_gpus=frozenset({0, 1, 2, 3})),
        node("gpu-03"),
    ]
    decision = decide(spread, profile(), nodes)
    assert isinstance(decision, Placement)
    assert decision.members[0].node == "gpu-03"
    binpack = decide(DEP, profile(), nodes)
    assert isinstance(binpack, Placement)
    assert binpack.members[0].node == "gpu-01"


def test_nodes_holding_the_weights_come_first() -> None:
    nodes = [
        node("gpu-01", used_gpus=frozenset({0, 1, 2, 3})),
        node("gpu-02", weights=frozenset({"/models/llama-70b"})),
    ]
    decision = decide(DEP, profile(), nodes)
    assert isinstance(decision, Placement)
    assert decision.members[0].node == "gpu-02"


def test_two_node_tp8_goes_to_the_fabric_with_two_nodes_and_gets_only_its_hcas() -> None:
    p = profile(tp=8, nodes=2, gpus_per_node=4)
    nodes = [
        node("gpu-01", fabric="ib-a", hcas=("mlx5_0", "mlx5_1", "mlx5_2")),
        node("gpu-02", fabric="ib-a", hcas=("mlx5_0", "mlx5_1", "mlx5_2")),
        node("gpu-03", fabric="ib-b", hcas=("mlx5_0", "mlx5_1", "mlx5_2")),
    ]
    fabric_hcas = {"ib-a": ("mlx5_0", "mlx5_1"), "ib-b": ("mlx5_2",)}
    decision = decide(DEP, p, nodes, fabric_hcas=fabric_hcas, port_range=(30000, 30010))
    assert isinstance(decision, Placement)
    assert decision.fabric == "ib-a"
    assert [(m.node, m.rank, m.gpus, m.hcas, m.port) for m in decision.members] == [
        ("gpu-01", 0, (0, 1, 2, 3), ("mlx5_0", "mlx5_1"), 30000),
        ("gpu-02", 1, (0, 1, 2, 3), ("mlx5_0", "mlx5_1"), 30000),
    ]
    refused = decide(DEP, p, nodes[2:], fabric_hcas=fabric_hcas)
    assert isinstance(refused, Refusal)
    assert refused.text() == "gpu-03: fabric ib-b has 1 fitting node, profile needs 2"


def test_the_rendezvous_port_avoids_ports_in_use_on_every_member() -> None:
    p = profile(tp=8, nodes=2, gpus_per_node=4)
    nodes = [
        node("gpu-01", fabric="ib-a", used_ports=frozenset({30000})),
        node("gpu-02", fabric="ib-a", used_ports=frozenset({30001})),
    ]
    decision = decide(DEP, p, nodes, port_range=(30000, 30010))
    assert isinstance(decision, Placement)
    assert {m.port for m in decision.members} == {30002}


@pytest.mark.parametrize("strategy", ["binpack", "spread"])
def test_the_decision_is_deterministic(strategy: str) -> None:
    dep = msgspec.structs.replace(DEP, strategy=strategy)
    nodes = [node(f"gpu-{i:02d}", used_gpus=frozenset(range(i % 4))) for i in range(1, 30)]
    first = decide(dep, profile(), nodes)
    assert all(decide(dep, profile(), list(reversed(nodes))) == first for _ in range(5))


def test_choose_gpus_of_none_is_empty() -> None:
    """Regression: a multi-node profile without gpus_per_node asked for 0 GPUs per node and
    choose_gpus raised IndexError, failing every control step."""
    gpus = [GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", memory_mb=81559) for i in range(2)]
    assert choose_gpus(gpus, 0) == []


def test_a_cpu_build_on_a_gpu_node_takes_cpu_profiles_only_and_says_why() -> None:
    from llmgw_placement.decide import NodeIndex

    words = "driver supports CUDA 12.2; b11434 has CUDA builds 12.8, 13.4 only"
    cpu_build = {
        "llamacpp": EngineState(name="llamacpp", state="installed", version="b11434", cpu_only=words)
    }
    cuda_build = {"llamacpp": EngineState(name="llamacpp", state="installed", version="b11434")}
    gpu_profile = profile(engine="llamacpp", tp=1)
    cpu_profile = profile(engine="llamacpp", tp=1, gpu_class="")
    old = node("gpu-01", engines=cpu_build)
    index = NodeIndex([old])
    assert decide(DEP, gpu_profile, index) == Refusal(
        (("gpu-01", f"engine llamacpp is the CPU build here: {words}"),)
    )
    assert index.candidates(gpu_profile) == []
    placed = decide(DEP, cpu_profile, index)
    assert isinstance(placed, Placement)
    assert [m.node for m in placed.members] == ["gpu-01"]
    index.add(node("gpu-02", engines=cuda_build))
    placed = decide(DEP, gpu_profile, index)
    assert isinstance(placed, Placement)
    assert [m.node for m in placed.members] == ["gpu-02"]
