"""LoRA adapters loaded into a runtime engine (vLLM, the simulator) on demand: a gateway asks
(`AdapterLoad` on `<prefix>.launcher.<node>.adapters`, request/reply) when a request names an
adapter that no ready replica of its base holds, and this node's launcher loads it into the
replica's engine (`POST /v1/load_lora_adapter`), first unloading the adapter least recently used
where the engine holds `max_loras` already (`POST /v1/unload_lora_adapter`).

What the engine holds is on the shard's status (`ShardStatus.adapters`, published as an event
at each load and unload, with words saying which), which is what gateways route by. A load the
engine refuses is answered with the engine's words, and said on the status too. A fault costs
that one reply; loads into one shard go one at a time.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import httpx
import msgspec

from llmgw_core.adapter_rules import max_loras
from llmgw_core.adapters import (
    RUNTIME_ENGINES,
    AdapterLoad,
    AdapterLoaded,
    ServedAdapter,
    load_subject,
)
from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import decoder, encode

from .attempt import bounded

if TYPE_CHECKING:
    from .runner import ShardRunner as Runner

log = logging.getLogger("llmgw.launcher")

# How long an engine may take to load or unload one adapter (vLLM reads it from disk).
ENGINE_TIMEOUT_S = 60.0
# How much of an engine's refusal is quoted.
_WORDS_MAX = 500


def victim(loaded: tuple[str, ...], recent: tuple[str, ...], room: int) -> str | None:
    """The adapter to unload before one more is loaded into an engine holding `loaded` (in load
    order) with `room` slots: None while there is room; else the least recently used, `recent`
    being most recent first (one not in it is older than any in it; among those, the first
    loaded goes first). Pure."""
    if len(loaded) < room:
        return None
    order = {name: i for i, name in enumerate(recent)}
    never = [name for name in loaded if name not in order]
    if never:
        return never[0]
    return max(loaded, key=lambda name: order[name])


def engine_words(response: httpx.Response) -> str:
    """What an engine said when it refused a load or unload: its error's message (vLLM's
    ErrorResponse), else the start of its body."""
    text = response.text[:_WORDS_MAX]
    try:
        body = json.loads(response.content[: 64 * 1024])
    except ValueError:
        return f"{response.status_code}: {text}"
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if isinstance(message, str):
        return f"{response.status_code}: {message[:_WORDS_MAX]}"
    return f"{response.status_code}: {text}"


class AdapterLoads:
    """Answers this node's adapter load requests. `runners()`: the shards this launcher runs,
    by key."""

    def __init__(self, bus: Bus, node: str, runners: Callable[[], Mapping[str, Runner]]) -> None:
        self.bus = bus
        self.node = node
        self.runners = runners
        self._locks: dict[str, anyio.Lock] = {}
        self._client: httpx.AsyncClient | None = None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Answer requests until cancelled; a fault costs one reply."""
        subject = load_subject(self.bus.names.prefix, self.node)

        async def on_request(data: bytes) -> bytes:
            try:
                reply = await self.load(data)
            except Exception as exc:  # one bad request must not end the subscription
                log.exception("%s: cannot answer an adapter load", subject)
                words = f"launcher error: {type(exc).__name__}: {exc}"
                reply = AdapterLoaded(shard="", adapter="", error=words)
            return encode(reply)

        async with httpx.AsyncClient(timeout=ENGINE_TIMEOUT_S) as client:
            self._client = client
            try:
                await self.bus.answer(subject, on_request, task_status=task_status)
            except BusError as exc:  # raised only before started: the launcher goes on without
                log.error("%s: cannot answer adapter loads: %s", subject, exc)
                task_status.started()

    async def load(self, data: bytes) -> AdapterLoaded:
        """The reply to one load request: the adapter loaded (or already there), or why not."""
        try:
            request = decoder(AdapterLoad).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return AdapterLoaded(shard="", adapter="", error=f"not an adapter load request: {exc}")
        shard, adapter = request.shard, request.adapter

        def refused(words: str) -> AdapterLoaded:
            return AdapterLoaded(shard=shard, adapter=adapter, error=words)

        key = self.bus.names.shard_key(self.node, shard)
        runner = self.runners().get(key)
        if runner is None:
            return refused(f"no shard {shard} on node {self.node}")
        if runner.spec.profile.engine not in RUNTIME_ENGINES:
            engine = runner.spec.profile.engine
            return refused(f"shard {shard} runs {engine}, which loads no adapter at run time")
        path = runner.adapters_staged.get(adapter)
        if path is None:
            return refused(f"shard {shard} has no adapter {adapter} staged (refused, or not on its profile)")
        lock = self._locks.setdefault(key, anyio.Lock())
        async with lock:
            if runner.state != "ready" or not runner.leader_url:
                return refused(f"shard {shard} is {runner.state}, not ready")
            return await self._load(runner, request, path)

    async def _load(self, runner: Runner, request: AdapterLoad, path: str) -> AdapterLoaded:
        shard, adapter = request.shard, request.adapter
        loaded = tuple(a.name for a in runner.adapters_served)
        if adapter in loaded:
            return AdapterLoaded(shard=shard, adapter=adapter)
        assert self._client is not None
        url = runner.leader_url
        evict = victim(loaded, request.recent, max_loras(runner.spec.profile))
        if evict is not None:
            answer = await self._post(f"{url}/v1/unload_lora_adapter", {"lora_name": evict})
            # An engine that no longer holds it (restarted by hand) has the slot free all the same.
            if isinstance(answer, str) or (answer.status_code != 200 and answer.status_code != 404):
                words = answer if isinstance(answer, str) else engine_words(answer)
                return self._failed(runner, request, f"cannot unload {evict} to make room: {words}")
            runner.adapters_served = tuple(a for a in runner.adapters_served if a.name != evict)
        answer = await self._post(f"{url}/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": path})
        if isinstance(answer, str) or answer.status_code != 200:
            words = answer if isinstance(answer, str) else engine_words(answer)
            return self._failed(runner, request, words, evict or "")
        scale = next((a.scale for a in runner.spec.profile.adapters if a.name == adapter), 1.0)
        runner.adapters_served = (*runner.adapters_served, ServedAdapter(name=adapter, scale=scale))
        said = f"adapter {adapter} loaded"
        if evict is not None:
            said += f"; adapter {evict} unloaded (least recently used of {len(loaded)})"
        log.info("shard %s: %s", runner.key, said)
        runner.publish_adapters(said)
        return AdapterLoaded(shard=shard, adapter=adapter, unloaded=evict or "")

    def _failed(self, runner: Runner, request: AdapterLoad, words: str, evicted: str = "") -> AdapterLoaded:
        said = bounded(f"adapter {request.adapter} failed to load: {words}")
        log.warning("shard %s: %s", runner.key, said)
        runner.publish_adapters(said)
        return AdapterLoaded(shard=request.shard, adapter=request.adapter, error=said, unloaded=evicted)

    async def _post(self, url: str, body: dict[str, str]) -> httpx.Response | str:
        assert self._client is not None
        try:
            return await self._client.post(url, json=body)
        except httpx.HTTPError as exc:
            return f"the engine did not answer {url}: {type(exc).__name__}: {exc}"
