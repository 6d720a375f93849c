"""A cluster of real processes on this machine: placement(s) and per-node installer + launcher."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from llmgw.auth import AuthDir
from llmgw_core.config import AgentConfig
from llmgw_launcher.records import Records
from llmgw_placement.config import ServerConfig
from tests.auth_support import session_for
from tests.metrics_support import value

# Engine ports of the test clusters: 20000-27499, a block of 2,500 for each of three xdist
# workers (`./dev test` runs three); `llmgw up` keeps its own 28000-28999.
PORTS_PER_WORKER = 2500


def _worker() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return int(worker) % 3 if worker.isdigit() else 0


def worker_ports() -> int:
    """The first engine port of this xdist worker's block (the first block outside xdist)."""
    return 20000 + PORTS_PER_WORKER * _worker()


def up_engine_ports() -> list[str]:
    """`llmgw up`'s `--engine-ports` for this xdist worker: a third of 28000-28998 each, so two
    `up` tests at once never take one engine port."""
    low = 28000 + 333 * _worker()
    return ["--engine-ports", f"{low}-{low + 332}"]


@dataclass
class Cluster:
    """On the session's server every process connects as its own llmgw identity
    (`auth`); on an outside server, as the test harness does."""

    root: Path
    nats_url: str
    prefix: str
    node_timeout_s: float = 2.0
    heartbeat_s: float = 0.3
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)
    auth: AuthDir | None = None
    # More of every process's `nats:` section (bucket sizes, say).
    nats_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.session = session_for(self.nats_url)
        if self.session is not None:
            self.auth = self.session.identities(self.prefix, self.root / "auth")

    def nats(self, identity: str) -> dict[str, Any]:
        """The `nats:` section of a process that connects as `identity` (placement, node-<id>, …)."""
        if self.session is None or self.auth is None:
            # A server the test started for itself (the chaos soak's): no identities.
            return {"url": self.nats_url, "prefix": self.prefix, "insecure": True, **self.nats_options}
        return {
            "url": self.session.url,
            "prefix": self.prefix,
            "nkey_seed_file": str(self.auth.seed(identity)),
            **self.nats_options,
        }

    @property
    def api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.auth.token()}"} if self.auth else {}

    def ctl_env(self) -> dict[str, str]:
        """The environment of an `llmgw ctl` run as the operator."""
        nats = self.nats("ctl")
        env = {**os.environ, "LLMGW_NATS_URL": nats["url"]}
        if "nkey_seed_file" in nats:
            env["LLMGW_NATS_NKEY"] = nats["nkey_seed_file"]
        if nats.get("insecure"):
            env["LLMGW_NATS_INSECURE"] = "1"
        return env

    def server_config(
        self,
        identity: str,
        catalog: list[dict[str, Any]],
        deployments: list[dict[str, Any]],
        extra: dict[str, Any] | None = None,
    ) -> Path:
        http: dict[str, Any] = {"host": "127.0.0.1", "port": 0}
        if self.auth is not None:
            http |= {
                "token_file": str(self.auth.api_token_file),
                "read_token_file": str(self.auth.api_read_token_file),
            }
        else:
            http |= {"insecure": True}
        config = msgspec.convert(
            {
                "nats": self.nats("placement"),
                "engines": [],
                "catalog": catalog,
                "deployments": deployments,
                "heartbeat_interval_s": self.heartbeat_s,
                "node_timeout_s": self.node_timeout_s,
                "http": http,
                "identity": identity,
                **(extra or {}),
            },
            ServerConfig,
        )
        path = self.root / f"server-{identity}.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        return path

    def agent_config(
        self,
        node: str,
        gpus: int,
        engines: dict[str, Any] | None = None,
        machine: str = "",
        extra: dict[str, Any] | None = None,
        simulate: dict[str, Any] | None = None,
    ) -> Path:
        # Nodes share this machine: each gets its own engine ports, and so does each xdist
        # worker's cluster (an engine that binds late, as vLLM does after a minute of imports,
        # would otherwise find its port taken by another test's).
        base = worker_ports() + 100 * (len(list(self.root.glob("agent-*.yaml"))) + 1)
        if self.session is not None:
            self.session.add_node(self.prefix, node)
        config = msgspec.convert(
            {
                "port_range": [base, base + 99],
                "node": node,
                "state_dir": str(self.root / (f"{node}@{machine}" if machine else node)),
                # Every node is this machine: loopback (unset, a node takes its default route's address).
                "mgmt_addr": "127.0.0.1",
                "nats": self.nats(f"node-{node}"),
                "simulate": {"gpu_count": gpus, **(simulate or {})},
                "heartbeat_interval_s": self.heartbeat_s,
                "stop_grace_s": 3.0,
                "restart_backoff_s": 0.3,
                "health_interval_s": 0.3,
                "engines": engines or {},
                **(extra or {}),
            },
            AgentConfig,
        )
        path = self.root / (f"agent-{node}@{machine}.yaml" if machine else f"agent-{node}.yaml")
        path.write_bytes(msgspec.yaml.encode(config))
        return path

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        self.argv[name] = argv
        return proc

    def respawn(self, name: str) -> subprocess.Popen[bytes]:
        """Start a process again with the command line it was first started with."""
        return self._spawn(name, self.argv[name])

    def start_placement(
        self,
        identity: str,
        catalog: list[dict[str, Any]],
        deployments: list[dict[str, Any]],
        extra: dict[str, Any] | None = None,
    ) -> subprocess.Popen[bytes]:
        """`extra`: more of server.yaml (the autoscaler's windows, say)."""
        path = self.server_config(identity, catalog, deployments, extra)
        return self._spawn(
            f"placement-{identity}", [sys.executable, "-m", "llmgw_placement", "--config", str(path)]
        )

    def start_node(
        self,
        node: str,
        gpus: int = 1,
        engines: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        simulate: dict[str, Any] | None = None,
    ) -> None:
        """An installer and a launcher for `node`; `engines` as agent.yaml names them, `extra`
        more of agent.yaml (`github_api`, say), `simulate` more of its pretend hardware
        (`memory_mb`, `gpu_memory_mb`, …)."""
        path = str(self.agent_config(node, gpus, engines, extra=extra, simulate=simulate))
        self._spawn(f"installer-{node}", [sys.executable, "-m", "llmgw_installer", "--config", path])
        self._spawn(f"launcher-{node}", [sys.executable, "-m", "llmgw_launcher", "--config", path])

    def start_machine(self, node: str, machine: str, gpus: int = 1) -> None:
        """Another machine's agents under the node id `node` (a replacement, or a mistake): their
        own state directory and processes (`installer-<node>@<machine>`, `launcher-…`)."""
        path = str(self.agent_config(node, gpus, machine=machine))
        name = f"{node}@{machine}"
        self._spawn(f"installer-{name}", [sys.executable, "-m", "llmgw_installer", "--config", path])
        self._spawn(f"launcher-{name}", [sys.executable, "-m", "llmgw_launcher", "--config", path])

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait()

    def engine_pids(self, node: str) -> list[int]:
        records, _ = Records(self.root / node).load_all()
        return sorted(p.pid for r in records.values() for p in r.procs)

    def kill_node(self, node: str) -> None:
        """kill -9 the node's agents and every engine they started."""
        self.kill(f"installer-{node}")
        self.kill(f"launcher-{node}")
        for pid in self.engine_pids(node):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

    async def steps(self, identity: str) -> float:
        """Control steps placement `identity` has finished since it last started, as its
        /metrics counts them (for `passes`)."""
        found = re.findall(r"API on (http://\S+)", self.log(f"placement-{identity}"))
        assert found, f"placement-{identity} serves no API yet"
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.get(f"{found[-1]}/metrics", headers=self.api_headers)
        assert r.status_code == 200, r.text
        return value(r.text, "llmgw_placement_step_duration_seconds_count")

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        for state in self.root.iterdir():
            if state.is_dir() and (state / "shards").is_dir():
                for pid in self.engine_pids(state.name):
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)


@contextlib.contextmanager
def cluster(root: Path, nats_url: str, prefix: str) -> Iterator[Cluster]:
    c = Cluster(root=root, nats_url=nats_url, prefix=prefix)
    try:
        yield c
    finally:
        c.close()


def sim_catalog(*args: str, name: str = "tiny") -> dict[str, Any]:
    return {
        "name": name,
        "engine": "sim",
        "model_path": "sim://tiny",
        "gpu_class": "H100-80G",
        "tp": 1,
        "args": ["--load-time", "0.3", *args],
        "health_timeout_s": 30.0,
    }
