"""Answers broken off mid-stream: continued on another replica against ended with an error.

Two sim engine processes (`--tokens-per-second`: a steady token rate) behind the gateway's
proxy in this process; clients stream chat answers back to back, each its own prompt, and
every KILL_EVERY_S seconds the replica with the most streams in flight is killed (SIGKILL)
and started again on its port (the routing table keeps naming it, as placement would while
it restarts in place). Both sides run the same load and kills, one after the other:
continuation on (`routing: continuations: 2`) and off (0).

Per side: requests, those that failed (not 200, an error event, or no `[DONE]`), those whose
text differs from the uncut answer (the sim's words are a function of the prompt and their
place: the uncut text is known without asking), the streams continued, and the seam's time
(from the break to the rest's first event, read from each `continuation` span) against the
mean time between tokens.

`python -m bench.continuation [--quick]` runs this section alone and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import httpx
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bench.procs import terminate
from llmgw_core.events import ReplicaRecord
from llmgw_core.sim._words import _tokens
from llmgw_gateway import Proxy, Table
from llmgw_gateway.config import RoutingConfig

TITLE = "## Continuation: replicas killed under streaming load"
TOKENS_PER_S = 40.0
MAX_TOKENS = 80  # 2 s answers
CLIENTS = 8
KILL_EVERY_S = 4.0


@dataclass
class Side:
    continuations: int
    requests: int = 0
    failed: int = 0
    differs: int = 0
    seams: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    kills: int = 0
    # Why requests failed, in a few words each.
    why: Counter[str] = field(default_factory=Counter)


class Engines:
    """Sim engines on fixed ports, each killed and started again on its port at will."""

    def __init__(self, n: int) -> None:
        from tests.test_sim_engine import free_port

        self.ports = [free_port() for _ in range(n)]
        self.procs = [self._start(port) for port in self.ports]

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def _start(self, port: int) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "llmgw_core.sim", "--port", str(port), "--model", "tiny"]
        argv += ["--tokens-per-second", str(TOKENS_PER_S)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def restart(self, i: int) -> None:
        os.kill(self.procs[i].pid, signal.SIGKILL)
        self.procs[i].wait()
        self.procs[i] = self._start(self.ports[i])

    def close(self) -> None:
        for proc in self.procs:
            terminate(proc, grace_s=2)


@asynccontextmanager
async def gateway(
    urls: list[str], continuations: int, spans: InMemorySpanExporter
) -> AsyncIterator[tuple[str, Table]]:
    from tests.gateway_support import answers_health, serve_proxy
    from tests.waiting import eventually

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
            engine="sim",
        )
        table.set_replica(f"chat.r{i}", record)
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:
            await eventually(lambda url=url: answers_health(client, url), timeout=60, interval=0.1)
        async with (
            Proxy(table, client, tracer=provider.get_tracer("bench")) as proxy,
            anyio.create_task_group() as tg,
        ):
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            yield f"http://127.0.0.1:{port}", table
            tg.cancel_scope.cancel()


async def _one(client: httpx.AsyncClient, base: str, n: int, side: Side) -> None:
    messages = [{"role": "user", "content": f"question {n}"}]
    body = {"model": "chat", "messages": messages, "max_tokens": MAX_TOKENS, "stream": True}
    pieces: list[str] = []
    done = False
    failed = ""
    last: float | None = None
    try:
        async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            failed = "" if r.status_code == 200 else f"status {r.status_code}"
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
    elif "".join(pieces) != " ".join(_tokens(json.dumps(messages, sort_keys=True), MAX_TOKENS)):
        side.differs += 1


async def _side(engines: Engines, continuations: int, duration_s: float) -> Side:
    from tests.gateway_support import answers_health
    from tests.waiting import eventually

    side = Side(continuations)
    spans = InMemorySpanExporter()
    async with (
        gateway(engines.urls, continuations, spans) as (base, table),
        httpx.AsyncClient(timeout=60) as client,
    ):
        counter = iter(range(1 << 30))
        deadline = time.monotonic() + duration_s

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _one(client, base, next(counter), side)

        async with anyio.create_task_group() as tg:
            for _ in range(CLIENTS):
                tg.start_soon(worker)
            while time.monotonic() < deadline - KILL_EVERY_S:
                await anyio.sleep(KILL_EVERY_S)
                # One replica down at a time: the last one killed is back before the next kill.
                for url in engines.urls:
                    await eventually(lambda url=url: answers_health(client, url), timeout=60, interval=0.05)
                busiest = max(range(len(engines.ports)), key=lambda i: table.outstanding[f"chat.r{i}"])
                engines.restart(busiest)
                side.kills += 1
    side.seams = [
        float(s.attributes["llmgw.continuation.seam_s"])
        for s in spans.get_finished_spans()
        if s.name == "continuation" and s.attributes and "llmgw.continuation.seam_s" in s.attributes
    ]
    return side


def _ms(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.0f} ms"


def run(*, quick: bool = False) -> str:
    duration = 10.0 if quick else 30.0
    engines = Engines(2)
    try:
        sides = [anyio.run(_side, engines, n, duration) for n in (2, 0)]
    finally:
        engines.close()
    lines = [
        TITLE,
        "",
        f"2 sim replicas at {TOKENS_PER_S:g} tokens/s, {CLIENTS} clients streaming {MAX_TOKENS}-token chat "
        f"answers back to back for {duration:g} s a side; every {KILL_EVERY_S:g} s (once both answer "
        "`/health`) the replica with the most streams in flight is killed (SIGKILL) and started again on "
        "its port. The gateway's proxy "
        "in the benchmark's process; the same load and kills on each side.",
        "",
        "| continuation | requests | failed (error event, not 200, cut) | text not the uncut answer | kills "
        "| continued | seam p50 | seam p99 | mean time between tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for side in sides:
        gap = f"{statistics.fmean(side.gaps) * 1000:.0f} ms" if side.gaps else "-"
        lines.append(
            f"| {'on (2)' if side.continuations else 'off (0)'} | {side.requests} | {side.failed} | "
            f"{side.differs} | {side.kills} | {len(side.seams)} | {_ms(side.seams, 0.5)} | "
            f"{_ms(side.seams, 0.99)} | {gap} |"
        )
    lines.append("")
    for side in sides:
        name = "on" if side.continuations else "off"
        why = "; ".join(f"{n} x {reason}" for reason, n in side.why.most_common(4)) or "none"
        lines.append(f"- continuation {name}, why requests failed: {why}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.continuation")
    parser.add_argument("--quick", action="store_true", help="10 s a side")
    args = parser.parse_args()
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
