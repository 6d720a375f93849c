"""Where an engine comes from (`source:`), and what a release offers that a node passes over."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import GPUInfo
from llmgw_core.events import EngineSpec, NodeFacts
from llmgw_core.probe import CommandResult, Probe
from llmgw_installer.builds import Asset, choose_build
from llmgw_installer.errors import NoBuildError, SourceError
from llmgw_installer.release import parse_source
from tests.installer_support import (
    ASSET,
    TAG,
    agent,
    build_server,
    converge,
    engine,
    pack,
    release_server,
    want,
)
from tests.test_probe_and_builds import write_root

pytestmark = pytest.mark.anyio

GPU_NODE = NodeFacts(
    node="n",
    arch="x86_64",
    nvidia_driver="570.86.15",
    cuda_driver="12.8",
    gpus=(GPUInfo(index=0, name="NVIDIA H100 80GB HBM3"),),
)
CPU_NODE = NodeFacts(node="n", arch="x86_64")


def refusal(names: list[str], facts: NodeFacts) -> str:
    with pytest.raises(NoBuildError) as err:
        choose_build([Asset(name=n) for n in names], TAG, facts)
    return str(err.value)


def test_a_cpu_node_lists_the_cuda_runtime_and_the_vulkan_build_with_their_reasons() -> None:
    assert refusal(
        [
            f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz",
            "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz",
            f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz",
            "cudart-llama-bin-win-cuda-12.4-x64.zip",
        ],
        CPU_NODE,
    ) == (
        f"no llama.cpp {TAG} build fits this node (x64, no NVIDIA driver): "
        "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz: CUDA runtime, used only with a CUDA build; "
        "node has no NVIDIA driver loaded; "
        "cudart-llama-bin-win-cuda-12.4-x64.zip: not a llama.cpp Linux build; "
        f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz: CUDA build, node has no NVIDIA driver loaded; "
        f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz: Vulkan build; llmgw installs the CPU build, "
        "or the CUDA build where an NVIDIA driver is loaded"
    )


def test_a_gpu_node_says_why_each_cuda_runtime_went_unused() -> None:
    assert refusal(
        [
            f"llama-{TAG}-bin-ubuntu-cuda-13.0-x64.tar.gz",
            "cudart-llama-bin-ubuntu-cuda-13.0-x64.tar.gz",
            "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz",
            "cudart-llama-bin-ubuntu-cuda-12.4-arm64.tar.gz",
            f"llama-{TAG}-bin-ubuntu-rocm-6.4-x64.tar.gz",
        ],
        GPU_NODE,
    ) == (
        f"no llama.cpp {TAG} build fits this node (x64, NVIDIA driver 570.86.15): "
        "cudart-llama-bin-ubuntu-cuda-12.4-arm64.tar.gz: for arm64, node is x64; "
        f"cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz: CUDA 12.4 runtime, and the release has no "
        f"CUDA 12.4 build of {TAG} for x64; "
        "cudart-llama-bin-ubuntu-cuda-13.0-x64.tar.gz: CUDA 13.0 runtime, driver supports 12.8; "
        f"llama-{TAG}-bin-ubuntu-cuda-13.0-x64.tar.gz: needs CUDA 13.0, driver supports 12.8; "
        f"llama-{TAG}-bin-ubuntu-rocm-6.4-x64.tar.gz: ROCm build; llmgw installs the CPU build, "
        "or the CUDA build where an NVIDIA driver is loaded"
    )


def test_an_asset_name_that_is_a_path_is_never_a_build_or_a_runtime() -> None:
    # Asset names become file names in the staging directory.
    message = refusal(
        [f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz", "cudart-../../../x-cuda-12.4-x64.tar.gz"], GPU_NODE
    )
    assert "cudart-../../../x-cuda-12.4-x64.tar.gz: not a llama.cpp Linux build" in message
    assert f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz: no cudart archive for CUDA 12.4" in message


async def test_the_rejection_list_reaches_the_node_status(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    probe = Probe(
        "node-a",
        root=write_root(tmp_path / "root"),
        run=lambda argv: CommandResult(127, "", "nvidia-smi: not found"),
    )
    async with release_server() as rel:
        rel.add(f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz", b"never downloaded")
        rel.add("cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz", b"never downloaded")
        await want(bus, EngineSpec(name="llamacpp", version=TAG))
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus, probe=probe)
    assert engine(status)["detail"] == (
        f"no llama.cpp {TAG} build fits this node (x64, no NVIDIA driver): "
        "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz: CUDA runtime, used only with a CUDA build; "
        "node has no NVIDIA driver loaded; "
        f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz: Vulkan build; llmgw installs the CPU build, "
        "or the CUDA build where an NVIDIA driver is loaded"
    )
    assert [p for p in rel.requests if p.startswith("/download/")] == []


# --- source: ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "parsed"),
    [
        ("", ("github", "ggml-org/llama.cpp")),
        ("github:someone/llama.cpp", ("github", "someone/llama.cpp")),
        ("mirror:https://mirror.example/llama", ("mirror", "https://mirror.example/llama")),
        ("mirror:/srv/llama", ("mirror", "/srv/llama")),
        ("configured", ("configured", "")),
    ],
)
def test_sources(source: str, parsed: tuple[str, str]) -> None:
    assert parse_source(source) == parsed


@pytest.mark.parametrize(
    "source", ["gitlab:someone/llama.cpp", "github:no-slash", "github:a/b/../c", "github:../..", "mirror:"]
)
def test_an_unknown_source_is_refused_with_the_forms_it_may_take(source: str) -> None:
    with pytest.raises(SourceError) as err:
        parse_source(source)
    assert str(err.value) == (
        f"source {source!r} is not one llmgw knows; use github:<owner>/<repo>, "
        "mirror:<url or directory>, or configured (the path named under engines: in agent.yaml)"
    )


async def test_source_configured_takes_the_path_agent_yaml_names_and_downloads_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    llama_dir = tmp_path / "llama"
    build_server(llama_dir, "semver")
    async with release_server() as rel:
        rel.add_file(pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")}))
        await want(bus, EngineSpec(name="llamacpp", version=TAG, source="configured"))
        named = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, engines={"llamacpp": {"path": str(llama_dir)}}), bus
        )
        unnamed = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, state_dir=str(tmp_path / "s2")), bus
        )
    assert engine(named) == {
        "state": "configured",
        "version": TAG,
        "engine_version": "0.5.0-dev (build 42, commit deadbee)",
        "path": str(llama_dir),
        "detail": "",
    }
    assert engine(unnamed) == {
        "state": "failed",
        "version": TAG,
        "engine_version": "",
        "path": "",
        "detail": "llamacpp is to be configured on this node (source: configured), but agent.yaml names "
        "no path for it; add engines: {llamacpp: {path: ...}} to agent.yaml",
    }
    assert unnamed.install == f"install failed: {engine(unnamed)['detail']}"
    assert rel.requests == [], "a configured engine is never looked up or downloaded"


async def test_a_configured_engine_is_checked_like_the_others(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    llama_dir = tmp_path / "llama"
    build_server(llama_dir, "exit1")
    await want(bus, EngineSpec(name="llamacpp", version=TAG, source="configured"))
    status = await converge(
        agent(tmp_path, nats_url, prefix, "", engines={"llamacpp": {"path": str(llama_dir)}}), bus
    )
    assert engine(status) == {
        "state": "broken",
        "version": "",
        "engine_version": "",
        "path": str(llama_dir),
        "detail": "llama-server --version exited with code 1: error: unsupported CPU",
    }


async def test_a_fork_on_github_is_a_source_too(bus: Bus, nats_url: str, prefix: str, tmp_path: Path) -> None:
    async with release_server() as rel:
        rel.repo = "someone/llama.cpp"
        rel.add_file(pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")}))
        await want(bus, EngineSpec(name="llamacpp", version=TAG, source="github:someone/llama.cpp"))
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "installed"
    assert rel.requests[0] == f"/repos/someone/llama.cpp/releases/tags/{TAG}"


async def test_an_unknown_source_fails_that_install_in_the_nodes_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    await want(bus, EngineSpec(name="llamacpp", version=TAG, source="gitlab:someone/llama.cpp"))
    status = await converge(agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9"), bus)
    assert engine(status)["detail"].startswith("source 'gitlab:someone/llama.cpp' is not one llmgw knows; ")
