"""LoRA adapters through the gateway, on real llama.cpp: the launcher starts the base with its
adapters and says which it loaded on the shard's status; the gateway sends `model: <adapter>`
to that replica with the adapter applied (the answer is llama-server's own with the adapter
given by hand), the base with none applied, and a key made for an adapter calls that adapter
only (403 with words for the base or another adapter). `/v1/models` lists each adapter with
its base deployment as `parent`."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from llmgw.ctl import _adapters
from llmgw_core.adapters import ServedAdapter
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.keys import ApiKey, secret_hash
from llmgw_gateway.keyring import Keyring
from llmgw_gateway.proxy import Proxy
from llmgw_gateway.routing import Table
from tests.adapters_support import write_tiny_lora
from tests.gateway_support import answers_health, serve_proxy
from tests.launcher_support import agent_config, running_launcher, shard, shard_events
from tests.test_adapters_llamacpp import llama_bin  # noqa: F401 (a fixture)
from tests.test_sim_engine import free_port
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.llama, pytest.mark.lora, pytest.mark.timeout(120)]

KEYS = {"all": (), "legal-only": ("legal",), "chat-only": ("chat",)}


@pytest.fixture
def models(tmp_path: Path) -> Path:
    where = tmp_path / "models"
    where.mkdir()
    write_tiny_llama(where / "base.gguf")
    write_tiny_lora(where / "legal.gguf", seed=1)
    write_tiny_lora(where / "finance.gguf", seed=2)
    write_tiny_lora(where / "qwen.gguf", arch="qwen2")
    return where


@pytest.fixture
def by_hand(llama_bin: str, models: Path) -> Iterator[str]:  # noqa: F811
    """llama-server given the adapter `legal` by hand (`--lora FILE`, applied to every request)."""
    port = free_port()
    argv = [
        f"{llama_bin}/llama-server",
        "-m",
        str(models / "base.gguf"),
        "--lora",
        str(models / "legal.gguf"),
    ]
    argv += ["--port", str(port), "-c", "256", "-t", "1"]
    env = {**os.environ, "LD_LIBRARY_PATH": llama_bin}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def _profile(models: Path) -> Profile:
    def adapter(name: str) -> dict[str, Any]:
        return {"name": name, "base": "tiny-llama", "source": f"file://{models / name}.gguf"}

    return msgspec.convert(
        {
            "name": "tiny-llama",
            "engine": "llamacpp",
            "model_path": str(models / "base.gguf"),
            "args": ["-c", "256", "-t", "1"],
            "health_timeout_s": 60.0,
            "adapters": [adapter("finance"), adapter("legal"), adapter("qwen")],
        },
        Profile,
    )


def _keyring() -> Keyring:
    keyring = Keyring(required=True)
    for name, models in KEYS.items():
        keyring.set(name, ApiKey(name=name, hash=secret_hash(f"sk-{name}"), models=models))
    return keyring


async def _chat(client: httpx.AsyncClient, url: str, model: str, key: str = "all") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
    body |= {"temperature": 0, "cache_prompt": False}
    return await client.post(
        f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer sk-{key}"}
    )


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def test_an_adapter_is_routed_applied_scoped_and_listed_with_its_base(
    bus: Bus,
    nats_url: str,
    prefix: str,
    tmp_path: Path,
    llama_bin: str,  # noqa: F811
    models: Path,
    by_hand: str,
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent", engines={"llamacpp": {"path": llama_bin}})
    spec = shard("node-a", "chat-r0-0", _profile(models), deployment="chat")
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        await bus.put(bus.names.shards_bucket, "node-a.chat-r0-0", spec)
        ready = await eventually(
            lambda: (s := events.last("chat-r0-0")) and s.state == "ready" and s, timeout=60
        )
        assert ready.adapters == (ServedAdapter(name="finance"), ServedAdapter(name="legal"))
        assert [line.split(":")[0] for line in ready.adapters_refused] == ["adapter qwen refused"]

        # What the operator reads of it: the replica that loaded each, and the node's refusal.
        await bus.put(bus.names.catalog_bucket, "tiny-llama", spec.profile)
        await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny-llama"))
        said = await eventually(lambda: _adapters.describe(bus, "qwen"), timeout=10)
        assert (
            "Refused:      node-a/chat-r0-0: the adapter is for architecture 'qwen2', the base base.gguf is "
            "'llama'" in said
        ), said
        assert "Loaded by:    chat/r0" in await _adapters.describe(bus, "legal")

        table = Table()
        table.set_replica(
            "chat.r0",
            ReplicaRecord(
                deployment="chat",
                replica="r0",
                profile="tiny-llama",
                profile_fp="x",
                state="ready",
                url=ready.url,
                engine="llamacpp",
            ),
        )
        table.set_shard_status("node-a.chat-r0-0", ready)
        async with httpx.AsyncClient(timeout=60) as client:
            await eventually(lambda: answers_health(client, by_hand), timeout=30, interval=0.1)
            async with Proxy(table, client, keyring=_keyring()) as proxy, anyio.create_task_group() as tg:
                proxy.loaded.set()
                gw = f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}"

                legal = _text(await _chat(client, gw, "legal"))
                assert legal == _text(await _chat(client, by_hand, "legal"))
                base = _text(await _chat(client, gw, "chat"))
                finance = _text(await _chat(client, gw, "finance"))
                assert len({legal, base, finance}) == 3, (legal, base, finance)
                # The base is the base with every adapter at 0, the same the engine answers so.
                assert base == _text(await _chat(client, gw, "chat", "chat-only"))

                assert _text(await _chat(client, gw, "legal", "legal-only")) == legal
                for model in ("chat", "finance"):
                    r = await _chat(client, gw, model, "legal-only")
                    assert r.status_code == 403, r.text
                    assert r.json()["error"]["message"] == (
                        f"this key may call legal only, not '{model}'; ask for a key that names it"
                    )
                # A key for the base does not reach its adapters.
                r = await _chat(client, gw, "legal", "chat-only")
                assert r.status_code == 404, r.text
                # The adapter the node refused is served nowhere.
                r = await _chat(client, gw, "qwen")
                assert r.status_code == 404, r.text

                r = await client.get(f"{gw}/v1/models", headers={"Authorization": "Bearer sk-all"})
                listed = {m["id"]: m.get("parent") for m in r.json()["data"]}
                assert listed == {"chat": None, "finance": "chat", "legal": "chat"}
                r = await client.get(f"{gw}/v1/models", headers={"Authorization": "Bearer sk-legal-only"})
                assert [(m["id"], m.get("parent")) for m in r.json()["data"]] == [("legal", "chat")]
                tg.cancel_scope.cancel()
