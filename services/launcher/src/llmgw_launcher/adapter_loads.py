"""LoRA adapters loaded into a runtime engine (vLLM, the simulator) on demand: a gateway asks
(`AdapterLoad` on `<prefix>.launcher.<node>.adapters`, request/reply) when a request names an
adapter that no ready replica of its base holds, and this node's launcher loads it into the
replica's engine (`POST /v1/load_lora_adapter`). Where the engine holds `max_loras` already, the
adapter least recently used of those with no request running or waiting is unloaded
(`POST /v1/unload_lora_adapter`) once the new one loaded: vLLM's registry takes more adapters
than `max_loras` (that bounds the adapters of one batch), so the load goes first, and a load
that fails costs no adapter its slot.

Which adapters are in use is the engine's own word (its LoRA gauge, `load.lora_in_use`), read
again at each choice (the shard's last scrape is up to a load interval old), and those the asking
gateway sent a request to a moment ago (`AdapterLoad.in_flight`: maybe not in the engine's
count yet). Where every adapter the engine holds is in use, nothing is tried: the reply says
so, `retryable`, and the gateway asks again within its hold.

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
from .load import LOAD_METRICS, lora_in_use

if TYPE_CHECKING:
    from .runner import ShardRunner as Runner

log = logging.getLogger("llmgw.launcher")

# How long an engine may take to load or unload one adapter (vLLM reads it from disk).
ENGINE_TIMEOUT_S = 60.0
# How much of an engine's refusal is quoted.
_WORDS_MAX = 500
# Where vLLM and the simulator serve their metrics (the adapters in use are read there).
_METRICS_PATH = "/metrics"


def victim(
    loaded: tuple[str, ...], recent: tuple[str, ...], room: int, in_use: frozenset[str] = frozenset()
) -> str | None:
    """The adapter to unload for one more in an engine holding `loaded` (in load order) with
    `room` slots: None while there is room, or where every one is `in_use` (requests running or
    waiting on it: clients are using it, and each of its next requests would wait for a reload);
    else the least recently used of the others, `recent` being most recent first (one not in it
    is older than any in it; among those, the first loaded goes first). Pure."""
    if len(loaded) < room:
        return None
    free = [name for name in loaded if name not in in_use]
    return min(free, key=_age(loaded, recent)) if free else None


def passed_over(
    loaded: tuple[str, ...], recent: tuple[str, ...], in_use: frozenset[str], evict: str
) -> list[str]:
    """The adapters in use that `victim` passed over for `evict`: less recently used than it,
    they would have gone had they no requests. Pure."""
    age = _age(loaded, recent)
    return [name for name in sorted(in_use.intersection(loaded)) if age(name) < age(evict)]


def _age(loaded: tuple[str, ...], recent: tuple[str, ...]) -> Callable[[str], tuple[int, int]]:
    """A sort key of `loaded`, the least recently used first: one never used (not in `recent`)
    before any used, in load order; then the last in `recent` first."""
    order = {name: i for i, name in enumerate(recent)}
    place = {name: i for i, name in enumerate(loaded)}
    return lambda name: (0, place[name]) if name not in order else (1, -order[name])


def all_in_use(loaded: tuple[str, ...]) -> str:
    """Why no adapter can be unloaded for room, in words."""
    return (
        f"every one of its {len(loaded)} adapters has requests running or waiting: "
        f"{', '.join(sorted(loaded))}"
    )


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
        room = max_loras(runner.spec.profile)
        full = len(loaded) >= room
        if full and victim(loaded, request.recent, room, await self._in_use(runner, request)) is None:
            # Nothing is tried: a load now would leave the engine over max_loras with no adapter
            # it could give back, and the gateway's request may wait for one to end.
            words = f"shard {shard} holds max_loras {room}, and {all_in_use(loaded)}"
            log.info("shard %s: adapter %s not loaded yet: %s", runner.key, adapter, words)
            return AdapterLoaded(shard=shard, adapter=adapter, error=words, retryable=True)
        url = runner.leader_url
        answer = await self._post(f"{url}/v1/load_lora_adapter", {"lora_name": adapter, "lora_path": path})
        if isinstance(answer, str) or answer.status_code != 200:
            # Nothing was unloaded yet: every adapter the engine held, it holds still.
            return self._failed(runner, request, answer if isinstance(answer, str) else engine_words(answer))
        scale = next((a.scale for a in runner.spec.profile.adapters if a.name == adapter), 1.0)
        runner.adapters_served = (*runner.adapters_served, ServedAdapter(name=adapter, scale=scale))
        said = f"adapter {adapter} loaded"
        evict = None
        if full:
            # Chosen again after the load, on the engine's word now: a request sent to one of
            # them while the engine loaded has reached it.
            in_use = await self._in_use(runner, request)
            evict = victim(loaded, request.recent, room, in_use)
            if evict is None:
                said += f"; none unloaded, {all_in_use(loaded)} ({len(loaded) + 1} loaded, max_loras {room})"
            else:
                failed = await self._unload(runner, evict)
                busy = passed_over(loaded, request.recent, in_use, evict)
                why = f", {', '.join(busy)} in use" if busy else ""
                said += (
                    f"; adapter {evict} could not be unloaded for room: {failed}"
                    if failed is not None
                    else f"; adapter {evict} unloaded (least recently used of {len(loaded)}{why})"
                )
        log.info("shard %s: %s", runner.key, said)
        runner.publish_adapters(said)
        held = {a.name for a in runner.adapters_served}
        unloaded = evict if evict is not None and evict not in held else ""
        return AdapterLoaded(shard=shard, adapter=adapter, unloaded=unloaded)

    async def _unload(self, runner: Runner, evict: str) -> str | None:
        """Unload `evict` for room: None where it went, else why not in words."""
        answer = await self._post(f"{runner.leader_url}/v1/unload_lora_adapter", {"lora_name": evict})
        # An engine that no longer holds it (restarted by hand) has the slot free all the same.
        if isinstance(answer, str) or answer.status_code not in (200, 404):
            return answer if isinstance(answer, str) else engine_words(answer)
        runner.adapters_served = tuple(a for a in runner.adapters_served if a.name != evict)
        return None

    async def _in_use(self, runner: Runner, request: AdapterLoad) -> frozenset[str]:
        """The adapters in use: those the engine says have requests running or waiting, read now
        (the shard's last scrape is up to a load interval old; where the engine does not answer
        in time, that last), and those the asking gateway sent requests to a moment ago."""
        metrics = LOAD_METRICS.get(runner.spec.profile.engine)
        scraper = runner.ctx.scraper
        if metrics is not None and metrics.lora and scraper is not None:
            text = await scraper.text(runner.leader_url + _METRICS_PATH)
            if text is not None:
                names = frozenset(runner.adapters_staged)
                in_use = await runner.ctx.workers.files(lora_in_use, text, metrics.lora, names)
                if in_use is not None:
                    runner.adapters_in_use = in_use
        return runner.adapters_in_use.union(request.in_flight)

    def _failed(self, runner: Runner, request: AdapterLoad, words: str) -> AdapterLoaded:
        said = bounded(f"adapter {request.adapter} failed to load: {words}")
        log.warning("shard %s: %s", runner.key, said)
        runner.publish_adapters(said)
        return AdapterLoaded(shard=request.shard, adapter=request.adapter, error=said)

    async def _post(self, url: str, body: dict[str, str]) -> httpx.Response | str:
        assert self._client is not None
        try:
            return await self._client.post(url, json=body)
        except httpx.HTTPError as exc:
            return f"the engine did not answer {url}: {type(exc).__name__}: {exc}"
