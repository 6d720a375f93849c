"""Golden tests: the exact argv and environment of every adapter, and every validation message."""

from __future__ import annotations

import sys

import msgspec
import pytest

from llmgw_core.engines import (
    VLLM,
    Address,
    Command,
    GPUInfo,
    LlamaCpp,
    LlamaCppConfig,
    Member,
    Profile,
    Registry,
    SGLang,
    SGLangConfig,
    ShardSpec,
    Sim,
    UnknownEngineError,
    VLLMConfig,
    default_registry,
    quantization_of,
)
from llmgw_core.engines.llamacpp import device_order

BASE = {"HOME": "/home/llmgw", "PATH": "/usr/bin"}
H100 = [GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", compute_capability="9.0") for i in range(8)]
A100 = [GPUInfo(index=i, name="NVIDIA A100-SXM4-80GB", compute_capability="8.0") for i in range(8)]


def profile(engine: str, **kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "llama-70b",
        "engine": engine,
        "model_path": "/models/llama-70b",
        "served_model_name": "llama-70b",
        "gpu_class": "H100-80G",
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


def single(p: Profile, gpus: tuple[int, ...]) -> ShardSpec:
    return ShardSpec(
        replica="r0", shard="r0-0", node="gpu-01", profile=p, gpus=gpus, host="0.0.0.0", port=8000
    )


def two_node(p: Profile, rank: int, dist_port: int = 6379) -> ShardSpec:
    members = (
        Member(node="gpu-01", addr="10.0.0.1", port=dist_port),
        Member(node="gpu-02", addr="10.0.0.2", port=dist_port),
    )
    return ShardSpec(
        replica="r0",
        shard=f"r0-{rank}",
        node=members[rank].node,
        profile=p,
        rank=rank,
        gpus=(0, 1, 2, 3),
        host="0.0.0.0",
        port=8000,
        members=members,
        hcas=("mlx5_0", "mlx5_1"),
        mgmt_iface="eth0",
        fabric="ib-a",
    )


def env(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({**BASE, **extra}.items()))


MULTI_ENV = {
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "NCCL_IB_HCA": "mlx5_0,mlx5_1",
    "NCCL_IB_DISABLE": "0",
    "NCCL_SOCKET_IFNAME": "eth0",
    "GLOO_SOCKET_IFNAME": "eth0",
}


# --- vLLM ---------------------------------------------------------------------

VLLM_BIN = VLLMConfig(bin_dir="/opt/vllm/bin")


def test_vllm_one_node_tp1() -> None:
    cmds = VLLM(VLLM_BIN).commands(single(profile("vllm"), (0,)), BASE)
    assert cmds == [
        Command(
            name="vllm",
            path="/opt/vllm/bin/vllm",
            args=(
                "serve",
                "/models/llama-70b",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--served-model-name",
                "llama-70b",
                "--tensor-parallel-size",
                "1",
                "--pipeline-parallel-size",
                "1",
                "--distributed-executor-backend",
                "mp",
            ),
            env=env(CUDA_VISIBLE_DEVICES="0", NCCL_IB_DISABLE="1"),
        )
    ]


def test_vllm_one_node_tp4_on_gpus_4_to_7_with_profile_args_and_env() -> None:
    p = profile(
        "vllm",
        tp=4,
        args=["--max-model-len", "8192"],
        env={"CUDA_VISIBLE_DEVICES": "7,6,5,4", "HF_HOME": "/cache"},
    )
    cmds = VLLM(VLLM_BIN).commands(single(p, (4, 5, 6, 7)), BASE)
    assert cmds == [
        Command(
            name="vllm",
            path="/opt/vllm/bin/vllm",
            args=(
                "serve",
                "/models/llama-70b",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--served-model-name",
                "llama-70b",
                "--tensor-parallel-size",
                "4",
                "--pipeline-parallel-size",
                "1",
                "--distributed-executor-backend",
                "mp",
                "--max-model-len",
                "8192",
            ),
            # The profile's env wins over what llmgw generates.
            env=env(CUDA_VISIBLE_DEVICES="7,6,5,4", HF_HOME="/cache", NCCL_IB_DISABLE="1"),
        )
    ]


RAY_NODE = (
    "--temp-dir=/var/lib/llmgw/ray/6379",
    "--dashboard-agent-listen-port=0",
    "--node-manager-port=0",
    "--object-manager-port=0",
    "--min-worker-port=0",
    "--max-worker-port=0",
    "--disable-usage-stats",
)


def test_vllm_two_nodes_with_ray() -> None:
    p = profile("vllm", tp=8, pp=1, nodes=2, gpus_per_node=4)
    ray = VLLM(VLLMConfig(bin_dir="/opt/vllm/bin", multinode="ray", ray_temp_root="/var/lib/llmgw/ray"))
    head_shard = msgspec.structs.replace(two_node(p, 0), extra_ports=(20017,))
    assert ray.extra_ports(two_node(p, 0)) == 1
    assert ray.extra_ports(two_node(p, 1)) == 0
    leader = ray.commands(head_shard, BASE)
    worker = ray.commands(two_node(p, 1), BASE)
    assert leader == [
        Command(
            name="ray-head",
            path="/opt/vllm/bin/ray",
            args=(
                "start",
                "--head",
                "--port=6379",
                "--node-ip-address=10.0.0.1",
                *RAY_NODE,
                "--include-dashboard=false",
                # Ray's default 10001 is taken by the first head on the node.
                "--ray-client-server-port=20017",
                "--block",
            ),
            env=env(**MULTI_ENV, VLLM_HOST_IP="10.0.0.1"),
        ),
        Command(
            name="vllm",
            path="/opt/vllm/bin/vllm",
            args=(
                "serve",
                "/models/llama-70b",
                "--host",
                "0.0.0.0",
                "--port",
                "8000",
                "--served-model-name",
                "llama-70b",
                "--tensor-parallel-size",
                "8",
                "--pipeline-parallel-size",
                "1",
                "--distributed-executor-backend",
                "ray",
            ),
            # Its own replica's head by address, not "the" Ray of the machine.
            env=env(**MULTI_ENV, VLLM_HOST_IP="10.0.0.1", RAY_ADDRESS="10.0.0.1:6379"),
            # Started only once its own head listens: before that, `vllm serve`
            # would start a Ray of its own and never see the worker's GPUs.
            wait_for=(Address("10.0.0.1", 6379),),
        ),
    ]
    assert worker == [
        Command(
            name="ray-worker",
            path="/opt/vllm/bin/ray",
            args=(
                "start",
                "--address=10.0.0.1:6379",
                "--node-ip-address=10.0.0.2",
                *RAY_NODE,
                "--block",
            ),
            env=env(**MULTI_ENV, VLLM_HOST_IP="10.0.0.2"),
            wait_for=(Address("10.0.0.1", 6379),),
        ),
    ]
    assert VLLM().serves_http(two_node(p, 0))
    assert not VLLM().serves_http(two_node(p, 1))


def test_vllm_ray_temp_dir_too_long_for_rays_sockets_is_refused() -> None:
    p = profile("vllm", tp=8, pp=1, nodes=2, gpus_per_node=4)
    root = "/srv/" + "x" * 40
    ray = VLLM(VLLMConfig(bin_dir="/opt/vllm/bin", multinode="ray", ray_temp_root=root))
    assert ray.validate(p, H100[:4], two_node(p, 1)) == [
        f"shard r0-1: Ray's temp dir {root}/6379 is too long for Ray's sockets "
        "(114 bytes, at most 107); use a shorter state_dir in agent.yaml"
    ]


def test_vllm_cpu_profile_needs_no_gpus() -> None:
    p = profile("vllm", gpu_class="")
    s = ShardSpec(replica="r0", shard="r0-0", node="cpu-01", profile=p, port=8000)
    assert VLLM().validate(p, [], s) == []
    assert VLLM().commands(s, BASE)[0].env_dict()["CUDA_VISIBLE_DEVICES"] == ""
    # A profile that names a GPU class still needs its GPUs.
    assert VLLM().validate(profile("vllm"), [], s) == ["profile llama-70b: needs 1 GPUs per node, node has 0"]


def test_vllm_two_nodes_tp8_pp2_native() -> None:
    p = profile("vllm", tp=4, pp=2, nodes=2, gpus_per_node=4)
    native = VLLM(VLLMConfig(bin_dir="/opt/vllm/bin", multinode="native"))
    common = (
        "serve",
        "/models/llama-70b",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "llama-70b",
        "--tensor-parallel-size",
        "4",
        "--pipeline-parallel-size",
        "2",
        "--distributed-executor-backend",
        "mp",
        "--nnodes",
        "2",
    )
    assert native.commands(two_node(p, 0, 29500), BASE) == [
        Command(
            name="vllm",
            path="/opt/vllm/bin/vllm",
            args=(
                *common,
                "--node-rank",
                "0",
                "--master-addr",
                "10.0.0.1",
                "--master-port",
                "29500",
            ),
            env=env(**MULTI_ENV, VLLM_HOST_IP="10.0.0.1"),
        )
    ]
    assert native.commands(two_node(p, 1, 29500), BASE) == [
        Command(
            name="vllm",
            path="/opt/vllm/bin/vllm",
            args=(
                *common,
                "--node-rank",
                "1",
                "--master-addr",
                "10.0.0.1",
                "--master-port",
                "29500",
                "--headless",
            ),
            env=env(**MULTI_ENV, VLLM_HOST_IP="10.0.0.2"),
        )
    ]


# --- SGLang -----------------------------------------------------------------

SG = SGLang(SGLangConfig(python="/opt/sglang/bin/python"))
SG_ARGS = (
    "-m",
    "sglang.launch_server",
    "--model-path",
    "/models/llama-70b",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
)


def test_sglang_one_node_tp1() -> None:
    assert SG.commands(single(profile("sglang"), (0,)), BASE) == [
        Command(
            name="sglang",
            path="/opt/sglang/bin/python",
            args=(
                *SG_ARGS,
                "--tp-size",
                "1",
                "--pp-size",
                "1",
                "--served-model-name",
                "llama-70b",
                "--enable-metrics",
            ),
            env=env(CUDA_VISIBLE_DEVICES="0", NCCL_IB_DISABLE="1"),
        )
    ]


def test_sglang_one_node_tp4_on_gpus_4_to_7() -> None:
    assert SG.commands(single(profile("sglang", tp=4), (4, 5, 6, 7)), BASE) == [
        Command(
            name="sglang",
            path="/opt/sglang/bin/python",
            args=(
                *SG_ARGS,
                "--tp-size",
                "4",
                "--pp-size",
                "1",
                "--served-model-name",
                "llama-70b",
                "--enable-metrics",
            ),
            env=env(CUDA_VISIBLE_DEVICES="4,5,6,7", NCCL_IB_DISABLE="1"),
        )
    ]


def test_sglang_two_nodes_tp8_pp2() -> None:
    p = profile("sglang", tp=4, pp=2, nodes=2, gpus_per_node=4)
    for rank in (0, 1):
        assert SG.commands(two_node(p, rank, 5000), BASE) == [
            Command(
                name="sglang",
                path="/opt/sglang/bin/python",
                args=(
                    *SG_ARGS,
                    "--tp-size",
                    "4",
                    "--pp-size",
                    "2",
                    "--served-model-name",
                    "llama-70b",
                    "--enable-metrics",
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(rank),
                    "--dist-init-addr",
                    "10.0.0.1:5000",
                ),
                env=env(**MULTI_ENV),
            )
        ]
    assert SG.serves_http(two_node(p, 0))
    assert not SG.serves_http(two_node(p, 1))
    assert SG.health_path == "/health"


# --- llama.cpp ----------------------------------------------------------------

LC = LlamaCpp(LlamaCppConfig(bin_dir="/opt/llmgw/engines/llamacpp/b11434"))
LC_BIN = "/opt/llmgw/engines/llamacpp/b11434"
LC_ARGS = (
    "-m",
    "/models/llama-70b",
    "--host",
    "0.0.0.0",
    "--port",
    "8000",
    "--alias",
    "llama-70b",
    "-ngl",
    "999",
    "--metrics",
)


def test_llamacpp_one_node_tp1() -> None:
    assert LC.commands(single(profile("llamacpp"), (0,)), BASE) == [
        Command(
            name="llama-server",
            path=f"{LC_BIN}/llama-server",
            args=LC_ARGS,
            env=env(CUDA_VISIBLE_DEVICES="0", NCCL_IB_DISABLE="1"),
        )
    ]


def test_llamacpp_one_node_tp4_splits_rows_across_gpus_4_to_7() -> None:
    assert LC.commands(single(profile("llamacpp", tp=4), (4, 5, 6, 7)), BASE) == [
        Command(
            name="llama-server",
            path=f"{LC_BIN}/llama-server",
            args=(*LC_ARGS, "-sm", "row", "-ts", "1,1,1,1"),
            env=env(CUDA_VISIBLE_DEVICES="4,5,6,7", NCCL_IB_DISABLE="1"),
        )
    ]


def test_llamacpp_two_nodes_leader_waits_for_the_workers_rpc_servers() -> None:
    p = profile("llamacpp", tp=4, pp=2, nodes=2, gpus_per_node=4)
    assert LC.commands(two_node(p, 1, 50052), BASE) == [
        Command(
            name="rpc-server",
            path=f"{LC_BIN}/ggml-rpc-server",
            args=("--host", "10.0.0.2", "--port", "50052"),
            env=env(**MULTI_ENV),
        )
    ]
    assert LC.commands(two_node(p, 0, 50052), BASE) == [
        Command(
            name="llama-server",
            path=f"{LC_BIN}/llama-server",
            # llama.cpp's device order: the worker's four GPUs (over RPC) first, then the
            # leader's own four; every one of the eight named, or the leader's get nothing.
            args=(*LC_ARGS, "-sm", "layer", "-ts", "1,1,1,1,1,1,1,1", "--rpc", "10.0.0.2:50052"),
            env=env(**MULTI_ENV),
            wait_for=(Address("10.0.0.2", 50052),),
        )
    ]
    assert device_order(two_node(p, 0, 50052)) == (
        *["10.0.0.2:50052"] * 4,
        "CUDA0",
        "CUDA1",
        "CUDA2",
        "CUDA3",
    )


def test_llamacpp_tensor_parallel_across_nodes_splits_layers_not_rows() -> None:
    # TP 8 over two nodes of four: row split is one node's CUDA feature, RPC devices take layers.
    p = profile("llamacpp", tp=8, nodes=2, gpus_per_node=4)
    [cmd] = LC.commands(two_node(p, 0, 50052), BASE)
    assert cmd.args[len(LC_ARGS) :] == ("-sm", "layer", "-ts", "1,1,1,1,1,1,1,1", "--rpc", "10.0.0.2:50052")


def test_llamacpp_cpu_leader_gives_its_workers_one_device_each() -> None:
    p = profile("llamacpp", gpu_class="", pp=3, nodes=3, gpus_per_node=1)
    members = tuple(Member(node=f"cpu-0{i}", addr=f"10.0.0.{i}", port=50052) for i in (1, 2, 3))
    spec = ShardSpec(
        replica="r0", shard="r0-0", node="cpu-01", profile=p, host="0.0.0.0", port=8000, members=members
    )
    [cmd] = LC.commands(spec, BASE)
    assert device_order(spec) == ("10.0.0.2:50052", "10.0.0.3:50052")
    assert cmd.args[len(LC_ARGS) :] == (
        "-sm",
        "layer",
        "-ts",
        "1,1",
        "--rpc",
        "10.0.0.2:50052,10.0.0.3:50052",
    )


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", ""])
def test_llamacpp_refuses_an_rpc_server_on_every_interface(addr: str) -> None:
    p = profile("llamacpp", tp=2, nodes=2, gpus_per_node=1)
    spec = msgspec.structs.replace(
        two_node(p, 1, 50052),
        gpus=(0,),
        members=(
            Member(node="gpu-01", addr="10.0.0.1", port=50052),
            Member(node="gpu-02", addr=addr, port=50052),
        ),
    )
    assert LC.validate(p, H100, spec) == [
        f"shard r0-1: rank 1 (gpu-02) has address {addr or '(none)'!r}; llama.cpp's RPC server is "
        "unauthenticated and listens only where the leader reaches it, never on every interface: "
        "set that node's mgmt_addr to its own address on the fabric's network"
    ]
    # The same shard with the worker on its own address is fine.
    assert LC.validate(p, H100, msgspec.structs.replace(spec, members=two_node(p, 1).members)) == []


def test_llamacpp_finds_whichever_rpc_server_the_install_has(tmp_path: object) -> None:
    from pathlib import Path

    d = Path(str(tmp_path))
    (d / "rpc-server").touch()
    registry = Registry()
    registry.add(LlamaCpp())
    assert registry.use_installed("llamacpp", str(d)) is True
    p = profile("llamacpp", tp=2, nodes=2, gpus_per_node=1)
    [cmd] = registry.get("llamacpp").commands(two_node(p, 1, 50052), {})
    assert cmd.path == f"{d}/rpc-server"


def test_llamacpp_runs_on_a_cpu_node_when_the_profile_names_no_gpu_class() -> None:
    p = profile("llamacpp", gpu_class="")
    assert LlamaCpp().validate(p, []) == []
    [cmd] = LlamaCpp().commands(single(p, ()), {"PATH": "/usr/bin"})
    assert cmd.env == (("CUDA_VISIBLE_DEVICES", ""), ("NCCL_IB_DISABLE", "1"), ("PATH", "/usr/bin"))


# --- sim --------------------------------------------------------------------


def test_sim_one_node_and_two_nodes() -> None:
    p = profile("sim", args=["--load-time", "0.5"], gpu_class="")
    [cmd] = Sim().commands(single(p, ()), BASE)
    assert cmd == Command(
        name="sim",
        path=sys.executable,
        args=(
            "-m",
            "llmgw_core.sim",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--model",
            "llama-70b",
            "--load-time",
            "0.5",
        ),
        env=env(CUDA_VISIBLE_DEVICES="", NCCL_IB_DISABLE="1"),
    )
    p2 = profile("sim", tp=8, nodes=2, gpus_per_node=4)
    [leader] = Sim().commands(two_node(p2, 0, 7000), BASE)
    [worker] = Sim().commands(two_node(p2, 1, 7000), BASE)
    assert leader.args[-4:] == ("--world", "2", "--dist-port", "7000")
    assert worker.args == (
        "-m",
        "llmgw_core.sim",
        "--rank",
        "1",
        "--world",
        "2",
        "--leader",
        "10.0.0.1:7000",
    )
    assert worker.wait_for == (Address("10.0.0.1", 7000),)


def test_sim_one_node_tp4_on_gpus_4_to_7() -> None:
    [cmd] = Sim().commands(single(profile("sim", tp=4), (4, 5, 6, 7)), BASE)
    assert cmd.env == env(CUDA_VISIBLE_DEVICES="4,5,6,7", NCCL_IB_DISABLE="1")


# --- environment rules --------------------------------------------------------


def test_multi_node_without_hcas_disables_ib() -> None:
    p = profile("sglang", tp=8, nodes=2, gpus_per_node=4)
    s = msgspec.structs.replace(two_node(p, 0), hcas=(), mgmt_iface="")
    [cmd] = SG.commands(s, BASE)
    assert cmd.env == env(CUDA_VISIBLE_DEVICES="0,1,2,3", NCCL_IB_DISABLE="1")


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "sim"])
def test_the_management_interface_pins_bootstrap_on_one_node_too(engine: str) -> None:
    # Regression: the interface never reached a shard, so NCCL and Gloo bootstrapped
    # over whatever they found first (docker0, IPoIB) and the first all-reduce hung.
    s = msgspec.structs.replace(single(profile(engine, tp=2), (0, 1)), mgmt_iface="ens5")
    [cmd] = default_registry().get(engine).commands(s, BASE)
    assert cmd.env == env(
        CUDA_VISIBLE_DEVICES="0,1",
        NCCL_IB_DISABLE="1",
        NCCL_SOCKET_IFNAME="ens5",
        GLOO_SOCKET_IFNAME="ens5",
    )


def test_each_rank_pins_bootstrap_to_its_own_nodes_interface() -> None:
    p = profile("sglang", tp=4, pp=2, nodes=2, gpus_per_node=4)
    worker = msgspec.structs.replace(two_node(p, 1, 5000), mgmt_iface="bond0")
    [cmd] = SG.commands(worker, BASE)
    assert cmd.env == env(**{**MULTI_ENV, "NCCL_SOCKET_IFNAME": "bond0", "GLOO_SOCKET_IFNAME": "bond0"})


@pytest.mark.parametrize("engine", ["llamacpp", "sim"])
def test_a_cpu_shard_is_hidden_from_every_gpu(engine: str) -> None:
    # Regression: with no GPUs in the shard CUDA_VISIBLE_DEVICES was left unset, so
    # a CUDA build (llama.cpp -ngl 999) on a GPU node took GPUs placement counted free.
    p = profile(engine, gpu_class="")
    [cmd] = default_registry().get(engine).commands(single(p, ()), BASE)
    assert cmd.env == env(CUDA_VISIBLE_DEVICES="", NCCL_IB_DISABLE="1")


def test_an_inherited_ib_disable_does_not_survive_a_shard_with_hcas() -> None:
    p = profile("sglang", tp=4, pp=2, nodes=2, gpus_per_node=4)
    [cmd] = SG.commands(two_node(p, 0, 5000), {**BASE, "NCCL_IB_DISABLE": "1", "NCCL_IB_HCA": "mlx5_9"})
    assert cmd.env == env(**MULTI_ENV)


def test_one_node_disables_ib_even_when_the_agent_enabled_it() -> None:
    [cmd] = SG.commands(single(profile("sglang"), (3,)), {**BASE, "NCCL_IB_DISABLE": "0"})
    assert cmd.env == env(CUDA_VISIBLE_DEVICES="3", NCCL_IB_DISABLE="1")


def test_the_profiles_env_still_wins_over_every_generated_variable() -> None:
    p = profile(
        "sglang",
        gpu_class="",
        env={"CUDA_VISIBLE_DEVICES": "0", "NCCL_IB_DISABLE": "0", "NCCL_SOCKET_IFNAME": "=eth1"},
    )
    s = msgspec.structs.replace(single(p, ()), mgmt_iface="eth0")
    [cmd] = SG.commands(s, BASE)
    assert cmd.env == env(
        CUDA_VISIBLE_DEVICES="0",
        NCCL_IB_DISABLE="0",
        NCCL_SOCKET_IFNAME="=eth1",
        GLOO_SOCKET_IFNAME="eth0",
    )


# --- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "gpus", "expected"),
    [
        (
            {"model_path": ""},
            H100,
            [
                "profile llama-70b: model_path is empty; set it to the weights' path, or set model to "
                "hf://<org>/<repo>[/<file>], https://… (with model_sha256) or file:///path"
            ],
        ),
        ({"tp": 0}, H100, ["profile llama-70b: tp must be positive, got 0"]),
        (
            {"tp": 8, "nodes": 2},
            H100,
            ["profile llama-70b: gpus_per_node is required when nodes > 1 (nodes is 2)"],
        ),
        (
            {"tp": 8, "pp": 2, "nodes": 2, "gpus_per_node": 4},
            H100,
            ["profile llama-70b: 2 nodes x 4 GPUs does not match TP 8 x PP 2"],
        ),
        (
            {"tp": 8, "nodes": 2, "gpus_per_node": 0},
            H100,
            ["profile llama-70b: gpus_per_node must be positive when nodes > 1, got 0 (nodes is 2)"],
        ),
        (
            {"tp": 8, "nodes": 2, "gpus_per_node": -4},
            H100,
            ["profile llama-70b: gpus_per_node must be positive when nodes > 1, got -4 (nodes is 2)"],
        ),
        # One node: gpus_per_node 0 means "unset", which is TP x PP.
        (
            {"tp": 2, "pp": 2, "gpus_per_node": 0},
            H100[:2],
            ["profile llama-70b: needs 4 GPUs per node, node has 2"],
        ),
        ({"tp": 2, "pp": 2}, H100[:4], []),
        ({"tp": 4}, H100[:2], ["profile llama-70b: needs 4 GPUs per node, node has 2"]),
        (
            {"tp": 2},
            [H100[0], A100[1]],
            [
                "profile llama-70b: a tensor-parallel group may not mix GPU types "
                "(NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3)"
            ],
        ),
        (
            {"tp": 2, "args": ["--quantization", "fp8"]},
            [H100[0], A100[1]],
            [
                "profile llama-70b: a tensor-parallel group may not mix GPU types "
                "(NVIDIA A100-SXM4-80GB, NVIDIA H100 80GB HBM3)",
                "profile llama-70b: fp8 needs compute capability 8.9, GPU 1 (NVIDIA A100-SXM4-80GB) has 8.0",
            ],
        ),
        (
            {"args": ["-q", "awq"]},
            [GPUInfo(index=0, name="Tesla T4", compute_capability="7.5")],
            [],
        ),
        (
            {"args": ["--quantization=awq"]},
            [GPUInfo(index=0, name="Tesla V100", compute_capability="7.0")],
            ["profile llama-70b: awq needs compute capability 7.5, GPU 0 (Tesla V100) has 7.0"],
        ),
        (
            {"args": ["--quantization", "fp8"]},
            [GPUInfo(index=0, name="vGPU", compute_capability="[N/A]")],
            [],
        ),
        # Repeated: the engine's argparse keeps the last value, so that is the one checked.
        (
            {"args": ["--quantization", "awq", "--max-model-len", "4096", "-q", "fp8"]},
            [A100[0]],
            ["profile llama-70b: fp8 needs compute capability 8.9, GPU 0 (NVIDIA A100-SXM4-80GB) has 8.0"],
        ),
        ({"args": ["--quantization=fp8", "--quantization", "awq"]}, [A100[0]], []),
        (
            {"model_path": "", "tp": 0, "pp": 0},
            H100,
            [
                "profile llama-70b: model_path is empty; set it to the weights' path, or set model to "
                "hf://<org>/<repo>[/<file>], https://… (with model_sha256) or file:///path",
                "profile llama-70b: tp must be positive, got 0",
                "profile llama-70b: pp must be positive, got 0",
            ],
        ),
    ],
    ids=[
        "empty-model",
        "tp-zero",
        "gpus-per-node",
        "nodes-mismatch",
        "gpus-per-node-zero",
        "gpus-per-node-negative",
        "gpus-per-node-zero-on-one-node-is-tp-x-pp",
        "tp-x-pp-on-one-node",
        "too-few-gpus",
        "mixed",
        "fp8-and-mixed",
        "awq-ok",
        "awq-too-old",
        "unparseable-capability",
        "quantization-repeated-last-wins",
        "quantization-repeated-last-fits",
        "every-problem",
    ],
)
@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "sim"])
def test_validation_messages(
    engine: str, fields: dict[str, object], gpus: list[GPUInfo], expected: list[str]
) -> None:
    assert default_registry().get(engine).validate(profile(engine, **fields), gpus) == expected


def test_validation_of_a_multi_node_shard_without_a_fabric() -> None:
    p = profile("vllm", tp=8, nodes=2, gpus_per_node=4)
    s = msgspec.structs.replace(two_node(p, 0), fabric="")
    assert VLLM().validate(p, H100, s) == [
        "profile llama-70b: a 2-node profile needs a fabric; shard r0-0 was placed without one"
    ]


def test_validation_of_gpus_the_node_does_not_have() -> None:
    p = profile("vllm", tp=2)
    s = single(p, (6, 9))
    assert VLLM().validate(p, H100, s) == [
        "shard r0-0: GPU 9 not on this node (this node's GPUs: 0, 1, 2, 3, 4, 5, 6, 7)"
    ]


@pytest.mark.parametrize(
    ("args", "method"),
    [
        (["--quantization", "fp8"], "fp8"),
        (["--quantization=awq"], "awq"),
        (["-q", "gptq"], "gptq"),
        (["--max-model-len", "4096"], None),
        (["-q"], None),
        (["--quantization", "awq", "--quantization=fp8"], "fp8"),
    ],
)
def test_quantization_is_read_from_every_spelling(args: list[str], method: str | None) -> None:
    assert quantization_of(args) == method


def test_registry() -> None:
    r = Registry()
    r.add(Sim())
    r.add(VLLM())
    replacement = VLLM(VLLMConfig(bin_dir="/x"))
    r.add(replacement)
    assert r.names() == ["sim", "vllm"]
    assert r.get("vllm") is replacement
    with pytest.raises(UnknownEngineError) as err:
        r.get("tgi")
    assert str(err.value) == "unknown engine 'tgi'; known engines: sim, vllm"
    assert r.use_installed("sim", "/opt") is False
    # vLLM runs the environment the installer built from its lock.
    assert r.use_installed("vllm", "/opt/bin") is True
    assert replacement.config.bin_dir == "/opt/bin"


def test_fingerprint_changes_with_args_and_spec_process_view_ignores_bookkeeping() -> None:
    p = profile("vllm")
    assert p.fingerprint() == profile("vllm").fingerprint()
    assert p.fingerprint() != profile("vllm", args=["--enforce-eager"]).fingerprint()
    s = single(p, (0,))
    moved = msgspec.structs.replace(s, pool="east", fabric="ib-b", profile_fp="x")
    assert s.process_view() == moved.process_view()
    assert s.process_view() != msgspec.structs.replace(s, port=9000).process_view()


def test_a_node_id_with_a_dot_is_refused_where_it_enters() -> None:
    with pytest.raises(msgspec.ValidationError) as err:
        msgspec.convert(
            {
                "replica": "r",
                "shard": "s",
                "node": "gpu-01.dc1.example.com",
                "profile": msgspec.to_builtins(profile("sim")),
            },
            ShardSpec,
        )
    assert str(err.value) == "Expected `str` matching regex '^[A-Za-z0-9_-]+$' - at `$.node`"
