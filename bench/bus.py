"""What llmgw's bus client costs over raw nats-py: KV puts and JetStream publishes per second,
and what a control step's writes gain as one `Bus.commit` (atomic batches).

Both sides write the same bytes to the same server in the same run, one at a
time and 64 in flight; llmgw's side adds msgspec encoding, a message id and
trace headers, and its retry and error translation. Target: at least 0.9x raw.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio

from llmgw_core.bus import Bus, BusOptions, Writes
from llmgw_core.events import InstallProgress, encode
from llmgw_core.natsd import NatsServer

MSG = InstallProgress(node="gpu-01", engine="llamacpp", step="downloading", message="installing: x")


async def _rate(n: int, concurrency: int, one: Callable[[int], Awaitable[object]]) -> float:
    limiter = anyio.Semaphore(concurrency)

    async def go(i: int) -> None:
        async with limiter:
            await one(i)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(go, i)
    return n / (time.perf_counter() - start)


async def _measure(url: str, n: int) -> dict[tuple[str, int], tuple[float, float]]:
    bus = await Bus.connect(BusOptions(url=url, prefix="busbench", insecure=True), service="bench")
    async with bus:
        await bus.ensure()
        kv = await bus.kv(bus.names.nodes_bucket)
        data = encode(MSG)
        subject = bus.names.node_install("gpu-01")
        out = {}
        for concurrency in (1, 64):
            # Alternate raw and llmgw twice and keep each side's best: the machine is noisy.
            raw_put = llmgw_put = raw_pub = llmgw_pub = 0.0
            for _ in range(2):
                raw_put = max(raw_put, await _rate(n, concurrency, lambda i: kv.put(f"k{i % 100}", data)))
                llmgw_put = max(
                    llmgw_put,
                    await _rate(
                        n, concurrency, lambda i: bus.put(bus.names.nodes_bucket, f"k{i % 100}", MSG)
                    ),
                )
                raw_pub = max(raw_pub, await _rate(n, concurrency, lambda i: bus.js.publish(subject, data)))
                llmgw_pub = max(llmgw_pub, await _rate(n, concurrency, lambda i: bus.publish(subject, MSG)))
            out[("KV put", concurrency)] = (raw_put, llmgw_put)
            out[("JetStream publish", concurrency)] = (raw_pub, llmgw_pub)
        # A control step's many writes: `Bus.commit` (atomic batches of up to 500 per stream)
        # against the same puts through raw nats-py, 64 in flight.
        raw_many = many = 0.0
        for _ in range(2):
            raw_many = max(raw_many, await _rate(n, 64, lambda i: kv.put(f"k{i % 100}", data)))
            writes = Writes()
            for i in range(n):
                writes.put(bus.names.nodes_bucket, f"k{i % 100}", MSG)
            start = time.perf_counter()
            await bus.commit(writes)
            many = max(many, n / (time.perf_counter() - start))
        out[("KV put, one step's writes as `Bus.commit`", n)] = (raw_many, many)
        return out


def run(quick: bool = False) -> str:
    n = 300 if quick else 2000
    with tempfile.TemporaryDirectory() as d:
        server = NatsServer(store_dir=Path(d), max_store="8G")
        server.start()
        try:
            results = anyio.run(_measure, server.url, n)
        finally:
            server.stop()
    lines = [
        "## The bus client's overhead",
        "",
        f"`python -m bench`: {n} acknowledged writes per row to a local nats-server "
        "(`sync_interval: always`), raw nats-py against `llmgw_core.bus` in the same run "
        "(best of two alternating rounds). Target: 0.9x or better.",
        "",
        "| operation | in flight | raw nats-py (/s) | llmgw bus (/s) | ratio |",
        "|---|---|---|---|---|",
    ]
    for (op, concurrency), (raw, ours) in results.items():
        lines.append(f"| {op} | {concurrency} | {raw:,.0f} | {ours:,.0f} | {ours / raw:.2f}x |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
