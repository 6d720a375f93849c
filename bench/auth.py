"""What authentication costs: acknowledged KV puts per second by a node's own identity, through
nats-server's permission checks, against the same puts on a server without authentication."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import anyio

from llmgw.auth import AuthDir
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import InstallProgress
from llmgw_core.natsd import NatsServer


async def _puts(url: str, auth: AuthDir | None, n: int) -> float:
    def options(identity: str) -> BusOptions:
        if auth is None:
            return BusOptions(url=url, prefix="bench", insecure=True)
        return BusOptions(url=url, prefix="bench", nkey_seed_file=str(auth.seed(identity)))

    async with await Bus.connect(options("placement"), service="placement") as placement:
        await placement.ensure()
    async with await Bus.connect(options("node-gpu-01"), service="installer-gpu-01") as bus:
        msg = InstallProgress(node="gpu-01", engine="llamacpp", step="downloading", message="installing: x")
        await bus.put(bus.names.nodes_bucket, "gpu-01", msg)
        start = time.perf_counter()
        for _ in range(n):
            await bus.put(bus.names.nodes_bucket, "gpu-01", msg)
        return n / (time.perf_counter() - start)


def _once(secure: bool, n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        auth = AuthDir(Path(d) / "auth")
        auth.init(["gpu-01"], prefix="bench")
        server = NatsServer(store_dir=Path(d) / "nats", includes=(auth.conf,) if secure else ())
        server.start()
        try:
            return anyio.run(_puts, server.url, auth if secure else None, n)
        finally:
            server.stop()


def run(quick: bool = False) -> str:
    n = 300 if quick else 2000
    rounds = 1 if quick else 5
    labels = {False: "no authentication (--insecure)", True: "a node's nkey, its permissions"}
    samples: dict[bool, list[float]] = {False: [], True: []}
    # Alternated, so that a busy moment of the machine falls on both; the median of the rounds.
    for _ in range(rounds):
        for secure in (False, True):
            samples[secure].append(_once(secure, n))
    rates = {labels[k]: statistics.median(v) for k, v in samples.items()}
    base, secured = rates.values()
    lines = [
        "## Authentication: a node's KV writes per second",
        "",
        f"`python -m bench` ({n} sequential acknowledged puts of the node's own status, one client, "
        f"`sync_interval: always`; median of {rounds} alternated rounds):",
        "",
        "| nats-server | puts/s | relative |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {rate:,.0f} | {rate / base:.2f}x |" for label, rate in rates.items()]
    lines += [
        "",
        f"Identities and permissions change write throughput by {100 * (secured / base - 1):+.0f}% here.",
        "",
    ]
    return "\n".join(lines)
