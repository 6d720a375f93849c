"""llmgw on hosts of its own (tests/multihost/hosts.py): every process where a fleet has it.

API (stable; the partition tests build on it):

    fleet = Fleet(net, prefix)                     # or the `make_fleet` fixture
    fleet.start_nats(("a", "b", "c"))              # a 3-server NATS cluster (JetStream R3),
                                                   # one server per host, llmgw identities on
    fleet.start_placement("a", "p1", catalog, deployments)
    fleet.start_gateway("c", "g1")                 # open to any client (no API key)
    fleet.start_node("d", "n1", gpus=1)            # installer + launcher of node n1 on host d,
                                                   # `mgmt_addr` d's address (None: left unset);
                                                   # extra= more agent.yaml, env= more environment
    fleet.nats_url                                 # every server, as clients are given them
    fleet.ctl("get", "nodes")                      # `llmgw ctl` in the root namespace,
    fleet.ctl("get", "nodes", host=net["e"])       # or on a host
    async with fleet.bus() as bus: ...             # the test's own connection (as `ctl`)
    await fleet.placement_url("p1")                # http://<a's addr>:8080 once it serves
    await fleet.gateway_url("g1")                  # http://<c's addr>:8000 once it serves
    fleet.where["launcher-n1"]                     # the Host a process runs on
    fleet.log("launcher-n1"); fleet.kill("launcher-n1")
    fleet.close()                                  # every process of every host

Each process connects with its own identity (`llmgw auth init`, auth.conf included by every
NATS server; a node added later is made live with a reload of each server), listens on its
host's address, never loopback, and logs to `<host state>/<name>.log`. Ports are fixed
(4222/6222 NATS, 8080 placement, 8000 gateway, 20000-20999 engines): each host is a network
namespace of its own, so they collide with nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from llmgw.auth import AuthDir
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.natsd import READY, find_nats_server, server_config
from llmgw_gateway.config import GatewayConfig
from llmgw_placement.config import ServerConfig
from tests.multihost.hosts import Host, Hosts
from tests.waiting import eventually

NATS_PORT = 4222
ROUTE_PORT = 6222
PLACEMENT_PORT = 8080
GATEWAY_PORT = 8000
ENGINE_PORTS = (20000, 20999)
CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]


@dataclass
class Fleet:
    net: Hosts
    prefix: str
    heartbeat_s: float = 0.3
    node_timeout_s: float = 3.0
    # JetStream replicas of every stream and bucket (3: each on every server).
    replicas: int = 3
    nats_hosts: tuple[str, ...] = ()
    where: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root = self.net.root / "fleet"
        self.root.mkdir(parents=True, exist_ok=True)
        self.auth = AuthDir(self.root / "auth")
        self.auth.init([], prefix=self.prefix)

    # --- NATS ------------------------------------------------------------------------

    @property
    def nats_url(self) -> str:
        return ",".join(f"nats://{self.net[h].addr}:{NATS_PORT}" for h in self.nats_hosts)

    def nats(self, identity: str) -> dict[str, Any]:
        """The `nats:` section of a process connecting as `identity` (placement, gateway, node-<id>)."""
        return {
            "url": self.nats_url,
            "prefix": self.prefix,
            "nkey_seed_file": str(self.auth.seed(identity)),
            "replicas": self.replicas,
        }

    def start_nats(self, hosts: Sequence[str] = ("a", "b", "c"), timeout: float = 30) -> None:
        """One NATS server on each of `hosts`, routed into one cluster, each ready on return."""
        self.nats_hosts = tuple(hosts)
        routes = ", ".join(f"nats-route://{self.net[h].addr}:{ROUTE_PORT}" for h in hosts)
        for h in hosts:
            host = self.net[h]
            store = host.state / "nats"
            store.mkdir(parents=True, exist_ok=True)
            include = os.path.relpath(self.auth.conf.resolve(), store.resolve())
            conf = store / "nats-server.conf"
            conf.write_text(
                server_config(
                    str(store / "jetstream"), host=host.addr, port=NATS_PORT, sync_always=True, max_store="2G"
                )
                + f"server_name: {h}\n"
                + f"cluster {{\n  name: llmgw-multihost\n  listen: {host.addr}:{ROUTE_PORT}\n"
                + f"  routes: [{routes}]\n}}\n"
                + f'include "{include}"\n'
            )
            self._spawn(host, f"nats-{h}", [find_nats_server(), "-c", str(conf)])
        deadline = time.monotonic() + timeout
        for h in hosts:
            while READY not in self.log(f"nats-{h}"):
                proc = self.net[h].procs[f"nats-{h}"]
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server on {h} did not become ready:\n{self.log(f'nats-{h}')}")
                time.sleep(0.05)

    def _reload_nats(self, timeout: float = 20) -> None:
        """Every server reads auth.conf again (a node's identity added), as SIGHUP does."""
        marker = "Reloaded server configuration"
        before = {h: self.log(f"nats-{h}").count(marker) for h in self.nats_hosts}
        for h in self.nats_hosts:
            self.net[h].procs[f"nats-{h}"].send_signal(1)  # SIGHUP
        deadline = time.monotonic() + timeout
        for h in self.nats_hosts:
            while self.log(f"nats-{h}").count(marker) <= before[h]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server on {h} did not reload:\n{self.log(f'nats-{h}')[-2000:]}")
                time.sleep(0.05)

    # --- processes -------------------------------------------------------------------

    def _spawn(
        self, host: Host, name: str, argv: list[str], env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        self.where[name] = host
        return host.spawn(name, argv, {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def _write(self, host: Host, name: str, config: Any, kind: type) -> Path:
        path = host.state / f"{name}.yaml"
        path.write_bytes(msgspec.yaml.encode(msgspec.convert(config, kind)))
        return path

    def start_placement(
        self,
        host: str,
        identity: str,
        catalog: list[dict[str, Any]],
        deployments: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Placement `identity` on `host`, its API on the host's address, port 8080."""
        h = self.net[host]
        config = {
            "nats": self.nats("placement"),
            "engines": [],
            "catalog": catalog,
            "deployments": deployments or [],
            "heartbeat_interval_s": self.heartbeat_s,
            "node_timeout_s": self.node_timeout_s,
            "http": {
                "host": h.addr,
                "port": PLACEMENT_PORT,
                "token_file": str(self.auth.api_token_file),
                "read_token_file": str(self.auth.api_read_token_file),
            },
            "identity": identity,
            **(extra or {}),
        }
        path = self._write(h, f"placement-{identity}", config, ServerConfig)
        argv = [sys.executable, "-m", "llmgw_placement", "--config", str(path)]
        return self._spawn(h, f"placement-{identity}", argv)

    def start_gateway(self, host: str, name: str = "gateway", **config: Any) -> subprocess.Popen[bytes]:
        """A gateway `name` on `host`, open to any client (no key), on the host's address, port 8000."""
        h = self.net[host]
        http = {"host": h.addr, "port": GATEWAY_PORT, "require_api_key": False, **config.pop("http", {})}
        path = self._write(h, name, {"nats": self.nats("gateway"), "http": http, **config}, GatewayConfig)
        return self._spawn(h, name, [sys.executable, "-m", "llmgw_gateway", "--config", str(path)])

    def agent_config(
        self,
        host: str,
        node: str,
        gpus: int = 1,
        mgmt_addr: str | None = "",
        extra: dict[str, Any] | None = None,
        simulate: dict[str, Any] | None = None,
    ) -> Path:
        """agent.yaml of `node` on `host`: `mgmt_addr` "" is the host's address, None leaves it
        out (the node finds its own)."""
        h = self.net[host]
        if self.auth.add_node(node) and self.nats_hosts:
            self._reload_nats()
        config: dict[str, Any] = {
            "node": node,
            "port_range": list(ENGINE_PORTS),
            "state_dir": str(h.state / node),
            "nats": self.nats(f"node-{node}"),
            "simulate": {"gpu_count": gpus, **(simulate or {})},
            "heartbeat_interval_s": self.heartbeat_s,
            "stop_grace_s": 3.0,
            "restart_backoff_s": 0.3,
            "health_interval_s": 0.3,
            # Specs read afresh on the scale of these fleets' node timeouts (30 s by default).
            "spec_resync_s": 5.0,
            **({"mgmt_addr": mgmt_addr or h.addr} if mgmt_addr is not None else {}),
            **(extra or {}),
        }
        return self._write(h, f"agent-{node}", config, AgentConfig)

    def start_node(
        self,
        host: str,
        node: str,
        gpus: int = 1,
        mgmt_addr: str | None = "",
        extra: dict[str, Any] | None = None,
        simulate: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """The installer and launcher of `node` on `host` (`installer-<node>`, `launcher-<node>`),
        `env` more of their environment (HF_ENDPOINT, say)."""
        path = str(self.agent_config(host, node, gpus, mgmt_addr, extra, simulate))
        h = self.net[host]
        for service in ("installer", "launcher"):
            argv = [sys.executable, "-m", f"llmgw_{service}", "--config", path]
            self._spawn(h, f"{service}-{node}", argv, env)

    def log(self, name: str) -> str:
        host = self.where.get(name)
        return host.log(name) if host is not None else ""

    def kill(self, name: str) -> None:
        self.where.pop(name).kill(name)

    def close(self) -> None:
        for name in list(self.where):
            with contextlib.suppress(Exception):
                self.kill(name)
        for host in self.net:
            with contextlib.suppress(Exception):
                host.stop()

    # --- clients ---------------------------------------------------------------------

    def ctl_env(self) -> dict[str, str]:
        return {
            **os.environ,
            "LLMGW_NATS_URL": self.nats_url,
            "LLMGW_NATS_NKEY": str(self.auth.seed("ctl")),
        }

    def ctl(
        self, *args: str, host: Host | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """`llmgw ctl ARGS` as the operator: in the root namespace, or on `host`."""
        argv = [*CTL, "--prefix", self.prefix, *args]
        if host is not None:
            return host.run(argv, timeout=timeout, env=self.ctl_env())
        return subprocess.run(
            argv, capture_output=True, text=True, env=self.ctl_env(), timeout=timeout, check=False
        )

    @contextlib.asynccontextmanager
    async def bus(self) -> AsyncIterator[Bus]:
        """The test's own connection from the root namespace, as the `ctl` identity."""
        options = BusOptions(
            url=self.nats_url,
            prefix=self.prefix,
            nkey_seed_file=str(self.auth.seed("ctl")),
            replicas=self.replicas,
        )
        async with await Bus.connect(options, service="multihost-test") as bus:
            yield bus

    @property
    def api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.auth.token()}"}

    async def _printed(self, name: str, pattern: str, timeout: float) -> str:
        def found() -> str:
            text = self.log(name)
            assert self.where[name].procs[name].poll() is None, f"{name} exited:\n{text[-3000:]}"
            m = re.findall(pattern, text)
            assert m, f"{name} has not said where it serves yet:\n{text[-3000:]}"
            return str(m[-1])

        return str(await eventually(found, timeout=timeout, interval=0.1))

    async def placement_url(self, identity: str, timeout: float = 60) -> str:
        """The API placement `identity` says it serves on."""
        return await self._printed(f"placement-{identity}", r"API on (http://\S+)", timeout)

    async def gateway_url(self, name: str = "gateway", timeout: float = 60) -> str:
        """The OpenAI endpoint gateway `name` says it serves on (without /v1)."""
        return await self._printed(name, r"OpenAI endpoint on (http://\S+)/v1", timeout)
