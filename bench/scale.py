"""Placement at scale with every part its own process: throughput to ready, and mass failover.

`llmgw-placement` and `llmgw fleet --shard i/N` processes run against a local
nats-server (`sync_interval: always`); this process writes the deployment and
watches the replicas bucket. Placement's CPU comes from /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import msgspec
import nats.errors
from nats.aio.msg import Msg

from bench.launcher import read_profile, start_profile, stop_profile
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    Liveness,
    PlacementDecision,
    ReplicaRecord,
    decoder,
)
from llmgw_core.natsd import NatsServer
from llmgw_placement.config import ServerConfig

TICK = os.sysconf("SC_CLK_TCK")
TP2 = {"name": "tp2", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 2}


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Processes:
    def __init__(self, root: Path, url: str, prefix: str) -> None:
        self.root, self.url, self.prefix = root, url, prefix
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.env = {**os.environ, "LLMGW_NATS_URL": url, "LLMGW_NATS_INSECURE": "1"}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = (self.root / f"{name}.log").open("wb")
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.procs[name] = proc
        return proc

    def placement(self, node_timeout_s: float) -> subprocess.Popen[bytes]:
        config = msgspec.convert(
            {
                "nats": {"url": self.url, "prefix": self.prefix, "insecure": True},
                "engines": [],
                "catalog": [TP2],
                "http": {"host": "127.0.0.1", "port": 0, "insecure": True},
                "node_timeout_s": node_timeout_s,
            },
            ServerConfig,
        )
        path = self.root / f"server-{self.prefix}.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        return self.start("placement", [sys.executable, "-m", "llmgw_placement", "--config", str(path)])

    def fleet(self, nodes: int, parts: int) -> None:
        llmgw = str(Path(sys.executable).parent / "llmgw")
        for i in range(parts):
            self.start(
                f"fleet-{i}",
                [llmgw, "fleet", "--nodes", str(nodes), "--prefix", self.prefix, "--shard", f"{i}/{parts}"],
            )

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def _placement_hears(bus: Bus, nodes: int) -> None:
    """Until placement itself lists every node alive (not just the bucket holding them)."""
    with anyio.fail_after(300):
        while True:
            try:
                reply = await bus.nc.request(bus.names.liveness_request, b"", timeout=5)
                live = decoder(Liveness).decode(reply.data)
                if live.leader and sum(1 for n in live.nodes if n.alive) == nodes:
                    return
            except (nats.errors.Error, msgspec.DecodeError):
                pass
            await anyio.sleep(1)


async def _ready(bus: Bus) -> dict[str, ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return {k: c.value for k, c in found.items() if c.value is not None and c.value.state == "ready"}


async def _placed_events(bus: Bus) -> Counter[str]:
    decisions = await bus.history(bus.names.placement_event("*"), PlacementDecision, idle_s=2.0)
    return Counter(f"{d.deployment}.{d.replica}" for d in decisions if d.outcome == "placed")


async def throughput(
    root: Path, url: str, nats_pid: int, nodes: int, replicas: int, parts: int, profile: bool = False
) -> dict[str, Any]:
    prefix = f"scale{nodes}"
    procs = Processes(root, url, prefix)
    async with await Bus.connect(BusOptions(url=url, prefix=prefix, insecure=True), service="bench") as bus:
        await bus.ensure()
        try:
            placement = procs.placement(node_timeout_s=10.0)
            procs.fleet(nodes, parts)
            await _placement_hears(bus, nodes)
            # The end is placement's own `DeploymentStatus` saying every replica is ready
            # (published after the records are written); the bucket is then read to check it.
            # Reading 10,000 records in a loop instead would load the machine and round the
            # time up to the next read.
            all_ready = anyio.Event()
            ended = 0.0

            async def on_status(msg: Msg) -> None:
                nonlocal ended
                status = decoder(DeploymentStatus).decode(msg.data)
                if status.ready == replicas and not all_ready.is_set():
                    ended = time.monotonic()
                    all_ready.set()

            sub = await bus.nc.subscribe(bus.names.deployment_event("chat"), cb=on_status)
            fleet = [p.pid for name, p in procs.procs.items() if name.startswith("fleet-")]
            cpu0 = _cpu_s(placement.pid)
            others0 = (sum(map(_cpu_s, fleet)), _cpu_s(nats_pid), _cpu_s(os.getpid()))
            spy_out = root / f"placement-{nodes}.pyspy"
            spy = start_profile(placement.pid, spy_out) if profile else None
            await anyio.sleep(1.0 if spy else 0)  # py-spy attaches
            t0 = time.monotonic()
            await bus.put(
                bus.names.deployments_bucket,
                "chat",
                Deployment(name="chat", profile="tp2", replicas=replicas),
            )
            with anyio.fail_after(900):
                await all_ready.wait()
            stop_profile(spy)
            elapsed = ended - t0
            spent = time.monotonic() - t0
            cpu = (_cpu_s(placement.pid) - cpu0) / spent
            fleet_cpu, nats_cpu, bench_cpu = (
                (after - before) / spent
                for after, before in zip(
                    (sum(map(_cpu_s, fleet)), _cpu_s(nats_pid), _cpu_s(os.getpid())), others0, strict=True
                )
            )
            await sub.unsubscribe()
            ready = await _ready(bus)
            if len(ready) != replicas:
                raise RuntimeError(f"bench: placement said {replicas} ready, the bucket holds {len(ready)}")
            placed = await _placed_events(bus)
            return {
                "elapsed_s": elapsed,
                "per_s": replicas / elapsed,
                "placement_cores": cpu,
                "fleet_cores": fleet_cpu,
                "nats_cores": nats_cpu,
                "bench_cores": bench_cpu,
                "placements": float(sum(placed.values())),
                "profile": read_profile(spy_out, placement.pid, elapsed) if spy else None,
            }
        finally:
            procs.stop()


async def failover(root: Path, url: str, nodes: int, parts: int, replicas: int) -> dict[str, float]:
    """Binpack puts `replicas` TP=2 replicas on the first nodes, which are the first fleet
    process's; killing that process takes them all at once."""
    prefix = f"failover{nodes}"
    procs = Processes(root, url, prefix)
    node_timeout = 5.0
    async with await Bus.connect(BusOptions(url=url, prefix=prefix, insecure=True), service="bench") as bus:
        await bus.ensure()
        try:
            procs.placement(node_timeout_s=node_timeout)
            procs.fleet(nodes, parts)
            await _placement_hears(bus, nodes)
            await bus.put(
                bus.names.deployments_bucket,
                "chat",
                Deployment(name="chat", profile="tp2", replicas=replicas),
            )
            with anyio.fail_after(300):
                while len(ready := await _ready(bus)) < replicas:
                    await anyio.sleep(0.5)
            dying = {n for r in ready.values() for m in r.members for n in [m.node]}
            per_part = -(-nodes // parts)
            first_part = {f"sim-{i:05d}" for i in range(per_part)}
            assert dying <= first_part, (
                f"binpack filled the first fleet process's nodes: {sorted(dying - first_part)[:5]}"
            )
            t0 = time.monotonic()
            procs.kill("fleet-0")
            with anyio.fail_after(300):
                while True:
                    ready = await _ready(bus)
                    if len(ready) == replicas and not any(
                        m.node in first_part for r in ready.values() for m in r.members
                    ):
                        break
                    await anyio.sleep(0.2)
            elapsed = time.monotonic() - t0
            placed = await _placed_events(bus)
            return {
                "elapsed_s": elapsed,
                "node_timeout_s": node_timeout,
                "dead_nodes": float(len(first_part)),
                "placements": float(sum(placed.values())),
                "twice": float(sum(1 for n in placed.values() if n > 1)),
            }
        finally:
            procs.stop()


def run(quick: bool = False) -> str:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        server = NatsServer(store_dir=root / "nats", max_store="64G")
        server.start()
        try:
            sizes = ((500, 1000, 1), (1000, 2000, 2)) if quick else ((500, 1000, 1), (5000, 10_000, 4))
            assert server.proc is not None
            rows = [
                (n, r, anyio.run(throughput, root, server.url, server.proc.pid, n, r, p, i == len(sizes) - 1))
                for i, (n, r, p) in enumerate(sizes)
            ]
            fo = anyio.run(failover, root, server.url, 1000, 10, 400)
        finally:
            server.stop()
    lines = [
        "## Placement end to end, every part its own process",
        "",
        "`python -m bench`: `llmgw-placement` and `llmgw fleet --shard i/N` processes over a local "
        "nats-server (`sync_interval: always`); one deployment of TP=2 sim replicas is written and "
        "timed until every replica is `ready` in the replicas bucket. The first row is the baseline. "
        "Targets: 10,000 replicas on 5,000 nodes at 1,000 replicas/s or more, placement under 1 core "
        "(anchors: Kubernetes scheduler_perf asks 680 pods/s at 5,000 nodes; Nomad's C1M placed "
        "about 3,750/s with 5 servers).",
        "",
        "| nodes | replicas | fleet processes | to all ready (s) | replicas/s | placement cores "
        "| fleet cores | nats-server cores | placements |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (n, r, p), (_, _, f) in zip(sizes, rows, strict=True):
        lines.append(
            f"| {n} | {r} | {p} | {f['elapsed_s']:.1f} | {f['per_s']:.0f} | {f['placement_cores']:.2f} | "
            f"{f['fleet_cores']:.2f} | {f['nats_cores']:.2f} | {f['placements']:.0f} |"
        )
    big = rows[-1][2]
    shares = {
        "placement": big["placement_cores"],
        "the simulated fleet (every node's launcher and installer, answering each shard)": big["fleet_cores"],
        "nats-server": big["nats_cores"],
        "this benchmark": big["bench_cores"],
    }
    busiest = max(shares, key=lambda k: shares[k])
    lines += [
        "",
        f"At {rows[-1][0]:,} nodes: {big['per_s']:,.0f} replicas/s, {big['per_s'] / 3750:.2f}x Nomad's "
        f"3,750/s and {big['per_s'] / 680:.2f}x Kubernetes' 680/s. Over the run the machine's "
        f"{os.cpu_count()} cores went to "
        + ", ".join(f"{k} {v:.2f}" for k, v in shares.items())
        + f" (in cores); {sum(shares.values()):.2f} of {os.cpu_count()} in all, the most to {busiest}.",
    ]
    prof = big["profile"]
    if prof is not None and prof.samples:
        shown = [
            (fn, c)
            for fn, c in prof.inclusive
            if "llmgw" in fn
            and "__main__.py" not in fn
            and not fn.startswith(("<module>", "Attempts.run", "Retry.attempt"))
        ][:14]
        lines += [
            "",
            f"Profile of placement over that run (py-spy, 100 Hz, `--nonblocking`, its event loop): busy in "
            f"{prof.samples} of {prof.expected} samples ({100 * prof.samples / max(1, prof.expected):.0f}%). "
            "llmgw's functions by samples they were on the stack for, then the functions the samples "
            "were in:",
            "",
            "```",
            *(f"{100 * c / prof.samples:5.1f}%  {fn}" for fn, c in shown),
            "--- own",
            *(f"{100 * c / prof.samples:5.1f}%  {fn}" for fn, c in prof.own),
            "```",
        ]
    elif prof is None:
        lines += ["", "(No profile: py-spy is not installed; it is in the dev group.)"]
    lines += [
        "",
        "## Mass failover",
        "",
        f"1,000 fleet nodes in 10 processes; 400 TP=2 replicas, binpacked onto the first process's "
        f"{fo['dead_nodes']:.0f} nodes; that process is killed (`kill -9`). Target: all ready elsewhere "
        f"within node_timeout + 5 s = {fo['node_timeout_s'] + 5:.0f} s, no replica placed twice.",
        "",
        "| from kill to all 400 ready elsewhere (s) | node_timeout (s) | placements in all "
        "| replica ids placed twice |",
        "|---|---|---|---|",
        f"| {fo['elapsed_s']:.1f} | {fo['node_timeout_s']:.0f} | {fo['placements']:.0f} "
        f"| {fo['twice']:.0f} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
