"""LoRA adapters loaded on demand, through the real launcher and gateway on a simulated engine
that loads them as vLLM does (`/v1/load_lora_adapter`): the first request for a cold adapter is
held while the node's launcher loads it, then answered with the adapter's words; a full engine
(max_loras) unloads the least recently used once the new one loaded, never one with requests in
flight, as its status and events say; a load the engine refuses is answered 503 in its words and
costs no adapter its slot; usage is counted under the adapter's name."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import msgspec
import pytest
from prometheus_client import generate_latest

from llmgw.ctl import _adapters
from llmgw_core.adapters import AdapterLoad, AdapterLoaded, ServedAdapter, load_subject
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, ReplicaRecord, ShardStatus
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
IN_FLIGHT_S = 0.2


def _profile(models: Path, tokens_per_second: int = 2000) -> Profile:
    def adapter(name: str) -> dict[str, Any]:
        return {"name": name, "base": "tiny", "source": f"file://{write_peft_lora(models / name)}"}

    return msgspec.convert(
        {
            "name": "tiny",
            "engine": "sim",
            "model_path": "sim://tiny",
            "args": ["--lora-load-time", str(LOAD_S), "--tokens-per-second", str(tokens_per_second)],
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


def _said(events: ShardEvents, words: str) -> ShardStatus | None:
    """The shard's last status, once it is ready and its words begin with `words`."""
    status = _last(events, "ready")
    return status if status is not None and status.reason.startswith(words) else None


def _loaded(status: ShardStatus | None) -> list[str]:
    return [a.name for a in status.adapters] if status is not None else []


@contextlib.asynccontextmanager
async def _gateway(
    bus: Bus, table: Table, client: httpx.AsyncClient, hold_s: float = 10
) -> AsyncIterator[tuple[str, Proxy, Callable[[], None]]]:
    # A request sent this recently is named in flight with a load: short here, where requests
    # follow each other by milliseconds.
    loads = AdapterLoads(bus, table, timeout_s=hold_s, in_flight_s=IN_FLIGHT_S)
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
                # The load goes before any unload: refused, it costs no adapter its slot.
                assert _loaded(failed) == ["tax", "finance"]

                # Usage under the adapter's name, not the base deployment's.
                text = generate_latest(proxy.metrics.registry).decode()
                assert value(text, "llmgw_gateway_key_requests_total", deployment="legal") == 3
                assert value(text, "llmgw_gateway_key_requests_total", deployment="chat") == 1

                # What the operator reads of one: its loads and unloads (from the shard's events)
                # and what the gateways served of it (their usage records, written as they write them).
                proxy.usage.bus = bus
                await proxy.usage.flush()
                await bus.put(bus.names.catalog_bucket, "tiny", profile)
                await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
                said = await _adapters.describe(bus, "finance")
                loads = r"^Loads:        2, unloads 1; the last \d+ s ago on chat/r0 \(as the events"
                assert re.search(loads, said, re.MULTILINE), said
                used = r"^Used:         2 requests, \d+ tokens in the last 24 h; the last \d+ s ago$"
                assert re.search(used, said, re.MULTILINE), said
                assert "Loaded by:    chat/r0" in said
                stop()
            follow.cancel_scope.cancel()


# A slow request: STREAM_TOKENS at STREAM_RATE tokens a second, 1.5 s in flight.
STREAM_TOKENS, STREAM_RATE = 240, 160


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    ended: dict[str, str],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """A streamed request for `model`, started once its first chunk is in (the engine generates
    it then), read to its end; `ended[model]`: its status and last event."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "slow"}],
        "max_tokens": STREAM_TOKENS,
        "stream": True,
    }
    last = ""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and not last:
                task_status.started()
            last = line or last
        if not last:
            task_status.started()
    ended[model] = f"{r.status_code} {last}"


async def test_adapters_in_use_stay_loaded_a_failed_load_costs_no_slot_and_a_busy_engine_is_waited_for(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    profile = _profile(models, tokens_per_second=STREAM_RATE)
    config = agent_config(nats_url, prefix, tmp_path / "agent", load_interval_s=0.2)
    spec = shard("node-a", "chat-r0-0", profile, deployment="chat")
    async with shard_events(bus) as events, running_launcher(config, gpus=[]) as launcher:
        await bus.put(bus.names.shards_bucket, "node-a.chat-r0-0", spec)
        ready = await eventually(lambda: _last(events, "ready"), timeout=30)
        assert ready is not None
        runner = launcher.handles["node-a.chat-r0-0"].runner
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
        ended: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=30) as client, anyio.create_task_group() as follow:
            follow.start_soon(_follow, events, table, "node-a.chat-r0-0", "chat-r0-0")
            async with (
                _gateway(bus, table, client) as (gw, _, stop),
                _gateway(bus, table, client, hold_s=0.6) as (brief, _, stop_brief),
                anyio.create_task_group() as streams,
            ):
                legal = _text(await _chat(client, gw, "legal"))
                _text(await _chat(client, gw, "finance"))
                assert _loaded(events.last("chat-r0-0")) == ["legal", "finance"]

                # A load the engine refuses leaves both loaded (nothing was unloaded first).
                r = await _chat(client, gw, "broken")
                assert r.status_code == 503, r.text
                assert "Loading lora broken failed" in r.json()["error"]["message"]
                failed = await eventually(lambda: _said(events, "adapter broken"))
                assert _loaded(failed) == ["legal", "finance"]

                # `legal` has a slow request in flight, and `finance` was used after it: `legal`
                # is the least recently used, but `finance` goes.
                await streams.start(_stream, client, gw, "legal", ended)
                _text(await _chat(client, gw, "finance"))
                # The runner keeps the engine's word from its load reads too.
                await eventually(lambda: runner.adapters_in_use == {"legal"})
                _text(await _chat(client, gw, "tax"))
                last = _last(events, "ready")
                assert last is not None
                assert _loaded(last) == ["legal", "tax"]
                assert last.reason == (
                    "adapter tax loaded; adapter finance unloaded (least recently used of 2, legal in use)"
                )
                await eventually(lambda: "legal" in ended, timeout=15)
                assert ended["legal"] == "200 data: [DONE]"
                assert _text(await _chat(client, gw, "legal")) == legal
                await eventually(lambda: runner.adapters_in_use == frozenset())

                # Both in use: nothing is loaded or unloaded. A hold that ends first is a 503 in
                # words with a Retry-After; a longer one is served once a request ends.
                await streams.start(_stream, client, gw, "legal", ended)
                await streams.start(_stream, client, gw, "tax", ended)
                began = time.monotonic()
                r = await _chat(client, brief, "finance")
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == "2"
                assert r.json()["error"]["message"] == (
                    "adapter finance cannot be loaded on node node-a now: shard chat-r0-0 holds "
                    "max_loras 2, and every one of its 2 adapters has requests running or waiting: "
                    "legal, tax; retry in 2s"
                )
                assert time.monotonic() - began < 2
                assert _loaded(events.last("chat-r0-0")) == ["legal", "tax"]
                _text(await _chat(client, gw, "finance"))
                assert {ended["legal"], ended["tax"]} == {"200 data: [DONE]"}
                # `legal` was sent its slow request before `tax`: the least recently used.
                assert _loaded(events.last("chat-r0-0")) == ["tax", "finance"]

                # A request the gateway sent a moment ago may not be in the engine's count yet:
                # named in flight with the load, its adapter stays (`finance`, least recent here).
                await eventually(lambda: runner.adapters_in_use == frozenset())
                request = AdapterLoad(
                    shard="chat-r0-0", adapter="legal", recent=("tax", "finance"), in_flight=("finance",)
                )
                reply = await bus.request(load_subject(prefix, "node-a"), request, AdapterLoaded, timeout=10)
                assert reply == AdapterLoaded(shard="chat-r0-0", adapter="legal", unloaded="tax")
                said = "adapter legal loaded; adapter tax unloaded (least recently used of 2, finance in use)"
                assert _loaded(await eventually(lambda: _said(events, said))) == ["finance", "legal"]
                stop()
                stop_brief()
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


async def test_the_simulator_loads_and_unloads_as_vllm_does_past_max_loras(tmp_path: Path) -> None:
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
        # As vLLM 0.32: max_loras bounds one batch's adapters, not the registry; a third loads.
        assert (await load("c")).status_code == 200
        assert len({await words("sim"), await words("a"), await words("b"), await words("c")}) == 4
        listed = (await client.get("/v1/models")).json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [
            ("sim", None),
            ("a", "sim"),
            ("b", "sim"),
            ("c", "sim"),
        ]
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert gone.text == "Success: LoRA adapter 'a' removed successfully."
        again = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert again.status_code == 404
        assert (await load("a")).status_code == 200


def test_loads_are_counted_from_ready_statuses_and_a_restart_is_no_unload() -> None:
    def status(state: str, *held: str, shard: str = "chat-r0-0", rank: int = 0) -> ShardStatus:
        adapters = tuple(ServedAdapter(name=n) for n in held)
        return ShardStatus(
            node="n", shard=shard, replica="r0", state=state, deployment="chat", rank=rank, adapters=adapters
        )

    said = [
        status("ready"),
        status("ready", "legal"),  # a load
        status("ready", "legal", "tax"),
        status("ready", "tax"),  # an unload
        status("ready", "legal", shard="chat-r0-1", rank=1),  # not the replica's first shard
        status("stopping"),  # its engine stops: nothing held, no unload
        status("ready", "legal"),  # loaded again
    ]
    stamped = [_adapters.read.Stamped("s", float(i), e) for i, e in enumerate(said)]
    assert _adapters.loads_of("legal", ["chat"], stamped) == _adapters.Loads(2, 1, (6.0, "chat/r0"))
    assert _adapters.loads_of("legal", ["other"], stamped) == _adapters.Loads()
