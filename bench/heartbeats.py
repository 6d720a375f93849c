"""Liveness at scale: N fleet nodes heartbeating at 1 Hz to a placement process.

Placement and the fleet run as separate processes (`llmgw-placement`,
`llmgw fleet`) over a local nats-server. For the measured window the
benchmark samples placement's CPU (from /proc) and memory, times
`GET /api/nodes` (the request until its last byte is in; the client's own
JSON parsing is not placement's time), and counts nodes that placement ever
reported lost. Then, the fleet still heartbeating, it times `llmgw ctl get
nodes` as an operator runs it: a fresh process, to the same NATS, whose
table must list every node alive. The baseline row is 1,000 nodes in the
same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from bench.procs import terminate
from llmgw_core.natsd import NatsServer
from llmgw_placement.config import ServerConfig

TICK = os.sysconf("SC_CLK_TCK")
CTL_RUNS = 3


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _measure(root: Path, url: str, nodes: int, window_s: float) -> dict[str, float]:
    prefix = f"hb{nodes}"
    api_port = 18000 + nodes % 1000
    config = msgspec.convert(
        {
            "nats": {"url": url, "prefix": prefix, "insecure": True},
            "engines": [],
            "http": {"host": "127.0.0.1", "port": api_port, "insecure": True},
            "heartbeat_interval_s": 1.0,
            "node_timeout_s": 5.0,
        },
        ServerConfig,
    )
    path = root / f"server-{nodes}.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    env = {**os.environ, "LLMGW_NATS_URL": url, "LLMGW_NATS_INSECURE": "1"}
    logs = (root / f"placement-{nodes}.log").open("wb")
    placement = subprocess.Popen(
        [sys.executable, "-m", "llmgw_placement", "--config", str(path)],
        stdout=logs,
        stderr=subprocess.STDOUT,
        env=env,
    )
    fleet = subprocess.Popen(
        [str(Path(sys.executable).parent / "llmgw"), "fleet", "--nodes", str(nodes), "--prefix", prefix],
        stdout=subprocess.DEVNULL,
        stderr=(root / f"fleet-{nodes}.log").open("wb"),
        env=env,
    )
    try:
        api = f"http://127.0.0.1:{api_port}/api/nodes"
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=10) as client:
            while True:
                try:
                    listed = client.get(api).json()
                    if len(listed) == nodes and all(n["alive"] for n in listed):
                        break
                except (httpx.HTTPError, json.JSONDecodeError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{nodes} nodes never all listed alive")
                time.sleep(1)
            cpu0, t0 = _cpu_s(placement.pid), time.monotonic()
            lost: set[str] = set()
            latencies = []
            rss = 0.0
            while time.monotonic() - t0 < window_s:
                started = time.perf_counter()
                response = client.get(api)
                latencies.append(time.perf_counter() - started)
                listed = response.json()
                lost |= {n["node"] for n in listed if not n["alive"]}
                rss = max(rss, _rss_mb(placement.pid))
                time.sleep(1)
            cpu = (_cpu_s(placement.pid) - cpu0) / (time.monotonic() - t0)
        ctl = _ctl_get_nodes(url, prefix, nodes, lost)
        latencies.sort()
        dropped = (root / f"placement-{nodes}.log").read_text(errors="replace").count("dropping")
        return {
            "cpu": cpu,
            "rss_mb": rss,
            "api_p50_ms": latencies[len(latencies) // 2] * 1000,
            "api_max_ms": latencies[-1] * 1000,
            "ctl_p50_s": ctl[len(ctl) // 2],
            "ctl_max_s": ctl[-1],
            "lost": float(len(lost)),
            "dropped": float(dropped),
        }
    finally:
        for proc in (fleet, placement):
            terminate(proc)


def _ctl_get_nodes(url: str, prefix: str, nodes: int, lost: set[str]) -> list[float]:
    """Seconds each `llmgw ctl get nodes` took, sorted; adds the nodes its table calls lost.

    An installed llmgw has its bytecode compiled (pip does it at install; otherwise Python
    writes it on the first run): a PYTHONDONTWRITEBYTECODE in this environment would make
    every run compile all of it again, which no operator's shell does. The first run, not
    timed, leaves the bytecode and the page cache as an operator's next run finds them."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    argv = [str(Path(sys.executable).parent / "llmgw"), "ctl", "--nats-url", url, "--prefix", prefix]
    argv += ["--insecure", "get", "nodes"]
    times = []
    for i in range(CTL_RUNS + 1):
        started = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        took = time.perf_counter() - started
        if done.returncode != 0:
            raise RuntimeError(f"llmgw ctl get nodes exited {done.returncode}: {done.stderr.strip()}")
        rows = done.stdout.splitlines()[1:]
        if len(rows) != nodes:
            raise RuntimeError(f"llmgw ctl get nodes listed {len(rows)} nodes of {nodes}")
        lost |= {r.split()[0] for r in rows if r.split()[1] != "alive"}
        if i:
            times.append(took)
    return sorted(times)


def run(quick: bool = False) -> str:
    sizes = (1000, 2000) if quick else (1000, 10_000)
    window = 10.0 if quick else 30.0
    rows = []
    with tempfile.TemporaryDirectory() as d:
        server = NatsServer(store_dir=Path(d) / "nats", max_store="64G")
        server.start()
        try:
            results = [(n, _measure(Path(d), server.url, n, window)) for n in sizes]
        finally:
            server.stop()
    for n, f in results:
        rows.append(
            f"| {n} | {f['cpu']:.2f} | {f['rss_mb']:.0f} | {f['api_p50_ms']:.0f} / {f['api_max_ms']:.0f} | "
            f"{f['ctl_p50_s']:.2f} / {f['ctl_max_s']:.2f} | {f['lost']:.0f} | {f['dropped']:.0f} |"
        )
    return "\n".join(
        [
            "## Liveness at scale (placement and fleet as separate processes)",
            "",
            f"`python -m bench`: `llmgw fleet --nodes N` heartbeats every node once a second, spread over "
            f"the second, to an `llmgw-placement` process; measured over {window:g} s once every node is "
            "listed alive (`/api/nodes`: the request until its last byte is in), then `llmgw ctl get nodes` "
            f"run {CTL_RUNS} times as an operator runs it (a fresh process each, bytecode compiled as an "
            "install leaves it; after one untimed run), the fleet still heartbeating. Targets at 10,000 "
            "nodes: placement under 0.5 core and 1 GiB, `/api/nodes` under 200 ms, `ctl get nodes` under "
            "2 s, no node lost, no heartbeat dropped. The 1,000-node row is the baseline of the same run.",
            "",
            "| nodes | placement cores | placement RSS (MB) | /api/nodes p50 / max (ms) | "
            "ctl get nodes p50 / max (s) | nodes ever lost | heartbeats dropped |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
