"""A three-server NATS cluster with JetStream on loopback, for tests that kill its members."""

from __future__ import annotations

import contextlib
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

from llmgw_core.natsd import NatsServer


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class NatsCluster:
    def __init__(self, root: Path, size: int = 3, includes: tuple[Path, ...] = ()) -> None:
        ports = _free_ports(2 * size)
        client, route = ports[:size], ports[size:]
        routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in route)
        self.servers: dict[str, NatsServer] = {}
        for i in range(size):
            name = f"n{i}"
            self.servers[name] = NatsServer(
                store_dir=root / name,
                port=client[i],
                max_store="2G",
                log_path=root / f"{name}.log",
                # The same auth.conf on every member (`llmgw auth init`), as a deployed cluster has.
                includes=includes,
                extra_config=(
                    f"server_name: {name}\n"
                    "cluster {\n  name: llmgw-test\n"
                    f"  listen: 127.0.0.1:{route[i]}\n  routes: [{routes}]\n}}\n"
                ),
            )

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers.values())

    def start(self) -> None:
        for server in self.servers.values():
            server.start()

    def kill(self, name: str) -> None:
        """kill -9 one member (by the pid this test started it with)."""
        server = self.servers[name]
        assert server.proc is not None
        server.proc.send_signal(signal.SIGKILL)
        server.stop()

    def restart(self, name: str) -> None:
        self.servers[name].start()

    def stop(self) -> None:
        for server in self.servers.values():
            with contextlib.suppress(Exception):
                server.stop()


@contextlib.contextmanager
def nats_cluster(root: Path, includes: tuple[Path, ...] = ()) -> Iterator[NatsCluster]:
    cluster = NatsCluster(root, includes=includes)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
