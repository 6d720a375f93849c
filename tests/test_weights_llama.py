"""The real llama-server loading a GGUF that the node staged from a Hugging Face-shaped hub."""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from tests.hf_server import hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events
from tests.test_launcher_llamacpp import llama_bin
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.llama]

__all__ = ["llama_bin"]


async def test_two_shards_load_one_staged_gguf_fetched_once_from_the_hub(
    bus: Bus,
    nats_url: str,
    prefix: str,
    tmp_path: Path,
    llama_bin: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gguf = write_tiny_llama(tmp_path / "tiny.gguf").read_bytes()
    profile = msgspec.convert(
        {
            "name": "tiny-llama",
            "engine": "llamacpp",
            "model": "hf://org/repo/tiny.gguf",
            "args": ["-c", "512", "-t", "1"],
            "health_timeout_s": 60.0,
        },
        Profile,
    )
    with hf_hub() as hub:
        hub.add("org/repo", {"tiny.gguf": gguf})
        commit = hub.state.repos["org/repo"].commit
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        config = agent_config(nats_url, prefix, tmp_path / "agent", engines={"llamacpp": {"path": llama_bin}})
        async with shard_events(bus) as events, running_launcher(config, gpus=[]):
            for name in ("l1", "l2"):
                await bus.put(bus.names.shards_bucket, f"node-a.{name}", shard("node-a", name, profile))
            for name in ("l1", "l2"):
                ready = await eventually(
                    lambda name=name: (s := events.last(name)) and s.state == "ready" and s, timeout=90
                )
                assert "failed" not in events.states(name), [(s.state, s.reason) for s in events.of(name)]
                async with httpx.AsyncClient(base_url=ready.url, timeout=30) as client:
                    r = await client.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4},
                    )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "tiny-llama"
        # The origin sent the model's bytes once, however many shards wanted it.
        assert hub.state.served["tiny.gguf"] == len(gguf)
        assert [name for name, _ in hub.state.gets] == ["tiny.gguf"]
    staged = tmp_path / "agent" / "models" / "hf" / "org" / "repo" / commit / "files" / "tiny.gguf"
    assert staged.read_bytes() == gguf
    log = next((tmp_path / "agent" / "logs").rglob("*llama-server.log")).read_text()
    assert str(staged) in log
