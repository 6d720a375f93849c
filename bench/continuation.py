"""Answers broken off mid-stream: continued on another replica against ended with an error,
and replicas drained: their streams handed over against run to their end.

Two sim engine processes (`--tokens-per-second`: a steady token rate) behind the gateway's
proxy in this process; clients stream chat answers back to back, each its own prompt, and
every KILL_EVERY_S seconds the replica with the most streams in flight is faulted:

- killed (SIGKILL) and started again on its port (the routing table keeps naming it, as
  placement would while it restarts in place);
- drained: its record turns `draining` in the routing table, as the replicas bucket's watcher
  writes it when placement drains a replica (`llmgw ctl drain`, a scale down); once nothing is
  in flight on it at the gateway (what placement waits for before it stops a draining
  replica) it is stopped (SIGTERM), started again and made `ready` again.

Each fault runs with continuation on (`routing: continuations: 2`) and off (0), the same load
and faults one after the other. The kill is also run on two real llama.cpp servers at
temperature 0 (`bench/_llamacpp.py`), their uncut answers asked of them first.

Per side: requests, those that failed (not 200, an error event, or no `[DONE]`), those whose
text differs from the uncut answer (the sim's words are a function of the prompt and their
place: the uncut text is known without asking), the streams continued, the seam's time
(from the break, or the drain seen, to the rest's first event, read from each `continuation`
span) against the mean time between tokens, and for a drain the time from `draining` to
nothing in flight on it.

`python -m bench.continuation [--quick]` runs this section alone, prints it and writes it to
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench import _llamacpp
from bench._report import write_alone
from bench.procs import terminate
from llmgw_core.events import ReplicaRecord
from llmgw_core.sim._words import _tokens
from llmgw_gateway import Proxy, Table
from llmgw_gateway.config import RoutingConfig

TITLE = "## Continuation: replicas killed or drained under streaming load"
TOKENS_PER_S = 40.0
MAX_TOKENS = 80  # 2 s answers
CLIENTS = 8
KILL_EVERY_S = 4.0
# Placement stops a draining replica at the autoscaler's drain_timeout_s whatever is in flight.
DRAIN_TIMEOUT_S = 30.0

# What a client asks (its n-th request) and the text the answer must be, uncut.
Ask = Callable[[int], tuple[dict[str, Any], str]]


def sim_ask(n: int) -> tuple[dict[str, Any], str]:
    messages = [{"role": "user", "content": f"question {n}"}]
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}
    return body, " ".join(_tokens(json.dumps(messages, sort_keys=True), MAX_TOKENS))


@dataclass
class Side:
    continuations: int
    fault: str = "kill"  # or "drain"
    requests: int = 0
    failed: int = 0
    differs: int = 0
    seams: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    kills: int = 0
    # Why requests failed, in a few words each.
    why: Counter[str] = field(default_factory=Counter)
    # Per drain: seconds from `draining` to nothing in flight on the replica at the gateway.
    drains: list[float] = field(default_factory=list)


class Engines:
    """Engines on fixed ports, each stopped and started again on its port at will: sim engines,
    or those `argv` (a port -> the command line) starts with `env`."""

    def __init__(
        self,
        n: int,
        argv: Callable[[int], list[str]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        from tests.test_sim_engine import free_port

        self.argv = argv or self._sim
        self.env = dict(env) if env is not None else None
        self.ports = [free_port() for _ in range(n)]
        self.procs = [self._start(port) for port in self.ports]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    @staticmethod
    def _sim(port: int) -> list[str]:
        argv = [sys.executable, "-m", "llmgw_core.sim", "--port", str(port), "--model", "tiny"]
        return [*argv, "--tokens-per-second", str(TOKENS_PER_S)]

    def _start(self, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            self.argv(port), env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def restart(self, i: int, how: signal.Signals = signal.SIGKILL) -> None:
        """Stopped by `how` (SIGTERM: as a launcher stops it, SIGKILL after 2 s), started again."""
        if how == signal.SIGKILL:
            os.kill(self.procs[i].pid, signal.SIGKILL)
            self.procs[i].wait()
        else:
            terminate(self.procs[i], grace_s=2)
        self.procs[i] = self._start(self.ports[i])

    def close(self) -> None:
        for proc in self.procs:
            terminate(proc, grace_s=2)


async def answering(client: httpx.AsyncClient, url: str, timeout: float = 60.0) -> None:
    """Once the engine at `url` answers `/health` 200; TimeoutError after `timeout` s."""
    from tests.gateway_support import answers_health

    deadline = time.monotonic() + timeout
    while not await answers_health(client, url):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine at {url} did not answer /health within {timeout:g} s")
        await anyio.sleep(0.05)


async def _llama_uncut(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as client:
        await answering(client, url)
        return await _llamacpp.uncut(client, url)


@asynccontextmanager
async def gateway(
    urls: list[str], continuations: int, spans: InMemorySpanExporter, engine: str = "sim"
) -> AsyncIterator[tuple[str, Table]]:
    from tests.gateway_support import serve_proxy

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    table = Table(routing=RoutingConfig(continuations=continuations))
    for i, url in enumerate(urls):
        record = ReplicaRecord(
            deployment="chat",
            replica=f"r{i}",
            profile="tiny",
            profile_fp="x",
            state="ready",
            url=url,
            engine=engine,
        )
        table.set_replica(f"chat.r{i}", record)
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:
            await answering(client, url)
        async with (
            Proxy(table, client, tracer=provider.get_tracer("bench")) as proxy,
            anyio.create_task_group() as tg,
        ):
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            yield f"http://127.0.0.1:{port}", table
            tg.cancel_scope.cancel()


async def _one(client: httpx.AsyncClient, base: str, ask: tuple[dict[str, Any], str], side: Side) -> None:
    body, uncut = ask
    pieces: list[str] = []
    done = False
    failed = ""
    last: float | None = None
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                # Whose refusal it is (the gateway's, or the engine's passed on) is in its words.
                said = (await r.aread())[-200:].decode(errors="replace")
                failed = f"status {r.status_code}: …{said[-90:]}"
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            # What the operator reads last: why it was not continued.
                            failed = f"error event: …{str(event['error'].get('message'))[-90:]}"
                        for choice in event.get("choices") or []:
                            if content := (choice.get("delta") or {}).get("content"):
                                now = time.monotonic()
                                if last is not None:
                                    side.gaps.append(now - last)
                                last = now
                                pieces.append(content)
    except httpx.HTTPError as exc:
        failed = f"{type(exc).__name__}"
    side.requests += 1
    if failed or not done:
        side.failed += 1
        side.why[failed or "no [DONE]"] += 1
    elif "".join(pieces) != uncut:
        side.differs += 1


async def _drain(engines: Engines, table: Table, i: int, client: httpx.AsyncClient) -> float:
    """Replica `i` drained as placement drains one: `draining` in the table, stopped once nothing
    is in flight on it (or at DRAIN_TIMEOUT_S), started again and `ready` once it answers.
    Returns the seconds from `draining` to nothing in flight."""
    key = f"chat.r{i}"
    record = table.replicas[key]
    began = time.monotonic()
    table.set_replica(key, msgspec.structs.replace(record, state="draining"))
    while table.outstanding[key] and time.monotonic() < began + DRAIN_TIMEOUT_S:
        await anyio.sleep(0.005)
    drained = time.monotonic() - began
    engines.restart(i, signal.SIGTERM)
    await answering(client, engines.urls[i])
    table.set_replica(key, record)
    return drained


async def _side(
    engines: Engines,
    continuations: int,
    duration_s: float,
    fault: str = "kill",
    ask: Ask = sim_ask,
    engine: str = "sim",
    clients: int = CLIENTS,
) -> Side:
    side = Side(continuations, fault)
    spans = InMemorySpanExporter()
    async with (
        gateway(engines.urls, continuations, spans, engine) as (base, table),
        httpx.AsyncClient(timeout=60) as client,
    ):
        counter = iter(range(1 << 30))
        deadline = time.monotonic() + duration_s

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _one(client, base, ask(next(counter)), side)

        async with anyio.create_task_group() as tg:
            for _ in range(clients):
                tg.start_soon(worker)
            while time.monotonic() < deadline - KILL_EVERY_S:
                await anyio.sleep(KILL_EVERY_S)
                # One replica down at a time: the last one faulted is back before the next fault.
                for url in engines.urls:
                    await answering(client, url)
                busiest = max(range(len(engines.ports)), key=lambda i: table.outstanding[f"chat.r{i}"])
                if fault == "drain":
                    side.drains.append(await _drain(engines, table, busiest, client))
                else:
                    engines.restart(busiest)
                side.kills += 1
    side.seams = [
        float(str(s.attributes["llmgw.continuation.seam_s"]))
        for s in spans.get_finished_spans()
        if s.name == "continuation" and s.attributes and "llmgw.continuation.seam_s" in s.attributes
    ]
    return side


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.0f} ms"


def _sides(duration: float) -> tuple[list[tuple[str, Side]], str]:
    """Every side, named by its replicas, and why the llama.cpp sides did not run ("" if they did)."""
    sides: list[tuple[str, Side]] = []
    engines = Engines(2)
    try:
        for fault in ("kill", "drain"):
            sides += [("sim", anyio.run(_side, engines, n, duration, fault)) for n in (2, 0)]
    finally:
        engines.close()
    if problem := _llamacpp.problem():
        return sides, problem
    with tempfile.TemporaryDirectory() as d:
        engines = Engines(2, _llamacpp.argv(_llamacpp.model(Path(d))), _llamacpp.env())
        try:
            ask = _llamacpp.ask(anyio.run(_llama_uncut, engines.urls[0]))
            for n in (2, 0):
                side = anyio.run(_side, engines, n, duration, "kill", ask, "llamacpp", _llamacpp.CLIENTS)
                sides.append(("llama.cpp", side))
        finally:
            engines.close()
    return sides, ""


def run(*, quick: bool = False) -> str:
    duration = 10.0 if quick else 30.0
    sides, llama_problem = _sides(duration)
    lines = [
        TITLE,
        "",
        f"2 sim replicas at {TOKENS_PER_S:g} tokens/s, {CLIENTS} clients streaming {MAX_TOKENS}-token chat "
        f"answers back to back for {duration:g} s a side; every {KILL_EVERY_S:g} s (once both answer "
        "`/health`) the replica with the most streams in flight is faulted: killed (SIGKILL) and started "
        "again on its port, or drained: its record turned `draining` in the gateway's routing table (as "
        "the replicas bucket's watcher writes it when placement drains a replica for `llmgw ctl drain` "
        "or a scale down), stopped (SIGTERM) once nothing is in flight on it at the gateway (what "
        f"placement waits for; at most {DRAIN_TIMEOUT_S:g} s), started again and `ready` again. "
        "The gateway's proxy in the benchmark's process; the same load and faults on each side, "
        "continuation on and off. The llama.cpp rows: 2 llama-server replicas (one thread, two slots) "
        f"of a tiny random model at temperature 0, {_llamacpp.CLIENTS} clients streaming "
        f"{_llamacpp.MAX_TOKENS}-token answers to {_llamacpp.PROMPTS} prompts in turn, each compared "
        "with the uncut answer asked of one server before the load. Drain time: from `draining` to "
        "nothing in flight on the replica, median (max).",
        "",
        "| replicas | fault | continuation | requests | failed (error event, not 200, cut) "
        "| text not the uncut answer | faults | continued | seam p50 | seam p99 | drain time "
        "| mean time between tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for replicas, side in sides:
        gap = f"{statistics.fmean(side.gaps) * 1000:.0f} ms" if side.gaps else "-"
        drain = f"{_ms(side.drains, 0.5)} ({_ms(side.drains, 1.0)})" if side.drains else "-"
        lines.append(
            f"| {replicas} | {'killed' if side.fault == 'kill' else 'drained'} | "
            f"{'on (2)' if side.continuations else 'off (0)'} | {side.requests} | {side.failed} | "
            f"{side.differs} | {side.kills} | {len(side.seams)} | {_ms(side.seams, 0.5)} | "
            f"{_ms(side.seams, 0.99)} | {drain} | {gap} |"
        )
    lines.append("")
    if llama_problem:
        lines += [f"The llama.cpp rows were not measured: {llama_problem}.", ""]
    for replicas, side in sides:
        name = f"{replicas}, {'killed' if side.fault == 'kill' else 'drained'}, continuation "
        name += "on" if side.continuations else "off"
        why = "; ".join(f"{n} x {reason}" for reason, n in side.why.most_common(4)) or "none"
        lines.append(f"- {name}: why requests failed: {why}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.continuation")
    parser.add_argument("--quick", action="store_true", help="10 s a side")
    args = parser.parse_args()
    section = run(quick=args.quick)
    print(section)
    write_alone(section, "python -m bench.continuation" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
