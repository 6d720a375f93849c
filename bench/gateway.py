"""What the gateway adds: latency, throughput and CPU per request in front of a sim engine that
answers at once, against calling the engine directly and against LiteLLM's proxy in front of
the same engine; and 200 KB prompts at rising concurrency, gateway against direct.

Every side runs in the same run, in alternated rounds, so that a busy moment of the shared
machine falls on all of them. The gateway is a real `llmgw-gateway` process on a real
nats-server, connected as the gateway identity, with keys required, a key whose rpm and tpm
limits lie far above the load (so every request is admitted and charged against the shared
budget) and usage recorded. LiteLLM is installed into a virtualenv of its own under
~/.cache/llmgw-bench (LLMGW_BENCH_CACHE), never into the project's; without it the section says
why and the other sides still run. The load comes from `bench.load`, a process of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import anyio
import httpx

from bench.procs import terminate
from llmgw.auth import AuthDir
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.keys import ApiKey, new_secret, secret_hash
from llmgw_core.natsd import NatsServer

PREFIX = "gwbench"
MODEL = "chat"
LITELLM_KEY = "sk-bench-litellm"
CHAT = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
# Words of five bytes: a 200 KB prompt, a short answer.
LONG = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "word " * 40_000}], "max_tokens": 4}
)
CLK_TCK = os.sysconf("SC_CLK_TCK")
# The workers of the `http: workers` side: as many as the machine's CPUs, at least 2.
WORKERS = max(2, len(os.sched_getaffinity(0)))
# The reference proxies of bench/floor_proxy.py, by kind, as the tables name them.
FLOORS = {
    "bare": "floor: bare Python proxy on uvloop",
    "uvicorn": "floor: the gateway's server and replica client, nothing else",
}
# `python -c` running the gateway of the config in argv[1] on asyncio's own event loop.
_ON_ASYNCIO = (
    "import sys; from llmgw_gateway.__main__ import run; sys.exit(run(sys.argv[1], use_uvloop=False))"
)


def _cache() -> Path:
    return Path(os.environ.get("LLMGW_BENCH_CACHE") or Path.home() / ".cache" / "llmgw-bench")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def cpu_s(pid: int) -> float:
    """User and system CPU seconds so far of process `pid` and its living descendants (a
    gateway's workers under their supervisor)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    # utime and stime: fields 14 and 15 of stat(5), 12 and 13 after the command's name.
    total = (int(fields[11]) + int(fields[12])) / CLK_TCK
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(FileNotFoundError):
            total += sum(cpu_s(int(child)) for child in task.read_text().split())
    return total


def litellm_binary() -> tuple[Path | None, str]:
    """LiteLLM's proxy command in the benchmark's own virtualenv, installed there on first use;
    or None and what went wrong."""
    venv = _cache() / "litellm"
    binary = venv / "bin" / "litellm"
    if binary.exists():
        return binary, ""
    venv.parent.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv")
    if uv:
        steps = [
            [uv, "venv", "-q", str(venv)],
            [uv, "pip", "install", "-q", "--python", str(venv), "litellm[proxy]"],
        ]
    else:
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
        ]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"`{' '.join(step)}` failed: {exc}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            return None, f"`{' '.join(step)}` exited {done.returncode}: {tail[0]}"
    if not binary.exists():
        return None, f"installing litellm[proxy] into {venv} made no {binary}"
    return binary, ""


def _answers(url: str, token: str, body: str, timeout_s: float, proc: subprocess.Popen[bytes]) -> None:
    """Wait until `url` answers `body` with 200, or raise saying what it answered last."""
    deadline = time.monotonic() + timeout_s
    last = "nothing"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited {proc.returncode} before answering {url}")
        try:
            r = httpx.post(
                url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=10
            )
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.HTTPError as exc:
            last = str(exc) or type(exc).__name__
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s:g}s; last: {last}")


@contextmanager
def _process(
    argv: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        terminate(proc)


async def _declare(url: str, auth: AuthDir, engine: str, secret: str) -> None:
    """Deployment `chat` with one ready replica at `engine`, and a key for `secret` with limits
    far above the load."""

    def options(identity: str) -> BusOptions:
        return BusOptions(url=url, prefix=PREFIX, nkey_seed_file=str(auth.seed(identity)))

    async with await Bus.connect(options("placement"), service="placement") as bus:
        await bus.ensure()
        await bus.put(bus.names.deployments_bucket, MODEL, Deployment(name=MODEL, profile="sim"))
        record = ReplicaRecord(
            deployment=MODEL,
            replica="r0",
            profile="sim",
            profile_fp="x",
            state="ready",
            url=engine,
            engine="sim",
        )
        await bus.put(bus.names.replicas_bucket, f"{MODEL}.r0", record)
    async with await Bus.connect(options("ctl"), service="ctl") as bus:
        key = ApiKey(name="bench", hash=secret_hash(secret), rpm=10**9, tpm=10**13, created_at=time.time())
        await bus.put(bus.names.keys_bucket, "bench", key)


def _gateway_url(log: Path, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(r"OpenAI endpoint on (http://\S+)/v1", log.read_text(errors="replace"))
        if found:
            return str(found[-1])
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"the gateway did not start listening: {log.read_text(errors='replace')[-2000:]}")


class Side:
    """One way to reach the engine: its chat URL, the key it wants, the process whose CPU counts."""

    def __init__(self, name: str, base: str, token: str, pid: int) -> None:
        self.name = name
        self.url = f"{base}/v1/chat/completions"
        self.token = token
        self.pid = pid
        self.latencies: dict[int, list[float]] = {}
        self.rates: dict[int, list[float]] = {}
        self.cpu: dict[int, list[float]] = {}
        self.errors: dict[int, int] = {}

    def p(self, n: int, q: float) -> float:
        values = sorted(self.latencies[n])
        return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")

    def rate(self, n: int) -> float:
        return statistics.median(self.rates[n]) if self.rates.get(n) else float("nan")

    def cpu_ms(self, n: int) -> float:
        return statistics.median(self.cpu[n]) * 1000 if self.cpu.get(n) else float("nan")


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (the scheduler's affinity is per thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def _round(side: Side, body: Path, n: int, duration_s: float, client_cpus: set[int] | None = None) -> None:
    before = cpu_s(side.pid)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.load",
            side.url,
            "--body",
            str(body),
            "--token",
            side.token,
            "--concurrency",
            str(n),
            "--duration",
            str(duration_s),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
        preexec_fn=None if client_cpus is None else lambda: os.sched_setaffinity(0, client_cpus),
    )
    used = cpu_s(side.pid) - before
    if done.returncode != 0:
        raise RuntimeError(f"the load generator against {side.name} failed: {done.stderr[-1000:]}")
    result = json.loads(done.stdout)
    side.latencies.setdefault(n, []).extend(result["latencies_s"])
    side.rates.setdefault(n, []).append(result["done"] / result["elapsed_s"])
    side.errors[n] = side.errors.get(n, 0) + result["errors"]
    if result["done"]:
        # The warm-up answers and the load generator's start fall in the CPU counted: a little
        # more per request than the gateway spends, never less.
        side.cpu.setdefault(n, []).append(used / result["done"])


def _measure(
    sides: list[Side],
    body: Path,
    levels: tuple[int, ...],
    rounds: int,
    duration_s: float,
    client_cpus: set[int] | None = None,
) -> None:
    for n in levels:
        for r in range(rounds):
            # The order turns each round: no side always follows the same one.
            for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                _round(side, body, n, duration_s, client_cpus)


def _litellm_config(path: Path, engine: str) -> None:
    path.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {
                            "model": f"openai/{MODEL}",
                            "api_base": f"{engine}/v1",
                            "api_key": "x",
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_KEY},
                "litellm_settings": {"telemetry": False},
            }
        )
    )


def _loadavg(values: tuple[float, ...]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _fmt(x: float, spec: str = ".2f") -> str:
    return "n/a" if x != x else format(x, spec)


def run(quick: bool = False) -> str:
    rounds = 1 if quick else 3
    duration_s = 0.5 if quick else 2.0
    levels = (1, 32, 256)
    long_levels = (1, 4, 16)
    litellm, litellm_problem = litellm_binary()
    with tempfile.TemporaryDirectory() as d, ExitStack() as stack:
        root = Path(d)
        chat_body, long_body = root / "chat.json", root / "long.json"
        chat_body.write_text(CHAT)
        long_body.write_text(LONG)
        auth = AuthDir(root / "auth")
        auth.init([], prefix=PREFIX)
        nats = NatsServer(store_dir=root / "nats", includes=(auth.conf,))
        nats.start()
        stack.callback(nats.stop)
        port = _free_port()
        engine_url = f"http://127.0.0.1:{port}"
        sim = stack.enter_context(
            _process(
                [
                    sys.executable,
                    "-m",
                    "llmgw_core.sim",
                    "--port",
                    str(port),
                    "--model",
                    MODEL,
                    "--load-time",
                    "0",
                ],
                root / "sim.log",
            )
        )
        _answers(f"{engine_url}/v1/chat/completions", "", CHAT, 60, sim)
        secret = new_secret()
        anyio.run(_declare, nats.url, auth, engine_url, secret)
        config = root / "gateway.yaml"
        config.write_text(
            json.dumps(
                {
                    "nats": {"url": nats.url, "prefix": PREFIX, "nkey_seed_file": str(auth.seed("gateway"))},
                    "http": {"host": "127.0.0.1", "port": 0, "require_api_key": True},
                }
            )
        )
        gateway_log = root / "gateway.log"
        gateway = stack.enter_context(
            _process([sys.executable, "-m", "llmgw_gateway", "--config", str(config)], gateway_log)
        )
        gateway_url = _gateway_url(gateway_log, gateway)
        _answers(f"{gateway_url}/v1/chat/completions", secret, CHAT, 60, gateway)
        # The same gateway on asyncio's own event loop instead of uvloop, side by side.
        plain_log = root / "gateway-asyncio.log"
        plain = stack.enter_context(_process([sys.executable, "-c", _ON_ASYNCIO, str(config)], plain_log))
        plain_url = _gateway_url(plain_log, plain)
        _answers(f"{plain_url}/v1/chat/completions", secret, CHAT, 60, plain)
        # The same gateway as WORKERS processes on its port (`http: workers`), its supervisor's
        # CPU and theirs counted.
        many_log = root / "gateway-workers.log"
        argv = [sys.executable, "-m", "llmgw_gateway", "--config", str(config), "--workers", str(WORKERS)]
        many = stack.enter_context(_process(argv, many_log))
        many_url = _gateway_url(many_log, many)
        _answers(f"{many_url}/v1/chat/completions", secret, CHAT, 60, many)
        sides = [
            Side("direct", engine_url, "", sim.pid),
            Side("llmgw gateway", gateway_url, secret, gateway.pid),
            Side("llmgw gateway, asyncio loop", plain_url, secret, plain.pid),
            Side(f"llmgw gateway, {WORKERS} workers", many_url, secret, many.pid),
        ]
        # What a Python proxy costs before the gateway's own work (bench/floor_proxy.py).
        for kind, name in FLOORS.items():
            floor_log = root / f"floor-{kind}.log"
            argv = [sys.executable, str(Path(__file__).parent / "floor_proxy.py"), kind, engine_url]
            floor = stack.enter_context(_process(argv, floor_log))
            floor_url = _gateway_url(floor_log, floor)
            _answers(f"{floor_url}/v1/chat/completions", "", CHAT, 60, floor)
            sides.append(Side(name, floor_url, "", floor.pid))
        if litellm is not None:
            lport = _free_port()
            _litellm_config(root / "litellm.yaml", engine_url)
            env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
            argv = [str(litellm), "--config", str(root / "litellm.yaml"), "--host", "127.0.0.1"]
            argv += ["--port", str(lport), "--num_workers", "1"]
            proxy = stack.enter_context(_process(argv, root / "litellm.log", env))
            try:
                _answers(f"http://127.0.0.1:{lport}/v1/chat/completions", LITELLM_KEY, CHAT, 180, proxy)
                sides.append(Side("LiteLLM proxy", f"http://127.0.0.1:{lport}", LITELLM_KEY, proxy.pid))
            except RuntimeError as exc:
                log_tail = (root / "litellm.log").read_text(errors="replace")[-500:]
                litellm_problem = f"LiteLLM's proxy did not serve: {exc}; its log ends: {log_tail}"
        baseline = os.environ.get("LLMGW_BENCH_BASELINE_PYTHON", "")
        if baseline:
            # Another checkout's gateway (its venv's Python: `git worktree add /tmp/base REV`,
            # `./dev sync-all` there) with the same config, as one more side of the same run.
            base_log = root / "gateway-baseline.log"
            argv = [baseline, "-m", "llmgw_gateway", "--config", str(config)]
            base = stack.enter_context(_process(argv, base_log))
            base_url = _gateway_url(base_log, base)
            _answers(f"{base_url}/v1/chat/completions", secret, CHAT, 60, base)
            name = os.environ.get("LLMGW_BENCH_BASELINE_NAME", "") or baseline
            sides.append(Side(f"baseline gateway ({name})", base_url, secret, base.pid))
        load_before = os.getloadavg()
        _measure(sides, chat_body, levels, rounds, duration_s)
        load_after = os.getloadavg()
        # The gateway on a core of its own, as on a host of its own in a cluster: the engine and
        # the load generator share one CPU for both sides, the gateway has another.
        own: list[Side] = []
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) >= 2:
            everywhere = set(cpus)
            shared, apart = {cpus[0]}, {cpus[1]}
            own = [
                Side(f"direct, engine and client on CPU {cpus[0]}", engine_url, "", sim.pid),
                Side(f"llmgw gateway on CPU {cpus[1]}", gateway_url, secret, gateway.pid),
            ]
            pin(sim.pid, shared)
            pin(gateway.pid, apart)
            try:
                _measure(own, chat_body, levels, rounds, duration_s, client_cpus=shared)
            finally:
                pin(sim.pid, everywhere)
                pin(gateway.pid, everywhere)
        long_sides = [
            Side("direct", engine_url, "", sim.pid),
            Side("llmgw gateway", gateway_url, secret, gateway.pid),
        ]
        _measure(long_sides, long_body, long_levels, rounds, duration_s)
        usage = httpx.get(
            f"{gateway_url}/metrics", headers={"Authorization": f"Bearer {secret}"}, timeout=10
        ).text
    return _section(
        sides,
        own,
        long_sides,
        levels,
        long_levels,
        rounds,
        duration_s,
        litellm_problem,
        usage,
        (load_before, load_after),
    )


def _counter(metrics: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE))


def _table(sides: list[Side], levels: tuple[int, ...]) -> list[str]:
    """Each side at each level, the first side (calling the engine directly) the reference."""
    direct = sides[0]
    lines = [
        "| in flight | side | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) | req/s | vs direct "
        "| errors | server CPU per request (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n in levels:
        for side in sides:
            added50 = side.p(n, 0.5) - direct.p(n, 0.5)
            added99 = side.p(n, 0.99) - direct.p(n, 0.99)
            dash = side is direct
            lines.append(
                f"| {n} | {side.name} | {_fmt(side.p(n, 0.5))} | {_fmt(side.p(n, 0.99))} | "
                f"{'' if dash else _fmt(added50)} | {'' if dash else _fmt(added99)} | "
                f"{_fmt(side.rate(n), ',.0f')} | {_fmt(side.rate(n) / direct.rate(n))}x | "
                f"{side.errors.get(n, 0)} | {_fmt(side.cpu_ms(n), '.3f')} |"
            )
    return lines


def _own_section(own: list[Side], levels: tuple[int, ...]) -> list[str]:
    """The sides measured with the gateway on a CPU of its own; nothing on a one-CPU machine."""
    if not own:
        return []
    return [
        "### The gateway on a CPU of its own",
        "",
        "As a gateway runs in a cluster, on a host of its own: the same engine and gateway "
        "processes, each thread pinned (`sched_setaffinity`), the engine and the load generator on "
        "one CPU for both sides, the gateway on another (nats-server unpinned); the same rounds. "
        "`direct` here is the reference for the gateway here. At 1 in flight that reference is "
        "slower than with both CPUs (its client and engine take turns on one), which the "
        "gateway's side is not: the added latency at 1 in flight is read from the table above.",
        "",
        *_table(own, levels),
        "",
    ]


def _section(
    sides: list[Side],
    own: list[Side],
    long_sides: list[Side],
    levels: tuple[int, ...],
    long_levels: tuple[int, ...],
    rounds: int,
    duration_s: float,
    litellm_problem: str,
    metrics: str,
    load: tuple[tuple[float, ...], tuple[float, ...]],
) -> str:
    direct, gw, plain, many = sides[0], sides[1], sides[2], sides[3]
    lite = next((side for side in sides if side.name == "LiteLLM proxy"), None)
    lines = [
        "## Gateway: added latency and throughput (against direct and LiteLLM's proxy)",
        "",
        "`python -m bench --only gateway`: non-streamed chat completions (a 5-word prompt, 4 words "
        "back) to a sim engine answering at once, directly, through an `llmgw-gateway` process "
        "(keys required, a key with rpm and tpm limits far above the load charged on every "
        "request, usage recorded; on a real nats-server as the gateway identity) and through "
        "LiteLLM's proxy (`litellm[proxy]` from PyPI in a virtualenv of its own, one worker, its "
        "master key, pointed at the same engine as an OpenAI-compatible backend). The load comes "
        "from `bench.load`, one process of plain asyncio streams on kept-alive connections, on the "
        "same machine as the servers. The gateway runs on uvloop; `llmgw gateway, asyncio loop` is "
        "a second gateway process of the same code and config on asyncio's own event loop; "
        f"`llmgw gateway, {WORKERS} workers` the same config run as {WORKERS} worker processes on "
        "one port (`--workers`); the two `floor:` sides are the reference proxies of "
        "`bench/floor_proxy.py` (no keys, limits, usage or routing): what Python costs before the "
        "gateway's own work; with "
        "`LLMGW_BENCH_BASELINE_PYTHON` set to another checkout's venv Python, that checkout's "
        "gateway is one more side (`baseline gateway`, named by `LLMGW_BENCH_BASELINE_NAME`). "
        f"{rounds} alternated rounds of {duration_s:g} s per side and "
        "concurrency; latencies pooled over the rounds, throughput the median round. CPU per "
        "request: user + system seconds of the server's process and its children (/proc/PID/stat) "
        "over the round, "
        "divided by the requests it answered.",
        "",
        f"The machine's load average (1, 5, 15 min) before the rounds: {_loadavg(load[0])}; "
        f"after them: {_loadavg(load[1])}.",
        "",
    ]
    if litellm_problem:
        lines += [f"LiteLLM's side is missing from this run: {litellm_problem}", ""]
    lines += _table(sides, levels)
    added50 = gw.p(1, 0.5) - direct.p(1, 0.5)
    added99 = gw.p(1, 0.99) - direct.p(1, 0.99)
    ratio32 = gw.rate(32) / direct.rate(32)
    lines += ["", "Targets:", ""]
    lines.append(
        f"- added at 1 in flight: p50 {added50:.2f} ms (target ≤ 0.3: {_met(added50 <= 0.3)}), "
        f"p99 {added99:.2f} ms (target ≤ 2: {_met(added99 <= 2)});"
    )
    floors = [next(side for side in sides if side.name == name) for name in FLOORS.values()]
    bare50, server50 = (floor.p(1, 0.5) - direct.p(1, 0.5) for floor in floors)
    lines.append(
        f"- what Python allows at 1 in flight: a bare proxy on uvloop adds p50 {bare50:.2f} ms "
        f"({floors[0].cpu_ms(1):.3f} ms CPU per request); the gateway's HTTP server and replica "
        f"client forwarding and nothing else, {server50:.2f} ms ({floors[1].cpu_ms(1):.3f} ms CPU); "
        f"the gateway's own work per request (keys, limits, usage, routing, metrics, its "
        f"connection guard) {added50 - server50:.2f} ms on top;"
    )
    many32 = many.rate(32) / direct.rate(32)
    lines.append(
        f"- throughput at 32 in flight, every process on the same CPUs: {ratio32:.2f}x direct, "
        f"{many32:.2f}x with {WORKERS} workers (target ≥ 0.9: {_met(max(ratio32, many32) >= 0.9)});"
    )
    if own:
        own_direct, own_gw = own
        own50 = own_gw.p(1, 0.5) - own_direct.p(1, 0.5)
        own99 = own_gw.p(1, 0.99) - own_direct.p(1, 0.99)
        own32 = own_gw.rate(32) / own_direct.rate(32)
        lines.append(
            "- with the gateway on a CPU of its own (below): throughput at 32 in flight "
            f"{own32:.2f}x direct (target ≥ 0.9: {_met(own32 >= 0.9)}); added at 1 in flight "
            f"p50 {own50:.2f} ms, p99 {own99:.2f} ms, against a direct reference whose client and "
            "engine take turns on one CPU (so the targets at 1 in flight are judged above);"
        )
    if lite is not None:
        worst = min(gw.rate(n) / lite.rate(n) for n in levels)
        each = ", ".join(f"{gw.rate(n) / lite.rate(n):.1f}x at {n}" for n in levels)
        lines.append(
            f"- against LiteLLM's proxy: {each} in flight (target never below 5x: {_met(worst >= 5)});"
        )
    cpu = ", ".join(f"{gw.cpu_ms(n):.3f} ms at {n}" for n in levels)
    scaling = ", ".join(
        f"{_fmt(many.rate(n) / gw.rate(n))}x the requests per second at {n} ({many.cpu_ms(n):.3f} ms CPU)"
        for n in levels
    )
    loops = ", ".join(
        f"{gw.cpu_ms(n):.3f} against {plain.cpu_ms(n):.3f} ms CPU and "
        f"{_fmt(gw.rate(n) / plain.rate(n))}x the requests per second at {n}"
        for n in levels
    )
    lines += [
        f"- the gateway's CPU per request: {cpu} in flight;",
        f"- uvloop against asyncio's own loop: {loops} in flight;",
        f"- {WORKERS} workers against one process: {scaling} in flight, on {os.cpu_count()} CPUs shared "
        "with the engine and the load generator.",
        "",
        "Usage the gateway recorded in the run (its `/metrics`): "
        f"{_counter(metrics, 'llmgw_gateway_key_requests_total'):,.0f} requests, "
        f"{_counter(metrics, 'llmgw_gateway_prompt_tokens_total'):,.0f} prompt tokens.",
        "",
        *_own_section(own, levels),
        "### Long prompts (200 KB) at rising concurrency",
        "",
        "The same sides, direct and through the gateway, with a 200 KB prompt (40,000 words) and 4 "
        "words back.",
        "",
        "| in flight | direct req/s | gateway req/s | vs direct | direct p50 (ms) | gateway p50 (ms) | "
        "gateway p99 (ms) | gateway CPU per request (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ld, lg = long_sides
    for n in long_levels:
        lines.append(
            f"| {n} | {_fmt(ld.rate(n), ',.0f')} | {_fmt(lg.rate(n), ',.0f')} | "
            f"{_fmt(lg.rate(n) / ld.rate(n))}x | {_fmt(ld.p(n, 0.5))} | {_fmt(lg.p(n, 0.5))} | "
            f"{_fmt(lg.p(n, 0.99))} | {_fmt(lg.cpu_ms(n), '.3f')} |"
        )
    first, last = lg.rate(long_levels[0]), lg.rate(long_levels[-1])
    verdict = "no collapse" if last >= 0.8 * first else "throughput falls"
    lines += [
        "",
        f"Gateway throughput from {long_levels[0]} to {long_levels[-1]} in flight: "
        f"{first:,.0f} → {last:,.0f} req/s ({verdict}).",
        "",
    ]
    return "\n".join(lines)
