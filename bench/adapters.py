"""LoRA adapters loaded on demand: adapter-aware routing against least outstanding, and a cold
adapter's first byte against the base's.

Two simulated replicas of one base (`llmgw_core.sim`, which loads adapters as vLLM does:
`/v1/load_lora_adapter`, each load taking LOAD_S as a small adapter does in vLLM; the launcher
keeps at most `max_loras` in each, unloading the least recently used not in use once a new one
loaded), started by a real launcher from a shard spec, over a real nats-server; 50 PEFT
adapters staged and checked by that launcher. The gateway's proxy runs in this process, its
routing table fed from the shard status bucket as the gateway's is.

Load: CLIENTS clients stream chat requests, each for an adapter drawn from a Zipf law over the
50 (a few hot, many cold: s = ZIPF_S), the same seeded sequence in both runs:
- adapter-aware: the gateway as it is (a replica that holds the adapter, else one loads it
  while the request is held);
- least outstanding: each request goes to the replica with the fewest requests in flight, which
  loads the adapter there first when it does not hold it (the same launcher load path, asked
  directly; the least recently used unloaded as in the other run).

Cold start: with the replicas idle, the first request for an adapter no replica holds, timed to
its first byte, against a base request's TTFT; and the same on a real `llama-server` (the tiny
llama GGUF and LLAMA_ADAPTERS adapter GGUFs the tests write, started by the launcher with every
adapter given at start and none applied: the first request for each applies it by its scale).

`python -m bench.adapters [--quick]` runs this section alone.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import msgspec

from llmgw_core.adapters import AdapterLoad, AdapterLoaded, load_subject
from llmgw_core.bus import Bus, BusOptions, prepare_node
from llmgw_core.config import AgentConfig
from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import ReplicaRecord, ShardStatus
from llmgw_core.natsd import NatsServer
from llmgw_gateway.adapter_loads import AdapterLoads
from llmgw_gateway.proxy import Proxy
from llmgw_gateway.routing import Table
from llmgw_launcher import Launcher

TITLE = "## LoRA adapters loaded on demand (simulated engines)"
ADAPTERS = 50
REPLICAS = 2
MAX_LORAS = 8
LOAD_S = 0.3
ZIPF_S = 1.2
CLIENTS = 4
TOKENS = 16
TOKENS_PER_S = 400.0
LLAMA_ADAPTERS = 5


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    loads: int = 0
    wall_s: float = 0.0
    failed: int = 0


def _peft(directory: Path) -> str:
    from tests.adapters_support import write_peft_lora

    return f"file://{write_peft_lora(directory)}"


def _profile(root: Path) -> Profile:
    adapters = [
        {"name": f"a{i:02d}", "base": "tiny", "source": _peft(root / f"a{i:02d}")} for i in range(ADAPTERS)
    ]
    args = ["--lora-load-time", str(LOAD_S), "--tokens-per-second", str(TOKENS_PER_S)]
    fields = {"name": "tiny", "engine": "sim", "model_path": "sim://tiny", "args": args}
    return msgspec.convert({**fields, "max_loras": MAX_LORAS, "adapters": adapters}, Profile)


def _draws(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** ZIPF_S for k in range(ADAPTERS)]
    return [f"a{i:02d}" for i in rng.choices(range(ADAPTERS), weights=weights, k=n)]


@contextlib.asynccontextmanager
async def _cluster(
    root: Path, engines: dict[str, object] | None = None
) -> AsyncIterator[tuple[Bus, Table, dict[str, ShardStatus]]]:
    nats = NatsServer(store_dir=root / "nats", sync_always=False)
    nats.start()
    try:
        options = BusOptions(url=nats.url, prefix="bench", insecure=True)
        async with await Bus.connect(options, service="bench") as bus:
            await bus.ensure()
            config = msgspec.convert(
                {
                    "node": "node-a",
                    "state_dir": str(root / "agent"),
                    "nats": {"url": nats.url, "prefix": "bench"},
                    "mgmt_addr": "127.0.0.1",
                    "health_interval_s": 0.3,
                    "engines": engines or {},
                },
                AgentConfig,
            )
            lbus = await Bus.connect(options, service="launcher-node-a")
            await prepare_node(lbus)
            launcher = Launcher(config, lbus, gpus=[])
            table = Table()
            statuses: dict[str, ShardStatus] = {}
            async with anyio.create_task_group() as tg:
                await tg.start(launcher.run)

                async def follow() -> None:
                    async for change in bus.watch(bus.names.shard_status_bucket, ShardStatus):
                        table.set_shard_status(change.key, change.value)
                        if change.value is not None:
                            statuses[change.key] = change.value

                tg.start_soon(follow)
                try:
                    yield bus, table, statuses
                finally:
                    tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                await launcher.stop_all()
                await lbus.close()
    finally:
        nats.stop()


async def _start(
    bus: Bus, table: Table, statuses: dict[str, ShardStatus], profile: Profile, replicas: int = REPLICAS
) -> None:
    for r in range(replicas):
        spec = msgspec.convert(
            {
                "replica": f"r{r}",
                "shard": f"chat-r{r}-0",
                "node": "node-a",
                "deployment": "chat",
                "profile": msgspec.to_builtins(profile),
                "profile_fp": profile.fingerprint(),
                "pool": "default",
            },
            ShardSpec,
        )
        await bus.put(bus.names.shards_bucket, f"node-a.chat-r{r}-0", spec)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = [s for s in statuses.values() if s.state == "ready"]
        if len(ready) == replicas:
            for s in ready:
                record = ReplicaRecord(
                    deployment="chat",
                    replica=s.replica,
                    profile="tiny",
                    profile_fp=profile.fingerprint(),
                    state="ready",
                    url=s.url,
                    engine=profile.engine,
                )
                table.set_replica(f"chat.{s.replica}", record)
            return
        await anyio.sleep(0.1)
    raise RuntimeError(f"the replicas did not start: {statuses}")


async def _ttft(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> float | None:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": TOKENS,
        "stream": True,
    }
    began = time.monotonic()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for _ in r.aiter_bytes():
            if first is None:
                first = time.monotonic() - began
    return first


def _holds(statuses: dict[str, ShardStatus], replica: str, adapter: str) -> bool:
    status = statuses.get(f"node-a.chat-{replica}-0")
    return status is not None and any(a.name == adapter for a in status.adapters)


async def _least_outstanding(
    bus: Bus, table: Table, statuses: dict[str, ShardStatus], client: httpx.AsyncClient, draws: list[str]
) -> Run:
    """Each request to the replica with the fewest in flight, its adapter loaded there first."""
    run = Run()
    in_flight = {f"r{r}": 0 for r in range(REPLICAS)}
    recent: dict[str, list[str]] = {r: [] for r in in_flight}
    locks = {r: anyio.Lock() for r in in_flight}
    queue = list(enumerate(draws))

    async def one(i: int, adapter: str) -> None:
        replica = min(sorted(in_flight), key=lambda r: in_flight[r])
        in_flight[replica] += 1
        try:
            began = time.monotonic()
            async with locks[replica]:
                if not _holds(statuses, replica, adapter):
                    run.loads += 1
                    request = AdapterLoad(
                        shard=f"chat-{replica}-0", adapter=adapter, recent=tuple(recent[replica])
                    )
                    reply = await bus.request(
                        load_subject("bench", "node-a"), request, AdapterLoaded, timeout=30
                    )
                    # Every adapter it holds busy: asked again once one ends, as the gateway does.
                    while reply.retryable:
                        await anyio.sleep(0.1)
                        reply = await bus.request(
                            load_subject("bench", "node-a"), request, AdapterLoaded, timeout=30
                        )
                    while reply.error == "" and not _holds(statuses, replica, adapter):
                        await anyio.sleep(0.01)
            recent[replica] = [adapter, *(a for a in recent[replica] if a != adapter)]
            url = table.replicas[f"chat.{replica}"].url
            waited = time.monotonic() - began
            ttft = await _ttft(client, url, adapter, f"question {i}")
            if ttft is None:
                run.failed += 1
            else:
                run.ttft.append(waited + ttft)
        finally:
            in_flight[replica] -= 1

    async def worker() -> None:
        while queue:
            i, adapter = queue.pop(0)
            await one(i, adapter)

    began = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(CLIENTS):
            tg.start_soon(worker)
    run.wall_s = time.monotonic() - began
    return run


async def _aware(url: str, loads: AdapterLoads, client: httpx.AsyncClient, draws: list[str]) -> Run:
    run = Run()
    before = loads.asked
    queue = list(enumerate(draws))

    async def worker() -> None:
        while queue:
            i, adapter = queue.pop(0)
            ttft = await _ttft(client, url, adapter, f"question {i}")
            if ttft is None:
                run.failed += 1
            else:
                run.ttft.append(ttft)

    began = time.monotonic()
    async with anyio.create_task_group() as tg:
        for _ in range(CLIENTS):
            tg.start_soon(worker)
    run.wall_s = time.monotonic() - began
    run.loads = loads.asked - before
    return run


def _p(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


async def measure(quick: bool) -> str:
    from tests.gateway_support import serve_proxy

    n = 120 if quick else 400
    draws = _draws(n, seed=7)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-adapters-") as tmp:
        root = Path(tmp)
        profile = _profile(root / "adapters")
        async with _cluster(root) as (bus, table, statuses):
            await _start(bus, table, statuses, profile)
            loads = AdapterLoads(bus, table, timeout_s=60)
            async with (
                httpx.AsyncClient(timeout=60) as client,
                Proxy(table, client, adapter_loads=loads) as proxy,
                anyio.create_task_group() as tg,
            ):
                proxy.loaded.set()
                url = f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}"
                # Cold start first, the replicas idle and empty.
                base = [t for t in [await _ttft(client, url, "chat", f"base {i}") for i in range(10)] if t]
                cold = [
                    t
                    for t in [
                        await _ttft(client, url, f"a{ADAPTERS - 1 - i:02d}", f"cold {i}") for i in range(5)
                    ]
                    if t
                ]
                aware = await _aware(url, loads, client, draws)
                tg.cancel_scope.cancel()
        # A second cluster for the other policy: both start from engines holding nothing.
        async with _cluster(root / "second") as (bus, table, statuses):
            await _start(bus, table, statuses, profile)
            async with httpx.AsyncClient(timeout=60) as client:
                least = await _least_outstanding(bus, table, statuses, client, draws)
    return _report(n, aware, least, base, cold)


async def llamacpp_cold() -> tuple[list[float], list[float]] | str:
    """On one real llama-server started by the launcher with LLAMA_ADAPTERS adapters: base
    TTFTs, then each adapter's first request's (the replica idle); or why it cannot run."""
    from bench import _llamacpp
    from tests.adapters_support import write_tiny_lora
    from tests.gateway_support import serve_proxy
    from tests.tiny_model import write_tiny_llama

    if why := _llamacpp.problem():
        return why
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-adapters-llama-") as tmp:
        root = Path(tmp)
        base_gguf = write_tiny_llama(root / "base.gguf")
        files = [write_tiny_lora(root / f"l{i}.gguf", seed=i) for i in range(LLAMA_ADAPTERS)]
        adapters = [{"name": f.stem, "base": "tiny", "source": f"file://{f}"} for f in files]
        fields = {"name": "tiny", "engine": "llamacpp", "model_path": str(base_gguf), "adapters": adapters}
        profile = msgspec.convert({**fields, "args": ["-c", "512", "-t", "1"]}, Profile)
        engines: dict[str, object] = {"llamacpp": {"path": str(_llamacpp.bin_dir())}}
        async with _cluster(root, engines) as (bus, table, statuses):
            await _start(bus, table, statuses, profile, replicas=1)
            async with (
                httpx.AsyncClient(timeout=60) as client,
                Proxy(table, client) as proxy,
                anyio.create_task_group() as tg,
            ):
                proxy.loaded.set()
                url = f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}"
                base = [t for t in [await _ttft(client, url, "chat", f"base {i}") for i in range(10)] if t]
                cold = [t for a in adapters if (t := await _ttft(client, url, str(a["name"]), "cold"))]
                tg.cancel_scope.cancel()
        return base, cold


def _cold_line(engine: str, base: list[float], cold: list[float]) -> str:
    base_p50 = statistics.median(base) if base else float("nan")
    cold_p50 = statistics.median(cold) if cold else float("nan")
    return (
        f"{engine}: a cold adapter's first request to first byte, replicas idle: median "
        f"{cold_p50 * 1000:.0f} ms over {len(cold)} adapters, against the base's TTFT median "
        f"{base_p50 * 1000:.0f} ms (target: at most base + 1 s; "
        f"{'met' if cold_p50 <= base_p50 + 1 else 'NOT met'})."
    )


def _report(n: int, aware: Run, least: Run, base: list[float], cold: list[float]) -> str:
    def row(name: str, run: Run) -> str:
        per_min = run.loads / run.wall_s * 60 if run.wall_s else 0.0
        return (
            f"| {name} | {run.loads} | {per_min:.0f} | {_p(run.ttft, 50) * 1000:.0f} | "
            f"{_p(run.ttft, 90) * 1000:.0f} | {run.wall_s:.1f} | {run.failed} |"
        )

    lines = [
        TITLE,
        "",
        f"{REPLICAS} simulated replicas of one base, max_loras {MAX_LORAS}, each adapter load "
        f"{LOAD_S:g} s in the engine; {ADAPTERS} adapters, {n} streamed chat requests drawn from a "
        f"Zipf law (s = {ZIPF_S}) over them, {CLIENTS} clients, {TOKENS} tokens each at "
        f"{TOKENS_PER_S:g} tokens/s. Loads: adapter loads into an engine (each unloads the least "
        "recently used where the engine is full).",
        "",
        "| routing | loads | loads/min | TTFT p50 ms | TTFT p90 ms | wall s | failed |",
        "|---|---|---|---|---|---|---|",
        row("adapter-aware (the gateway)", aware),
        row("least outstanding", least),
        "",
        _cold_line(f"Simulated engine (each load {LOAD_S:g} s)", base, cold),
        "",
    ]
    return "\n".join(lines)


def run(quick: bool = False) -> str:
    section = anyio.run(measure, quick)
    llama = anyio.run(llamacpp_cold)
    if isinstance(llama, str):
        return section + f"\nllama.cpp: not measured: {llama}.\n"
    return section + "\n" + _cold_line("llama.cpp (every adapter given at start)", *llama) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.adapters")
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--write", action="store_true", help="replace this section of BENCHMARKS.md")
    args = parser.parse_args()
    section = run(quick=args.quick)
    print(section)
    if args.write:
        from bench._report import write_alone

        write_alone(section, "python -m bench.adapters" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
