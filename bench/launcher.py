"""The launcher under load, with real processes: nats-server (`sync_interval: always`), placement,
one node agent (installer + launcher, 64 simulated GPUs) and sim engines at `--load-time 0`.

1. The floor: N bare sim engines started together, each timed from the burst's start to its
   first 200 on /health (probed every 0.1 s, as the launcher probes a loading engine).
2. The burst: N one-replica deployments written at once, each timed from its write to the
   replica's `ready` event (placement's verdict), to its shard's `starting` and `ready`; the
   launcher's heartbeat gaps seen by a subscriber. Then a py-spy profile of the launcher in a
   second burst of the same size, untimed (the profiler's CPU would weigh on the first).
3. The floor again, so that load that came and went on the shared machine weighs on both sides.
4. Idle: M ready shards on the node, written straight into the shards bucket (placement stopped):
   the launcher's CPU over a window, the CPU of one probe (httpx's pooled client against the
   launcher's prober, same engines), and the time from SIGKILL of an engine to its `failed` event.

`python -m bench.launcher [--quick]` runs this section alone.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
from nats.aio.msg import Msg

from bench.procs import terminate
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.events import Deployment, Heartbeat, ReplicaStatus, ShardStatus, decoder
from llmgw_core.natsd import NatsServer
from llmgw_launcher.health import HealthProber
from llmgw_launcher.procs import lower_priority
from llmgw_launcher.records import Records
from llmgw_placement.config import ServerConfig

NODE = "bench-node"
GPUS = 64
HEARTBEAT_S = 0.25  # short, so that a stall of the launcher's loop shows as a late beat
HEALTH_S = 1.0  # the default health interval
LOADING_PROBE_S = 0.1  # as the launcher probes a loading engine
LATE = 1.5  # a heartbeat gap above LATE x the interval is late
TICKS = os.sysconf("SC_CLK_TCK")
# How far below the launcher engines run: the agent's default, or LLMGW_BENCH_ENGINE_NICE
# to compare another setting.
ENGINE_NICE = int(os.environ.get("LLMGW_BENCH_ENGINE_NICE", AgentConfig(node=NODE).engine_nice))


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def load() -> str:
    one, _, _ = os.getloadavg()
    return f"{one:.1f}"


# --- a bystander: how late any sleeping process wakes on this machine, for comparison ------

BYSTANDER = """
import asyncio, time
async def main():
    while True:
        t = time.perf_counter()
        await asyncio.sleep(%r)
        print(f"{time.perf_counter():.4f} {time.perf_counter() - t:.4f}", flush=True)
asyncio.run(main())
"""


def start_bystander(out: Path) -> subprocess.Popen[bytes]:
    with out.open("wb") as f:
        return subprocess.Popen([sys.executable, "-c", BYSTANDER % HEARTBEAT_S], stdout=f)


def bystander_gaps(out: Path, since: float, until: float) -> list[float]:
    gaps = []
    for line in out.read_text().splitlines():
        at, _, gap = line.partition(" ")
        with contextlib.suppress(ValueError):
            if since <= float(at) <= until:
                gaps.append(float(gap))
    return gaps


# --- the floor ------------------------------------------------------------------------


def sim_argv(port: int, model: str) -> list[str]:
    # What the sim adapter runs for a one-node shard.
    return [
        sys.executable,
        "-m",
        "llmgw_core.sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        model,
        "--load-time",
        "0",
    ]


def free_ports(n: int) -> list[int]:
    """Ports nothing listens on now (the machine is shared: a fixed range may be taken)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [int(s.getsockname()[1]) for s in socks]
    for s in socks:
        s.close()
    return ports


async def floor(n: int, logs: Path, windows: list[tuple[float, float]]) -> list[float]:
    """Seconds from the burst's start to each bare engine's first 200; its time window is appended."""
    prober = HealthProber(timeout_s=2.0)
    ports = free_ports(n)
    procs: list[subprocess.Popen[bytes]] = []
    ready: list[float] = []
    try:
        with (logs / "floor.log").open("ab") as log:
            start = time.perf_counter()
            for i in range(n):
                proc = subprocess.Popen(
                    sim_argv(ports[i], "sim1"),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
                # At the CPU priority the launcher gives its engines, so that other work on
                # the shared machine weighs on the floor as it does on the launched engines.
                lower_priority(proc.pid, ENGINE_NICE)
                procs.append(proc)

        async def wait_ready(proc: subprocess.Popen[bytes], port: int) -> None:
            url = f"http://127.0.0.1:{port}/health"
            while not await prober.healthy(url):
                if proc.poll() is not None:
                    tail = (logs / "floor.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"bench: a bare sim engine on port {port} exited:\n{tail}")
                await anyio.sleep(LOADING_PROBE_S)
            ready.append(time.perf_counter() - start)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i, proc in enumerate(procs):
                    tg.start_soon(wait_ready, proc, ports[i])
        windows.append((start, time.perf_counter()))
    finally:
        await prober.aclose()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return ready


# --- the cluster ----------------------------------------------------------------------


@dataclass
class Cluster:
    root: Path
    url: str
    prefix: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def _spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        self.procs[name] = proc
        return proc

    def start(self) -> None:
        agent = msgspec.convert(
            {
                "node": NODE,
                "state_dir": str(self.root / NODE),
                "nats": {"url": self.url, "prefix": self.prefix, "insecure": True},
                "simulate": {"gpu_count": GPUS},
                # Apart from the kernel's ephemeral ports (see ephemeral_overlap).
                "port_range": [30000, 30999],
                "heartbeat_interval_s": HEARTBEAT_S,
                "health_interval_s": HEALTH_S,
                "stop_grace_s": 5.0,
                "engine_nice": ENGINE_NICE,
            },
            AgentConfig,
        )
        agent_path = self.root / "agent.yaml"
        agent_path.write_bytes(msgspec.yaml.encode(agent))
        server = msgspec.convert(
            {
                "nats": {"url": self.url, "prefix": self.prefix, "insecure": True},
                "engines": [],
                "catalog": [
                    {
                        "name": "sim1",
                        "engine": "sim",
                        "model_path": "sim://sim1",
                        "gpu_class": "H100-80G",
                        "tp": 1,
                        "args": ["--load-time", "0"],
                        "health_timeout_s": 120.0,
                    }
                ],
                "http": {"host": "127.0.0.1", "port": 0, "insecure": True},
                "node_timeout_s": 10.0,
            },
            ServerConfig,
        )
        server_path = self.root / "server.yaml"
        server_path.write_bytes(msgspec.yaml.encode(server))
        py = sys.executable
        self._spawn("installer", [py, "-m", "llmgw_installer", "--config", str(agent_path)])
        # LLMGW_BENCH_LAUNCHER_SRC runs another launcher's source (an older commit's
        # services/launcher/src) against the same cluster, to compare within one run.
        env = dict(os.environ)
        other = os.environ.get("LLMGW_BENCH_LAUNCHER_SRC")
        if other:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (other, env.get("PYTHONPATH", "")) if p)
        self._spawn("launcher", [py, "-m", "llmgw_launcher", "--config", str(agent_path)], env)
        self._spawn("placement", [py, "-m", "llmgw_placement", "--config", str(server_path)])

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        terminate(proc, 15.0)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name)
        state = self.root / NODE
        if (state / "shards").is_dir():
            records, _ = Records(state).load_all()
            for r in records.values():
                for p in r.procs:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(p.pid, signal.SIGKILL)


@dataclass
class Watch:
    """What a subscriber on the bus sees, with arrival times."""

    replica_ready: dict[str, float] = field(default_factory=dict)  # deployment -> t
    # shard -> state -> first arrival
    shard: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    shard_last: dict[str, ShardStatus] = field(default_factory=dict)
    # shard -> state -> seconds from the launcher's stamp on the status to its arrival here
    bus_delay: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    # shard -> seconds from its spec reaching the bucket to the launcher's stamp on `starting`
    spec_to_starting: dict[str, float] = field(default_factory=dict)
    spec_wall: dict[str, float] = field(default_factory=dict)  # shard -> wall clock of its spec's arrival
    shard_of: dict[str, str] = field(default_factory=dict)  # deployment -> its (one) shard
    spec_written: dict[str, float] = field(default_factory=dict)  # deployment -> its shard spec in the bucket
    beats: list[tuple[float, float]] = field(default_factory=list)  # (arrival, sender's at)

    async def attach(self, bus: Bus) -> list[Any]:
        names = bus.names

        async def on_replica(msg: Msg) -> None:
            s = decoder(ReplicaStatus).decode(msg.data)
            if s.state == "ready":
                self.replica_ready.setdefault(s.deployment, time.perf_counter())

        async def on_shard(msg: Msg) -> None:
            s = decoder(ShardStatus).decode(msg.data)
            self.bus_delay[s.shard].setdefault(s.state, time.time() - s.at)
            if s.state == "starting" and s.shard in self.spec_wall:
                self.spec_to_starting.setdefault(s.shard, s.at - self.spec_wall[s.shard])
            self.shard[s.shard].setdefault(s.state, time.perf_counter())
            if s.state == "failed":
                self.shard[s.shard]["failed_last"] = time.perf_counter()
            self.shard_last[s.shard] = s
            self.shard_of.setdefault(s.deployment, s.shard)

        async def on_spec(msg: Msg) -> None:
            if msg.data:  # a put, not a delete
                spec = decoder(ShardSpec).decode(msg.data)
                self.spec_written.setdefault(spec.deployment, time.perf_counter())
                self.spec_wall.setdefault(spec.shard, time.time())

        async def on_beat(msg: Msg) -> None:
            self.beats.append((time.perf_counter(), decoder(Heartbeat).decode(msg.data).at))

        return [
            await bus.nc.subscribe(f"{names.prefix}.events.replica.>", cb=on_replica),
            await bus.nc.subscribe(f"{names.prefix}.events.shard.{NODE}.>", cb=on_shard),
            await bus.nc.subscribe(names.heartbeat(NODE, "launcher"), cb=on_beat),
            await bus.nc.subscribe(f"$KV.{names.shards_bucket}.{NODE}.>", cb=on_spec),
        ]

    def beat_gaps(self, since: float, until: float) -> tuple[list[float], list[float]]:
        """Gaps between heartbeats in the window: as received, and as sent (the beats' own clocks)."""
        window = [(t, at) for t, at in self.beats if since <= t <= until]
        received = [b[0] - a[0] for a, b in itertools.pairwise(window)]
        sent = [b[1] - a[1] for a, b in itertools.pairwise(window)]
        return received, sent


async def until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"bench: {what} not reached within {timeout:g}s")
        await anyio.sleep(0.02)


# --- profile ------------------------------------------------------------------------


def py_spy() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def start_profile(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    exe = py_spy()
    if exe is None:
        return None
    argv = [exe, "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--threads"]
    argv += ["--nonblocking", "--duration", "120", "-o", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    proc.send_signal(signal.SIGINT)  # py-spy writes what it has on Ctrl-C
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Profile_:
    samples: int
    expected: int
    inclusive: list[tuple[str, int]]
    own: list[tuple[str, int]]


def _function(frame: str) -> str:
    """`name (file.py:12)` -> `name (file.py)`: lines of one function count together."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit(':', 1)[0].rstrip(')')})"


def read_profile(path: Path, pid: int, seconds: float) -> Profile_ | None:
    """The event loop's (main thread's) samples: busy share, and the functions they were in."""
    try:
        text = path.read_text()
    except OSError:
        return None
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in text.splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack or not count_s.isdigit():
            continue
        frames = stack.split(";")
        if not frames[0].startswith(f"thread ({pid:#x})") and not frames[0].startswith(f"thread ({pid})"):
            continue
        count = int(count_s)
        total += count
        funcs = [_function(f) for f in frames[1:] if " (" in f]
        for f in set(funcs):
            inclusive[f] += count
        if funcs:
            own[funcs[-1]] += count
    return Profile_(total, round(100 * seconds), inclusive.most_common(60), own.most_common(8))


# --- the benchmark ------------------------------------------------------------------


def sim_shard(i: int) -> ShardSpec:
    profile = msgspec.convert(
        {"name": "idle", "engine": "sim", "model_path": "sim://idle", "args": ["--load-time", "0"]}, Profile
    )
    return msgspec.convert(
        {
            "replica": "r0",
            "shard": f"idle-{i:03d}",
            "node": NODE,
            "deployment": f"idle-{i:03d}",
            "profile": msgspec.to_builtins(profile),
            "profile_fp": profile.fingerprint(),
            "pool": "default",
        },
        ShardSpec,
    )


async def probe_cost(urls: list[str], rounds: int) -> tuple[float, float]:
    """CPU µs per probe in this process: httpx's pooled client against the launcher's prober."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        for u in urls:
            await client.get(u)
        start = time.process_time()
        for _ in range(rounds):
            for u in urls:
                await client.get(u)
        httpx_us = (time.process_time() - start) / (rounds * len(urls)) * 1e6
    prober = HealthProber()
    try:
        for u in urls:
            await prober.healthy(u)
        start = time.process_time()
        for _ in range(rounds):
            for u in urls:
                await prober.healthy(u)
        prober_us = (time.process_time() - start) / (rounds * len(urls)) * 1e6
    finally:
        await prober.aclose()
    return httpx_us, prober_us


async def _run(
    url: str, nats_pid: int, root: Path, n: int, seq: int, idle_n: int, idle_s: float, kills: int
) -> dict[str, Any]:
    f: dict[str, Any] = {"load": [load()]}
    bystander_out = root / "bystander.txt"
    bystander = start_bystander(bystander_out)
    floors: list[tuple[float, float]] = []
    await floor(1, root, [])  # untimed: one engine writes the bytecode every later start reads
    f["floor"] = await floor(n, root, floors)
    f["load"].append(load())
    prefix = "lbench"
    cluster = Cluster(root, url, prefix)
    bus = await Bus.connect(BusOptions(url=url, prefix=prefix, insecure=True), service="bench")
    watch = Watch()
    try:
        await bus.ensure()
        subs = await watch.attach(bus)
        cluster.start()
        launcher_pid = cluster.procs["launcher"].pid
        # Warm-up: one deployment through the whole path, so every process is up and placing.
        await bus.put(bus.names.deployments_bucket, "warm", Deployment(name="warm", profile="sim1"))
        await until(lambda: "warm" in watch.replica_ready, 120, "the warm-up deployment ready")
        await bus.delete(bus.names.deployments_bucket, "warm")
        await until(
            lambda: not any(s.state != "stopped" for s in watch.shard_last.values()), 60, "warm-up gone"
        )
        await anyio.sleep(1.0)

        # One at a time: each deployment timed from its write to its replica `ready`, each
        # beside a bare sim engine started alone (its own floor), alternating.
        f["single_floor"], f["single"] = [], []
        for i in range(seq):
            f["single_floor"] += await floor(1, root, [])
            name = f"s{i:03d}"
            at = time.perf_counter()
            await bus.put(bus.names.deployments_bucket, name, Deployment(name=name, profile="sim1"))
            await until(lambda name=name: name in watch.replica_ready, 60, f"{name} ready")
            f["single"].append(watch.replica_ready[name] - at)
            await bus.delete(bus.names.deployments_bucket, name)
            await until(
                lambda name=name: watch.shard_last[watch.shard_of[name]].state == "stopped",
                60,
                f"{name} gone",
            )
        f["load"].append(load())

        # The burst.
        names = [f"d{i:03d}" for i in range(n)]
        put_at: dict[str, float] = {}
        others = {"placement": cluster.procs["placement"].pid, "installer": cluster.procs["installer"].pid}
        others["nats-server"] = nats_pid
        cpu0 = cpu_seconds(launcher_pid)
        others0 = {k: cpu_seconds(pid) for k, pid in others.items()}
        t0 = time.perf_counter()

        async def deploy(name: str) -> None:
            put_at[name] = time.perf_counter()
            await bus.put(bus.names.deployments_bucket, name, Deployment(name=name, profile="sim1"))

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(deploy, name)
        await until(lambda: all(d in watch.replica_ready for d in names), 300, "every deployment ready")
        t1 = time.perf_counter()
        # A launcher may write the bucket (which placement reads) before it publishes the event.
        await until(
            lambda: all("ready" in watch.shard[watch.shard_of.get(d, "")] for d in names), 30, "ready events"
        )
        f["cpu_burst"] = cpu_seconds(launcher_pid) - cpu0
        f["cpu_others"] = {k: cpu_seconds(pid) - others0[k] for k, pid in others.items()}
        f["load"].append(load())
        f["deploy_ready"] = [watch.replica_ready[d] - put_at[d] for d in names]
        shard_of = watch.shard_of
        f["spec"] = [watch.spec_written[d] - put_at[d] for d in names]
        f["spec_to_starting"] = [watch.spec_to_starting[shard_of[d]] for d in names]
        f["bus_delay_ready"] = [watch.bus_delay[shard_of[d]]["ready"] for d in names]
        f["starting"] = [watch.shard[shard_of[d]]["starting"] - put_at[d] for d in names]
        f["shard_ready"] = [watch.shard[shard_of[d]]["ready"] - put_at[d] for d in names]
        f["burst_s"] = t1 - t0
        f["beats_burst"] = watch.beat_gaps(t0, t1)
        f["bystander_burst"] = bystander_gaps(bystander_out, t0, t1)

        async def gone(names: list[str]) -> None:
            async with anyio.create_task_group() as tg:
                for name in names:
                    tg.start_soon(bus.delete, bus.names.deployments_bucket, name)
            await until(
                lambda: all(watch.shard_last[watch.shard_of[d]].state == "stopped" for d in names),
                120,
                "burst stopped",
            )

        await gone(names)

        # The profile, from a burst of its own, untimed: py-spy's sampling takes CPU, which the
        # control plane has before the engines (they run below it) and the floor has no share of.
        profile_path = root / "burst.pyspy"
        spy = start_profile(launcher_pid, profile_path)
        await anyio.sleep(1.0 if spy else 0)  # py-spy attaches
        profiled = [f"p{i:03d}" for i in range(n)]
        t3 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for name in profiled:
                tg.start_soon(deploy, name)
        await until(lambda: all(d in watch.replica_ready for d in profiled), 300, "the profiled burst ready")
        t4 = time.perf_counter()
        stop_profile(spy)
        f["profile"] = read_profile(profile_path, launcher_pid, t4 - t3) if spy else None
        await gone(profiled)

        # The floor a second time.
        cluster.stop("placement")
        cluster.stop("installer")
        f["floor"] += await floor(n, root, floors)
        f["load"].append(load())

        # Idle: many ready shards.
        f["cpu_empty"] = await idle_cpu(launcher_pid, idle_s)
        specs = [sim_shard(i) for i in range(idle_n)]
        async with anyio.create_task_group() as tg:
            for s in specs:
                tg.start_soon(bus.put, bus.names.shards_bucket, f"{NODE}.{s.shard}", s)
        await until(
            lambda: all(watch.shard[s.shard].get("ready") for s in specs), 300, f"{idle_n} idle shards ready"
        )
        await anyio.sleep(2 * HEALTH_S)
        t2 = time.perf_counter()
        f["cpu_idle"] = await idle_cpu(launcher_pid, idle_s)
        f["beats_idle"] = watch.beat_gaps(t2, time.perf_counter())
        f["bystander_idle"] = bystander_gaps(bystander_out, t2, time.perf_counter())
        urls = [watch.shard_last[s.shard].url + "/health" for s in specs[:20]]
        f["probe_us"] = await probe_cost(urls, 10)
        f["load"].append(load())

        # Kill engines one at a time, at no particular phase of the health interval.
        notice = []
        for i in range(kills):
            victim = specs[i].shard
            pid = watch.shard_last[victim].pids[0]
            watch.shard[victim].pop("failed", None)
            killed = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            await until(lambda v=victim: "failed" in watch.shard[v], 30, f"{victim} failed")
            notice.append(watch.shard[victim]["failed"] - killed)
            await anyio.sleep(0.37)
        f["notice"] = notice
        for s in specs:
            await bus.delete(bus.names.shards_bucket, f"{NODE}.{s.shard}")
        with contextlib.suppress(TimeoutError):
            await until(
                lambda: all(watch.shard_last[s.shard].state == "stopped" for s in specs), 120, "idle stopped"
            )
        for sub in subs:
            await sub.unsubscribe()
        f["bystander_floor"] = [g for a, b in floors for g in bystander_gaps(bystander_out, a, b)]
    finally:
        bystander.kill()
        bystander.wait()
        cluster.close()
        await bus.close()
    return f


async def idle_cpu(pid: int, seconds: float) -> float:
    """Share of one core the process used over `seconds`."""
    before, t = cpu_seconds(pid), time.perf_counter()
    await anyio.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - t)


def ms(v: float) -> str:
    return f"{v * 1000:,.0f}"


def render(f: dict[str, Any], n: int, idle_n: int, quick: bool) -> str:
    fl, dr = f["floor"], f["deploy_ready"]
    fl50, fl99 = pct(fl, 50), pct(fl, 99)
    rows = [
        ("bare sim engines started together (floor)", fl),
        ("deploy -> shard spec in the bucket (placement's part)", f["spec"]),
        ("deploy -> shard `starting` event", f["starting"]),
        ("deploy -> shard `ready` event", f["shard_ready"]),
        ("deploy -> replica `ready` (placement's verdict)", dr),
    ]
    lines = [
        "## Launcher under load",
        "",
        f"`python -m bench.launcher{' --quick' if quick else ''}` (also part of `python -m bench`): real "
        f"processes: nats-server (`sync_interval: always`), placement, one node agent (installer + launcher, "
        f"{GPUS} simulated GPUs), sim engines at `--load-time 0`. The floor is {n} bare sim engines started "
        f"together by the benchmark at the CPU priority the launcher gives its engines (nice "
        f"+{ENGINE_NICE}, `engine_nice`), each timed to its first 200 on /health (probed every "
        f"{LOADING_PROBE_S:g} s, as the launcher probes a loading engine), run before and after the burst "
        f"({len(fl)} engines in all). Every process starts with its bytecode compiled, as an install leaves "
        f"it. The burst is {n} one-replica deployments written at once, each timed "
        f"from its write. Load average (1 min) during the run: {', '.join(f['load'])} on "
        f"{os.cpu_count()} cores shared with other work.",
        "",
        f"### {len(f['single'])} deployments one at a time",
        "",
        "Each written once the one before it was ready and gone again, from its write to its replica "
        "`ready` (placement's verdict, after the launcher's first 200 on /health), each beside a bare "
        "sim engine started alone by the benchmark (the floor, alternating with the deployments). "
        "Targets: p50 250 ms, p99 1 s (anchor: Kubernetes' pod startup SLO, p99 5 s).",
        "",
        "| | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|",
        *(
            f"| {label} | {ms(pct(v, 50))} | {ms(pct(v, 99))} | {ms(max(v))} |"
            for label, v in (
                ("a bare sim engine started alone (floor)", f["single_floor"]),
                ("deploy -> replica `ready`", f["single"]),
            )
        ),
        "",
        f"Deploy -> ready: p50 **{ms(pct(f['single'], 50))} ms**, p99 **{ms(pct(f['single'], 99))} ms**; "
        f"what the control plane adds to the engine's own start: "
        f"{ms(pct(f['single'], 50) - pct(f['single_floor'], 50))} ms at p50.",
        "",
        f"### {n} deployments at once on one node",
        "",
        "| from the write of each deployment (or the floor's start) to | p50 (ms) | p99 (ms) | max (ms) |",
        "|---|---|---|---|",
    ]
    for label, values in rows:
        lines.append(f"| {label} | {ms(pct(values, 50))} | {ms(pct(values, 99))} | {ms(max(values))} |")
    lines += [
        "",
        f"Deploy -> ready against the floor: p50 **{pct(dr, 50) / fl50:.2f}x**, "
        f"p99 **{pct(dr, 99) / fl99:.2f}x** (target: within 1.10x). Deploy -> shard `ready` event (the "
        f"launcher's own verdict) against the floor: p50 {pct(f['shard_ready'], 50) / fl50:.2f}x, "
        f"p99 {pct(f['shard_ready'], 99) / fl99:.2f}x.",
        "",
    ]
    lines += [
        f"The launcher used {f['cpu_burst']:.2f} s of CPU over the {f['burst_s']:.1f} s burst "
        f"({1000 * f['cpu_burst'] / n:.0f} ms per shard); the other processes of the control plane used "
        + ", ".join(f"{k} {v:.2f} s" for k, v in f["cpu_others"].items())
        + "; the engines had the rest of the machine.",
        "",
    ]
    lines += [
        "Where the time goes (p50 / p99, ms): the launcher's reaction, from a shard's spec reaching the "
        f"bucket to the launcher's stamp on its `starting` status: {ms(pct(f['spec_to_starting'], 50))} / "
        f"{ms(pct(f['spec_to_starting'], 99))}; the bus, from the launcher's stamp on `ready` to its arrival "
        f"at a subscriber: {ms(pct(f['bus_delay_ready'], 50))} / {ms(pct(f['bus_delay_ready'], 99))}.",
        "",
    ]
    recv, sent = f["beats_burst"]
    lines += heartbeat_lines(recv, sent, "during the burst", f["burst_s"])
    lines += ["", *bystander_lines(f)]
    prof = f["profile"]
    if prof is not None and prof.samples:
        lines += [
            "",
            f"Profile of the launcher during a second burst of {n}, untimed (py-spy, 100 Hz, "
            f"`--nonblocking`, main thread = the event loop): not idle in {prof.samples} of "
            f"{prof.expected} samples "
            f"({100 * prof.samples / max(1, prof.expected):.0f}%). py-spy samples wall-clock time: a thread "
            "that is runnable but waiting for a CPU (or for the GIL after a system call) counts as busy; the "
            "CPU figure above is the work. Top "
            "functions by samples they were on the stack for (inclusive, the loop's own plumbing left out), "
            "then by samples in the function itself:",
            "",
            "```",
        ]
        shown = [(fn, c) for fn, c in prof.inclusive if not _plumbing(fn)][:12]
        lines += [f"{100 * c / prof.samples:5.1f}%  {fn}" for fn, c in shown]
        lines += ["--- own"]
        lines += [f"{100 * c / prof.samples:5.1f}%  {fn}" for fn, c in prof.own]
        lines += ["```"]
    elif prof is None:
        lines += ["", "(No profile: py-spy is not installed; it is in the dev group.)"]
    httpx_us, prober_us = f["probe_us"]
    notice = f["notice"]
    recv, sent = f["beats_idle"]
    lines += [
        "",
        f"### {idle_n} ready shards on one node (health interval {HEALTH_S:g} s)",
        "",
        "| figure | value |",
        "|---|---|",
        f"| launcher CPU, no shards (heartbeats only) | {100 * f['cpu_empty']:.1f}% of a core |",
        f"| launcher CPU, {idle_n} ready shards probed every {HEALTH_S:g} s | "
        f"**{100 * f['cpu_idle']:.1f}% of a core** (target: under 5%) |",
        f"| CPU per probe: one pooled `httpx.AsyncClient` | {httpx_us:,.0f} µs |",
        "| CPU per probe: the launcher's `HealthProber` (kept-alive, minimal HTTP/1.1) | "
        f"{prober_us:,.0f} µs "
        f"({httpx_us / max(prober_us, 1e-9):.1f}x less) |",
        f"| SIGKILL of an engine -> its `failed` event, p50 / p99 / max over {len(notice)} kills | "
        f"{ms(pct(notice, 50))} / **{ms(pct(notice, 99))}** / {ms(max(notice))} ms "
        f"(target: p99 under {2 * HEALTH_S * 1000:,.0f} ms, two intervals) |",
        "",
    ]
    lines += heartbeat_lines(recv, sent, f"with {idle_n} ready shards", None)
    lines.append("")
    return "\n".join(lines)


def _plumbing(fn: str) -> bool:
    """Frames every sample has (the event loop, anyio's runner) say nothing about where time went."""
    return any(
        s in fn
        for s in (
            "(asyncio/base_events.py)",
            "(asyncio/runners.py)",
            "(asyncio/events.py)",
            "(anyio/_core/_eventloop.py)",
            "(anyio/_core/_tasks.py)",
            "(anyio/_backends/_asyncio.py)",
            "<module> (",
            "main (llmgw_launcher/__main__.py)",
            "_run_module_as_main",
            "_run_code",
        )
    )


def bystander_lines(f: dict[str, Any]) -> list[str]:
    def worst(gaps: list[float]) -> str:
        return f"{ms(max(gaps))} ms" if gaps else "n/a"

    return [
        f"For comparison, a bystander process that does nothing but `asyncio.sleep({HEARTBEAT_S:g})` in a "
        f"loop woke with gaps of at most {worst(f['bystander_floor'])} while the bare engines started "
        f"(the floor), {worst(f['bystander_burst'])} during the burst and {worst(f['bystander_idle'])} "
        "with the idle shards: what the machine does to any process that sleeps, not the launcher's doing."
    ]


def heartbeat_lines(recv: list[float], sent: list[float], when: str, seconds: float | None) -> list[str]:
    if not recv:
        return [f"Launcher heartbeats {when}: none received."]
    late = sum(1 for g in recv if g > LATE * HEARTBEAT_S)
    span = f" over {seconds:.1f} s" if seconds else ""
    return [
        f"Launcher heartbeats {when} (every {HEARTBEAT_S:g} s; late = a gap over {LATE:g}x that), seen by a "
        f"subscriber{span}: {len(recv)} gaps, largest {ms(max(recv))} ms as received and {ms(max(sent))} ms "
        f"by the beats' own clocks; **{late} late**."
    ]


@contextlib.contextmanager
def _without_env(name: str) -> Any:
    saved = os.environ.pop(name, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[name] = saved


def run(quick: bool = False) -> str:
    n, seq, idle_n, idle_s, kills = (16, 20, 24, 2.0, 5) if quick else (50, 100, 100, 10.0, 20)
    # LLMGW_BENCH_KEEP=<dir> keeps every process's log there for a look afterwards.
    keep = os.environ.get("LLMGW_BENCH_KEEP")
    with contextlib.ExitStack() as stack:
        # Every process here (engines included) starts with its bytecode compiled, as an
        # install leaves it (`uv sync --compile-bytecode`, the image's UV_COMPILE_BYTECODE):
        # where PYTHONDONTWRITEBYTECODE is set, each sim engine would compile its libraries
        # anew at every start, several times what the launcher adds.
        stack.enter_context(_without_env("PYTHONDONTWRITEBYTECODE"))
        if keep:
            root = Path(keep)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmgw-bench-launcher-")))
        server = NatsServer(store_dir=root / "nats", sync_always=True)
        server.start()
        try:
            assert server.proc is not None
            figures = anyio.run(_run, server.url, server.proc.pid, root, n, seq, idle_n, idle_s, kills)
        finally:
            server.stop()
    return render(figures, n, idle_n, quick)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.launcher")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="16 deployments at once, 20 one at a time, 24 idle shards: about a minute",
    )
    args = parser.parse_args()
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
