"""llama.cpp's CUDA builds as its release workflow ships them, on nodes whose drivers do and
do not run them; and rechecks, which never take an installed engine away."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import Deployment, EngineInventory, EngineSpec, NodeFacts, NodeStatus, decoder
from llmgw_core.installed import installed
from llmgw_core.probe import CommandResult, Probe
from llmgw_installer.builds import Asset, NoBuildError, choose_build
from llmgw_installer.checks import missing_libraries
from llmgw_installer.errors import InstallError
from llmgw_installer.pipeline import merge_runtime
from llmgw_placement.decide import NodeView, Placement, Refusal, decide
from tests.installer_support import (
    B11434,
    B11434_ASSETS,
    agent,
    converge,
    engine,
    install_events,
    installer,
    release_assets,
    release_server,
    want,
)
from tests.release_server import ReleaseServer
from tests.test_probe_and_builds import FIXTURES, write_root
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

LLAMA = EngineSpec(name="llamacpp", version=B11434)
H100 = (GPUInfo(index=0, name="NVIDIA H100 80GB HBM3", compute_capability="9.0", memory_mb=81559),)
OLD_DRIVER = "driver supports CUDA 12.2; b11434 has CUDA builds 12.8, 13.4 only"
OLD_DRIVER_WORDS = f"{OLD_DRIVER} (a driver for CUDA 12.8 or newer runs the CUDA build)"


def gpu_node(cuda: str, arch: str = "x86_64") -> NodeFacts:
    return NodeFacts(node="n", arch=arch, nvidia_driver="570.86.15", cuda_driver=cuda, gpus=H100)


# --- the release as it is ------------------------------------------------------------------


def test_every_ubuntu_asset_of_b11434_is_understood() -> None:
    """Fails naming the asset when llama.cpp changes how it names its Linux builds."""
    with pytest.raises(NoBuildError) as err:
        choose_build([Asset(name=n) for n in B11434_ASSETS], B11434, NodeFacts(node="n", arch="riscv64"))
    listing = str(err.value).split(": ", 1)[1]
    reasons = dict(
        part.split(": ", 1) for part in listing.split("; ") if part.startswith(("llama-", "cudart-"))
    )
    not_understood = [
        name for name, why in reasons.items() if "-ubuntu-" in name and why == "not a llama.cpp Linux build"
    ]
    assert not_understood == [], f"release layout changed: installer cannot read {not_understood}"
    assert {n for n in B11434_ASSETS if "-ubuntu-" in n} <= set(reasons), "an Ubuntu asset went unjudged"


@pytest.mark.parametrize(
    ("facts", "main", "runtime", "cpu_only"),
    [
        (
            gpu_node("12.8"),
            "llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
            "cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
            "",
        ),
        (
            gpu_node("13.4"),
            "llama-b11434-bin-ubuntu-cuda-13.4-x64.tar.gz",
            "cudart-llama-b11434-bin-ubuntu-cuda-13.4-x64.tar.gz",
            "",
        ),
        (
            gpu_node("13.6"),
            "llama-b11434-bin-ubuntu-cuda-13.4-x64.tar.gz",
            "cudart-llama-b11434-bin-ubuntu-cuda-13.4-x64.tar.gz",
            "",
        ),
        (
            gpu_node("13.4", "aarch64"),
            "llama-b11434-bin-ubuntu-cuda-13.4-arm64.tar.gz",
            "cudart-llama-b11434-bin-ubuntu-cuda-13.4-arm64.tar.gz",
            "",
        ),
        (gpu_node("12.2"), "llama-b11434-bin-ubuntu-x64.tar.gz", None, OLD_DRIVER_WORDS),
        (
            gpu_node("12.8", "aarch64"),
            "llama-b11434-bin-ubuntu-arm64.tar.gz",
            None,
            "driver supports CUDA 12.8; b11434 has CUDA builds 13.4 only "
            "(a driver for CUDA 13.4 or newer runs the CUDA build)",
        ),
        (NodeFacts(node="n", arch="x86_64"), "llama-b11434-bin-ubuntu-x64.tar.gz", None, ""),
    ],
    ids=["cuda-12.8", "cuda-13.4", "cuda-13.6", "arm64-13.4", "cuda-12.2", "arm64-12.8", "no-gpu"],
)
def test_the_build_b11434_gives_each_node(
    facts: NodeFacts, main: str, runtime: str | None, cpu_only: str
) -> None:
    build = choose_build([Asset(name=n) for n in B11434_ASSETS], B11434, facts)
    assert (build.main.name, build.runtime.name if build.runtime else None, build.cpu_only) == (
        main,
        runtime,
        cpu_only,
    )


def test_a_runtime_of_another_tag_is_never_paired_with_the_build() -> None:
    with pytest.raises(NoBuildError) as err:
        choose_build(
            [
                Asset(name="llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz"),
                Asset(name="cudart-llama-b11433-bin-ubuntu-cuda-12.8-x64.tar.gz"),
            ],
            B11434,
            gpu_node("12.8"),
        )
    assert str(err.value) == (
        "no llama.cpp b11434 build fits this node (x64, NVIDIA driver 570.86.15): "
        "cudart-llama-b11433-bin-ubuntu-cuda-12.8-x64.tar.gz: tag b11433, want b11434; "
        "llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz: no cudart archive for CUDA 12.8 in the release"
    )


# --- installing it ---------------------------------------------------------------------------


def gpu_probe(tmp_path: Path, cuda: str) -> Probe:
    """An 8x H100 node whose nvidia-smi says its driver supports CUDA `cuda`."""
    banner = (
        (FIXTURES / "nvidia-smi-banner.txt")
        .read_text()
        .replace("CUDA Version: 12.8", f"CUDA Version: {cuda}")
    )
    csv = (FIXTURES / "nvidia-smi-8xh100.csv").read_text()

    def run(argv: list[str]) -> CommandResult:
        if argv[0] != "nvidia-smi":
            return CommandResult(127, "", f"{argv[0]}: not found")
        if argv[1:2] == ["--query-gpu=index,name,uuid,compute_cap,memory.total"]:
            return CommandResult(0, csv)
        return CommandResult(0, banner)

    root = tmp_path / f"root-{cuda}"
    return Probe("node-a", root=root if root.exists() else write_root(root), run=run)


def serve_b11434(rel: ReleaseServer, built: dict[str, Path]) -> None:
    """Every asset b11434 has; those the tests built are real, the rest must never be fetched."""
    rel.tag = B11434
    for name in B11434_ASSETS:
        rel.add(name, built[name].read_bytes() if name in built else b"never downloaded")


def downloads(rel: ReleaseServer) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in rel.requests if p.startswith("/download/"))


def ldd_lines(binary: Path) -> dict[str, str]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    return {
        line.split("=>")[0].strip(): line.split("=>")[1].strip().split(" (")[0]
        for line in out.splitlines()
        if "=>" in line
    }


@pytest.mark.parametrize("runtime_links", [False, True], ids=["as-b11434-packs-it", "with-soname-chains"])
async def test_a_cuda_12_8_node_installs_the_12_8_build_with_its_runtime_beside_llama_server(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, runtime_links: bool
) -> None:
    built = release_assets(tmp_path / "rel", B11434, cuda=("12.8", "13.4"), runtime_links=runtime_links)
    # The build alone does not run: the test would pass on nothing if it did.
    assert ldd_lines(tmp_path / "rel" / "cuda-12.8" / "llama-server")["libcudart.so.12"] == "not found"
    async with release_server() as rel, install_events(bus) as events:
        serve_b11434(rel, built)
        await want(bus, LLAMA)
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api), bus, probe=gpu_probe(tmp_path, "12.8")
        )
        await eventually(lambda: events and events[-1].outcome == "done")
    assert downloads(rel) == [
        "cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
        "llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
    ]
    bin_dir = (tmp_path / "state" / "engines" / "llamacpp" / B11434 / "llama-b11434").resolve()
    assert engine(status) == {
        "state": "installed",
        "version": B11434,
        "engine_version": "0.6.0-dev (build 11434, commit 6a5e2f1)",
        "path": str(bin_dir),
        "detail": "",
    }
    assert status.warnings == ()
    for lib in ("libcudart.so.12", "libcublas.so.12", "libcublasLt.so.12"):
        assert ldd_lines(bin_dir / "llama-server").get(
            lib, ldd_lines(bin_dir / "libggml-cuda.so")[lib]
        ) == str(bin_dir / lib)
    for elf in ("llama-server", "libggml-cuda.so", "libggml-base.so.0.26.0"):
        assert missing_libraries(bin_dir / elf) == [], elf
    if runtime_links:
        assert os.readlink(bin_dir / "libcudart.so") == "libcudart.so.12"
        assert os.readlink(bin_dir / "libcudart.so.12") == "libcudart.so.12.8.90"
    else:
        assert not (bin_dir / "libcudart.so.12").is_symlink()
    assert os.readlink(bin_dir / "libggml-base.so") == "libggml-base.so.0"
    assert not list(bin_dir.parent.glob("cudart-*")), "the runtime's own directory is not left beside"
    # It runs what it installed: the CUDA runtime beside it is the one it loads.
    ran = subprocess.run(
        [str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, check=True
    )
    assert "CUDA runtime 12080" in ran.stderr
    assert (
        "installing: putting cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz's libraries "
        "beside llama-server" in [e.message for e in events]
    )


async def test_a_runtime_archive_that_holds_no_libraries_is_refused(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    import tarfile

    built = release_assets(tmp_path / "rel", B11434, cuda=("12.8",))
    empty = tmp_path / "cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz"
    readme = tmp_path / "README"
    readme.write_text("nothing here\n")
    with tarfile.open(empty, "w:gz") as tf:
        tf.add(readme, arcname="cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64/README")
    built[empty.name] = empty
    async with release_server() as rel:
        serve_b11434(rel, built)
        await want(bus, LLAMA)
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api), bus, probe=gpu_probe(tmp_path, "12.8")
        )
    assert engine(status)["state"] == "failed"
    assert engine(status)["detail"] == (
        "cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz holds no shared libraries (.so); "
        "it is not a CUDA runtime archive"
    )
    assert installed(tmp_path / "state") == {}


def view_of(status: NodeStatus) -> NodeView:
    """The node as placement sees it (the fields its controller takes from a NodeStatus)."""
    return NodeView(
        node=status.node,
        gpus=status.facts.gpus,
        engines={e.name: e for e in status.engines},
        install=status.install,
        avx2=status.facts.has_avx2,
        pools=frozenset({"default"}),
    )


def llama_profile(**kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "qwen-7b",
        "engine": "llamacpp",
        "model_path": "/models/qwen-7b.gguf",
        "gpu_class": "H100-80G",
        "tp": 1,
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


async def test_a_node_whose_driver_is_older_than_every_cuda_build_says_so_and_takes_cpu_profiles_only(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    built = release_assets(tmp_path / "rel", B11434, cuda=("12.8", "13.4"))
    config = agent(tmp_path, nats_url, prefix, "")
    async with release_server() as rel, install_events(bus) as events:
        serve_b11434(rel, built)
        config = msgspec.structs.replace(config, github_api=rel.api)
        await want(bus, LLAMA)
        status = await converge(config, bus, probe=gpu_probe(tmp_path, "12.2"))
        await eventually(lambda: events and events[-1].outcome == "done")
        assert downloads(rel) == ["llama-b11434-bin-ubuntu-x64.tar.gz"]
        bin_dir = (tmp_path / "state" / "engines" / "llamacpp" / B11434 / "llama-b11434").resolve()
        assert engine(status) == {
            "state": "installed",
            "version": B11434,
            "engine_version": "0.6.0-dev (build 11434, commit 6a5e2f1)",
            "path": str(bin_dir),
            "detail": "",
        }
        [llama] = [e for e in status.engines if e.name == "llamacpp"]
        assert llama.cpu_only == OLD_DRIVER_WORDS
        assert status.warnings == (f"llamacpp b11434: CPU build only: {OLD_DRIVER_WORDS}",)
        assert events[-1].message == (
            f"installed llamacpp b11434 in {bin_dir} "
            "(llama-server says 0.6.0-dev (build 11434, commit 6a5e2f1)); "
            f"CPU build only: {OLD_DRIVER_WORDS}"
        )
        stored = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
        assert stored is not None
        assert stored[0].engines == status.engines

        # What the operator reads: the tag engines: names, what llama-server says, the CPU build.
        nodes = await ctl(nats_url, prefix, "get", "nodes")
        assert "llamacpp b11434 (installed; 0.6.0-dev; CPU build only)" in nodes, nodes
        assert f"llamacpp b11434: CPU build only: {OLD_DRIVER_WORDS}" in nodes, nodes
        described = await ctl(nats_url, prefix, "describe", "node", "node-a")
        [row] = [line for line in described.splitlines() if line.strip().startswith("llamacpp ")]
        assert re.split(r"\s{2,}", row.strip()) == [
            "llamacpp",
            "b11434",
            "0.6.0-dev (build 11434, commit 6a5e2f1)",
            "installed",
            f"CPU build only: {OLD_DRIVER_WORDS}",
        ], described

        # Placement: GPU profiles of llama.cpp refused in the node's words, CPU ones placed.
        dep = Deployment(name="chat", profile="qwen-7b", replicas=1, pool="default")
        refused = decide(dep, llama_profile(), [view_of(status)])
        assert isinstance(refused, Refusal)
        assert refused.reasons == (("node-a", f"engine llamacpp is the CPU build here: {OLD_DRIVER_WORDS}"),)
        placed = decide(dep, llama_profile(gpu_class=""), [view_of(status)])
        assert isinstance(placed, Placement), placed

        # The driver is upgraded: the build is chosen again, and the words go with the CPU build.
        status = await converge(config, bus, probe=gpu_probe(tmp_path, "12.8"))
        assert downloads(rel) == [
            "cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
            "llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz",
            "llama-b11434-bin-ubuntu-x64.tar.gz",
        ]
    [llama] = [e for e in status.engines if e.name == "llamacpp"]
    assert (llama.state, llama.cpu_only) == ("installed", "")
    assert status.warnings == ()
    assert installed(config.state_dir)["llamacpp"].asset == "llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz"
    assert isinstance(decide(dep, llama_profile(), [view_of(status)]), Placement)
    assert any(
        e.message
        == "installing: choosing the llamacpp b11434 build again: the driver supports CUDA 12.8 now "
        "(CUDA 12.2 when the CPU build was chosen)"
        for e in events
    )


CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]


async def ctl(nats_url: str, prefix: str, *args: str) -> str:
    """`llmgw ctl`, run as the operator runs it."""
    done = await anyio.run_process(
        [*CTL, "--prefix", prefix, *args],
        env={**os.environ, "LLMGW_NATS_URL": nats_url},
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


# --- rechecks ----------------------------------------------------------------------------------


def slow_ldd(seen: list[str], delay_s: float) -> Callable[[Path, float], list[str]]:
    """The real ldd, taking `delay_s` longer: a recheck long enough to be seen from outside."""

    def ldd(binary: Path, timeout: float) -> list[str]:
        seen.append(binary.name)
        import time

        time.sleep(delay_s)
        return missing_libraries(binary, timeout)

    return ldd


async def test_rechecks_never_report_an_installed_engine_as_anything_else(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    built = release_assets(tmp_path / "rel", B11434, cuda=("12.8",))
    config = agent(tmp_path, nats_url, prefix, "", recheck_interval_s=0.2)
    reported: list[tuple[str, str]] = []

    async def on_inventory(msg: Msg) -> None:
        inv = decoder(EngineInventory).decode(msg.data)
        reported.extend(("inventory", e.state) for e in inv.engines if e.name == "llamacpp")

    async def watch_status() -> None:
        async for change in bus.watch(bus.names.nodes_bucket, NodeStatus, "node-a"):
            if change.value is not None:
                reported.extend(("status", e.state) for e in change.value.engines if e.name == "llamacpp")

    async with release_server() as rel:
        serve_b11434(rel, built)
        config = msgspec.structs.replace(config, github_api=rel.api)
        await want(bus, LLAMA)
        probe = gpu_probe(tmp_path, "12.8")
        first = await converge(config, bus, probe=probe)
        assert engine(first)["state"] == "installed"
        sub = await bus.nc.subscribe(bus.names.node_engines("node-a"), cb=on_inventory)
        checked: list[str] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_status)
            await eventually(lambda: reported, timeout=10)
            # A restarted installer whose rechecks each take a while: three rounds of them.
            inst = installer(config, bus, probe=probe, ldd=slow_ldd(checked, 0.1))
            await tg.start(inst.run)
            await eventually(lambda: checked.count("llama-server") >= 3, timeout=30)
            tg.cancel_scope.cancel()
        await sub.unsubscribe()
    assert {state for _, state in reported} == {"installed"}, reported
    assert ("inventory", "installed") in reported
    assert ("status", "installed") in reported


def test_runtime_libraries_at_any_depth_go_beside_llama_server_links_and_all(tmp_path: Path) -> None:
    runtime, bin_dir = tmp_path / "runtime", tmp_path / "bin"
    lib64 = runtime / "cudart-mirror" / "lib64"
    lib64.mkdir(parents=True)
    bin_dir.mkdir()
    (lib64 / "libcudart.so.12.8.90").write_bytes(b"\x7fELF")
    (lib64 / "libcudart.so.12").symlink_to("libcudart.so.12.8.90")
    (runtime / "cudart-mirror" / "libcudart.so").symlink_to("lib64/libcudart.so.12")
    (runtime / "cudart-mirror" / "LICENSE").write_text("EULA\n")
    assert merge_runtime(runtime, bin_dir, "cudart.tar.gz") == [
        "libcudart.so",
        "libcudart.so.12",
        "libcudart.so.12.8.90",
    ]
    assert os.readlink(bin_dir / "libcudart.so") == "libcudart.so.12"
    assert (bin_dir / "libcudart.so").resolve() == (bin_dir / "libcudart.so.12.8.90")
    assert not (bin_dir / "LICENSE").exists()


def test_a_runtime_holding_one_library_twice_is_refused(tmp_path: Path) -> None:
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "libcudart.so.12").write_bytes(b"\x7fELF")
    with pytest.raises(InstallError) as err:
        merge_runtime(tmp_path, tmp_path / "bin", "cudart.tar.gz")
    assert str(err.value) == (
        "cudart.tar.gz holds libcudart.so.12 twice (a/libcudart.so.12 and b/libcudart.so.12); "
        "refusing to guess which goes beside llama-server"
    )
