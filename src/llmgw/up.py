"""`llmgw up`: a whole cluster on this machine, stopped cleanly by Ctrl-C.

It starts the embedded nats-server (JetStream, data under `--data-dir`),
placement, and one local node agent (installer + launcher) as separate
processes, with a server.yaml that deploys a simulated model; waits until the
replica answers; prints its endpoint and a curl that works; and on Ctrl-C
stops the agents, their engines, placement and NATS, in that order.

Authentication is on: the first run writes the identities and API tokens
into `<data-dir>/auth` (`llmgw auth init`), NATS enforces each identity's
permissions, and every process connects as its own. `--insecure` runs
without, and says so.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec

from llmgw_core import telemetry
from llmgw_core.access import all_streams, require_streams
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.errors import BusError
from llmgw_core.events import ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_placement.config import ServerConfig

from .auth import AuthDir

NODE = "local-1"
DEPLOYMENT = "chat"


def server_yaml(url: str, api_port: int, auth: AuthDir | None) -> dict[str, Any]:
    if auth is None:
        nats: dict[str, Any] = {"url": url, "insecure": True}
        http: dict[str, Any] = {"host": "127.0.0.1", "port": api_port, "insecure": True}
    else:
        nats = {"url": url, "nkey_seed_file": str(auth.seed("placement"))}
        http = {
            "host": "127.0.0.1",
            "port": api_port,
            "token_file": str(auth.api_token_file),
            "read_token_file": str(auth.api_read_token_file),
        }
    return {
        "nats": nats,
        # The local cluster runs the built-in simulated engine; a node would
        # otherwise be asked to download a llama.cpp build first.
        "engines": [],
        "pools": {"local": ["local-*"]},
        "catalog": [
            {
                "name": "tiny-chat",
                "engine": "sim",
                "model": "tiny-chat",
                "model_path": "sim://tiny-chat",
                "gpu_class": "H100-80G",
                "tp": 1,
                "args": ["--load-time", "1", "--tokens-per-second", "50"],
                "health_timeout_s": 60,
            }
        ],
        "deployments": [{"name": DEPLOYMENT, "profile": "tiny-chat", "replicas": 1, "pool": "local"}],
        "http": http,
    }


def metrics_ports(api_port: int) -> tuple[int, int]:
    """The installer's and the launcher's /metrics: the two ports after the API's, so they stay put."""
    return api_port + 1, api_port + 2


def agent_yaml(
    url: str, state_dir: Path, auth: AuthDir | None, metrics: tuple[int, int] = (0, 0)
) -> dict[str, Any]:
    nats: dict[str, Any] = (
        {"url": url, "insecure": True}
        if auth is None
        else {"url": url, "nkey_seed_file": str(auth.node_seed(NODE))}
    )
    return {
        "node": NODE,
        "state_dir": str(state_dir),
        "nats": nats,
        "simulate": {"gpu_count": 2},
        "port_range": [28000, 28999],
        "installer_metrics_port": metrics[0],
        "launcher_metrics_port": metrics[1],
    }


def _write(path: Path, value: dict[str, Any], kind: type[msgspec.Struct]) -> Path:
    # Decoded first, so a mistake here fails with the same message a user's file would.
    path.write_bytes(msgspec.yaml.encode(msgspec.convert(value, kind)))
    return path


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str]) -> None:
        with (self.logs / f"{name}.log").open("ab") as log:
            # Their own sessions: Ctrl-C reaches `llmgw up` alone, which then stops
            # them in order (agents before placement before NATS), once each.
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        self.procs.append((name, proc))

    def check(self) -> None:
        for name, proc in self.procs:
            code = proc.poll()
            if code is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                raise SystemExit(f"llmgw: {name} exited with code {code}:\n" + "\n".join(tail))

    def stop(self, timeout: float = 20.0) -> None:
        # Reverse order: the launcher (which stops its engines) before placement.
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    print(f"llmgw: {name} did not stop in {timeout:g}s; killing it", flush=True)
                    proc.kill()
                    proc.wait()
            if proc.returncode not in (0, None):
                print(
                    f"llmgw: {name} exited with code {proc.returncode}; see {self.logs / name}.log",
                    flush=True,
                )


async def _wait_ready(bus: Bus, procs: Processes, timeout: float) -> ReplicaRecord:
    deadline = time.monotonic() + timeout
    # Placement creates the streams and buckets; the operator only reads them.
    while True:
        procs.check()
        try:
            await require_streams(bus, all_streams(bus.names), timeout=1)
            break
        except BusError:
            if time.monotonic() > deadline:
                raise
    while True:
        procs.check()
        found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
        for change in found.values():
            if (
                change.value is not None
                and change.value.deployment == DEPLOYMENT
                and change.value.state == "ready"
            ):
                return change.value
        if time.monotonic() > deadline:
            raise SystemExit(f"llmgw: no ready replica of {DEPLOYMENT} after {timeout:g}s; see {procs.logs}")
        await anyio.sleep(0.3)


def identities(data_dir: Path) -> AuthDir:
    """The local cluster's identities: written on the first run, kept afterwards."""
    auth = AuthDir(data_dir / "auth")
    # `fleet` too: a local cluster is where `llmgw fleet` is tried.
    created = auth.init([NODE], fleet=True)
    if created:
        print(f"llmgw: wrote identities ({', '.join(created)}) and API tokens to {auth.path}", flush=True)
    return auth


async def _serve(data_dir: Path, port: int, api_port: int, insecure: bool) -> int:
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    auth = None if insecure else identities(data_dir)
    server = NatsServer(
        store_dir=data_dir / "nats",
        port=port,
        log_path=logs / "nats.log",
        includes=(auth.conf,) if auth else (),
    )
    await anyio.to_thread.run_sync(server.start)
    if auth is None:
        print(
            "llmgw: INSECURE: NATS and the API run without authentication (--insecure); anyone who can "
            "reach them can start any process on this machine",
            flush=True,
        )
    procs = Processes(logs)
    # The receiver stays open until everything is stopped: a second Ctrl-C (a
    # terminal and a wrapper like `uv run` can both deliver one) must not cut
    # the shutdown short and leave engines running.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with anyio.create_task_group() as tg:

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        print("llmgw: stopping", flush=True)
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                await _bring_up(server.url, data_dir, api_port, procs, auth)
                while True:
                    procs.check()
                    await anyio.sleep(1)
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(procs.stop)
                await anyio.to_thread.run_sync(server.stop)
    print("llmgw: stopped", flush=True)
    return 0


async def _bring_up(url: str, data_dir: Path, api_port: int, procs: Processes, auth: AuthDir | None) -> None:
    server_cfg = _write(data_dir / "server.yaml", server_yaml(url, api_port, auth), ServerConfig)
    metrics = metrics_ports(api_port)
    agent_cfg = _write(
        data_dir / "agent.yaml", agent_yaml(url, data_dir / "agent", auth, metrics), AgentConfig
    )
    print(f"llmgw: NATS JetStream at {url} (data in {data_dir})", flush=True)
    py = sys.executable
    procs.start("placement", [py, "-m", "llmgw_placement", "--config", str(server_cfg)])
    procs.start("installer", [py, "-m", "llmgw_installer", "--config", str(agent_cfg)])
    procs.start(
        "launcher", [py, "-m", "llmgw_launcher", "--config", str(agent_cfg), "--stop-engines-on-exit"]
    )
    api = f"http://127.0.0.1:{api_port}"
    print(
        f"llmgw: placement (API {api}), installer and launcher for node {NODE} started; logs in {procs.logs}",
        flush=True,
    )
    # `llmgw up` watches for readiness as the operator does, with the ctl identity.
    options = (
        BusOptions(url=url, insecure=True)
        if auth is None
        else BusOptions(url=url, nkey_seed_file=str(auth.seed("ctl")))
    )
    async with await Bus.connect(options, service="llmgw-up") as bus:
        replica = await _wait_ready(bus, procs, timeout=120)
    print(f"llmgw: deployment {DEPLOYMENT} replica {replica.replica} is ready at {replica.url}", flush=True)
    print("llmgw: try it:", flush=True)
    print(
        f"  curl -s {replica.url}/v1/chat/completions -H 'Content-Type: application/json' "
        """-d '{"model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}]}'""",
        flush=True,
    )
    if auth is None:
        print(f"llmgw: the cluster: LLMGW_NATS_URL={url} LLMGW_NATS_INSECURE=1 llmgw ctl nodes", flush=True)
        print(f"llmgw: its API: curl -s {api}/api/replicas", flush=True)
    else:
        print(
            f"llmgw: the cluster, as the operator: LLMGW_NATS_URL={url} "
            f"LLMGW_NATS_NKEY={auth.seed('ctl')} llmgw ctl nodes",
            flush=True,
        )
        print(f"llmgw: its API token: {auth.token()} (read only: {auth.token(read_only=True)})", flush=True)
        header = f'-H "Authorization: Bearer $(cat {auth.api_token_file})"'
        print(f"llmgw: its API: curl -s {header} {api}/api/replicas", flush=True)
    print(
        f"llmgw: metrics: placement {api}/metrics{' (with the API token)' if auth else ''}, "
        f"installer http://127.0.0.1:{metrics[0]}/metrics, launcher http://127.0.0.1:{metrics[1]}/metrics",
        flush=True,
    )
    print("llmgw: press Ctrl-C to stop the cluster", flush=True)


def run(data_dir: str, port: int, api_port: int = 8080, *, insecure: bool = False) -> int:
    telemetry.setup("llmgw-up")
    try:
        return anyio.run(_serve, Path(data_dir).resolve(), port, api_port, insecure)
    except KeyboardInterrupt:
        return 130
