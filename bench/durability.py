"""What `sync_interval: always` costs: KV puts per second with fsync on every write vs NATS's default."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import anyio

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import InstallProgress
from llmgw_core.natsd import NatsServer


async def _puts(url: str, n: int) -> float:
    bus = await Bus.connect(BusOptions(url=url, prefix="bench", insecure=True), service="bench")
    async with bus:
        await bus.ensure()
        msg = InstallProgress(node="gpu-01", engine="llamacpp", step="downloading", message="installing: x")
        start = time.perf_counter()
        for i in range(n):
            await bus.put(bus.names.nodes_bucket, f"node-{i % 100}", msg)
        return n / (time.perf_counter() - start)


def run(quick: bool = False) -> str:
    n = 300 if quick else 2000
    rates: dict[str, float] = {}
    for label, always in (("default (fsync every 2 min)", False), ("sync_interval: always", True)):
        with tempfile.TemporaryDirectory() as d:
            server = NatsServer(store_dir=Path(d), sync_always=always)
            server.start()
            try:
                rates[label] = anyio.run(_puts, server.url, n)
            finally:
                server.stop()
    base = rates["default (fsync every 2 min)"]
    safe = rates["sync_interval: always"]
    lines = [
        "## Durability: KV writes per second",
        "",
        f"`python -m bench` ({n} sequential acknowledged puts to one bucket, one client):",
        "",
        "| nats-server setting | puts/s | relative |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {rate:,.0f} | {rate / base:.2f}x |" for label, rate in rates.items()]
    lines += [
        "",
        f"`sync_interval: always` costs {100 * (1 - safe / base):.0f}% of write throughput here.",
        "",
    ]
    return "\n".join(lines)
