"""LoRA adapters loaded on demand, through the real launcher and gateway on a simulated engine
that loads them as vLLM does (`/v1/load_lora_adapter`): the first request for a cold adapter is
held while the node's launcher loads it, then answered with the adapter's words; a full engine
(max_loras) unloads the least recently used first, as its status and events say; a load the
engine refuses is answered 503 in its words; usage is counted under the adapter's name."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from prometheus_client import generate_latest

from llmgw_core.adapters import ServedAdapter
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import ReplicaRecord, ShardStatus
from llmgw_gateway.adapter_loads import AdapterLoads
from llmgw_gateway.proxy import Proxy
from llmgw_gateway.routing import Table
from tests.adapters_support import write_peft_lora
from tests.gateway_support import serve_proxy
from tests.launcher_support import ShardEvents, agent_config, running_launcher, shard, shard_events
from tests.metrics_support import value
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.lora, pytest.mark.timeout(60)]

ADAPTERS = ("broken", "finance", "legal", "tax")
# Each load takes this long in the engine: long enough that a request not held would arrive
# before the adapter.
LOAD_S = 0.4


def _profile(models: Path) -> Profile:
    def adapter(name: str) -> dict[str, Any]:
        return {"name": name, "base": "tiny", "source": f"file://{write_peft_lora(models / name)}"}

    return msgspec.convert(
        {
            "name": "tiny",
            "engine": "sim",
            "model_path": "sim://tiny",
            "args": ["--lora-load-time", str(LOAD_S), "--tokens-per-second", "2000"],
            "health_timeout_s": 20.0,
            "max_loras": 2,
            "adapters": [adapter(n) for n in ADAPTERS],
        },
        Profile,
    )


async def _chat(client: httpx.AsyncClient, url: str, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    return await client.post(f"{url}/v1/chat/completions", json=body)


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def _follow(events: ShardEvents, table: Table, key: str, name: str) -> None:
    """The gateway's watch of the status bucket, in short: each new status of the shard into its
    routing table."""
    seen = 0
    while True:
        found = events.of(name)
        for status in found[seen:]:
            table.set_shard_status(key, status)
        seen = len(found)
        await anyio.sleep(0.01)


def _last(events: ShardEvents, state: str) -> ShardStatus | None:
    status = events.last("chat-r0-0")
    return status if status is not None and status.state == state else None


def _loaded(status: ShardStatus | None) -> list[str]:
    return [a.name for a in status.adapters] if status is not None else []


@contextlib.asynccontextmanager
async def _gateway(
    bus: Bus, table: Table, client: httpx.AsyncClient
) -> AsyncIterator[tuple[str, Proxy, Callable[[], None]]]:
    loads = AdapterLoads(bus, table, timeout_s=10)
    async with Proxy(table, client, adapter_loads=loads) as proxy, anyio.create_task_group() as tg:
        proxy.loaded.set()
        yield f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}", proxy, tg.cancel_scope.cancel


async def test_cold_adapters_are_held_while_loaded_lru_unloaded_failures_said_usage_named(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    profile = _profile(models)
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    spec = shard("node-a", "chat-r0-0", profile, deployment="chat")
    async with shard_events(bus) as events, running_launcher(config, gpus=[]):
        await bus.put(bus.names.shards_bucket, "node-a.chat-r0-0", spec)
        ready = await eventually(lambda: _last(events, "ready"), timeout=30)
        assert ready is not None
        # Staged and checked, none loaded: the engine starts with room for max_loras.
        assert ready.adapters_loadable == ADAPTERS
        assert ready.adapters == ()
        # The weights of one vanish after staging: its load is refused by the engine.
        (models / "broken" / "adapter_model.safetensors").unlink()

        table = Table()
        table.set_replica(
            "chat.r0",
            ReplicaRecord(
                deployment="chat",
                replica="r0",
                profile="tiny",
                profile_fp=spec.profile_fp,
                state="ready",
                url=ready.url,
                engine="sim",
            ),
        )
        table.set_shard_status("node-a.chat-r0-0", ready)
        async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as follow:
            follow.start_soon(_follow, events, table, "node-a.chat-r0-0", "chat-r0-0")
            async with _gateway(bus, table, client) as (gw, proxy, stop):
                base = _text(await _chat(client, gw, "chat"))

                # Cold: held while the launcher loads it (the engine takes LOAD_S), then answered
                # with the adapter's words, not the base's.
                began = time.monotonic()
                legal = _text(await _chat(client, gw, "legal"))
                assert time.monotonic() - began >= LOAD_S
                assert legal != base
                assert _loaded(events.last("chat-r0-0")) == ["legal"]
                # Warm: no second load, the same words.
                assert _text(await _chat(client, gw, "legal")) == legal
                finance = _text(await _chat(client, gw, "finance"))
                assert finance not in (base, legal)
                assert proxy.adapter_loads.asked == 2

                # Full at max_loras 2: `legal` was used after `finance`, so `finance` goes.
                assert _text(await _chat(client, gw, "legal")) == legal
                assert _text(await _chat(client, gw, "tax")) not in (base, legal, finance)
                last = _last(events, "ready")
                assert last is not None
                assert _loaded(last) == ["legal", "tax"]
                lru = "adapter tax loaded; adapter finance unloaded (least recently used of 2)"
                assert last.reason == lru
                said = [s.reason for s in events.of("chat-r0-0") if s.reason.startswith("adapter ")]
                assert said == [
                    "adapter legal loaded",
                    "adapter finance loaded",
                    lru,
                ]
                # Unloaded is cold again: loaded again (and `legal`, less recent than `tax`, goes).
                assert _text(await _chat(client, gw, "finance")) == finance
                assert _loaded(events.last("chat-r0-0")) == ["tax", "finance"]

                # A load the engine refuses: 503 with the engine's words, and on the status.
                r = await _chat(client, gw, "broken")
                assert r.status_code == 503, r.text
                message = r.json()["error"]["message"]
                assert message.startswith(
                    "adapter broken cannot be served on node node-a: adapter broken failed to load: "
                )
                assert "Loading lora broken failed" in message
                assert "adapter_model.safetensors: cannot be read" in message
                failed = await eventually(
                    lambda: (s := _last(events, "ready")) and s.reason.startswith("adapter broken") and s
                )
                assert failed.reason.startswith(
                    "adapter broken failed to load: 400: Loading lora broken failed"
                )
                # The unload made room before the engine refused: `tax`, least recently used.
                assert _loaded(failed) == ["finance"]

                # Usage under the adapter's name, not the base deployment's.
                text = generate_latest(proxy.metrics.registry).decode()
                assert value(text, "llmgw_gateway_key_requests_total", deployment="legal") == 3
                assert value(text, "llmgw_gateway_key_requests_total", deployment="chat") == 1
                stop()
            follow.cancel_scope.cancel()


async def test_an_adapter_listed_loaded_is_served_without_a_load() -> None:
    """The index's word that a runtime replica holds an adapter routes to it with no load."""
    table = Table()
    status = ShardStatus(
        node="n1",
        shard="chat-r0-0",
        replica="r0",
        deployment="chat",
        state="ready",
        adapters=(ServedAdapter(name="legal"),),
        adapters_loadable=("legal",),
    )
    table.set_shard_status("n1.chat-r0-0", status)
    loads = AdapterLoads(None, table)
    assert table.adapters.holders("legal") == ("chat", frozenset({"chat.r0"}))
    assert loads.choose({"chat.r0": ("n1", "chat-r0-0"), "chat.r1": ("n2", "chat-r1-0")}) == "chat.r0"


async def test_the_simulator_loads_and_unloads_as_vllm_does_within_max_loras(tmp_path: Path) -> None:
    from llmgw_core.sim._app import SimEngine, SimOptions

    for name in ("a", "b", "c"):
        write_peft_lora(tmp_path / name)
    write_peft_lora(tmp_path / "wide", rank=128)
    engine = SimEngine(SimOptions(max_loras=2, max_lora_rank=64))
    transport = httpx.ASGITransport(app=engine.app())
    async with httpx.AsyncClient(transport=transport, base_url="http://sim") as client:

        async def load(name: str) -> httpx.Response:
            body = {"lora_name": name, "lora_path": str(tmp_path / name)}
            return await client.post("/v1/load_lora_adapter", json=body)

        async def words(model: str) -> str:
            body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
            return _text(await client.post("/v1/chat/completions", json=body))

        assert (await load("a")).text == "Success: LoRA adapter 'a' added successfully."
        assert (await load("a")).json()["error"]["message"] == "The lora adapter 'a' has already been loaded."
        wide = (await load("wide")).json()["error"]["message"]
        assert wide.startswith("Loading lora wide failed: ")
        assert "rank '128' is outside 1 to 64" in wide
        assert (await load("b")).status_code == 200
        full = await load("c")
        assert full.status_code == 400
        assert full.json()["error"]["message"] == (
            "Cannot load LoRA adapter 'c': 2 of max_loras 2 are loaded; unload one first"
        )
        assert len({await words("sim"), await words("a"), await words("b")}) == 3
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [("sim", None), ("a", "sim"), ("b", "sim")]
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert gone.text == "Success: LoRA adapter 'a' removed successfully."
        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert again.status_code == 404
        assert (await load("c")).status_code == 200
