"""The gateway for tests: its proxy in this process over fixed replicas, for tests and
benchmarks that are about the gateway alone (no bus: the replicas are set in its table as
placement would), and `llmgw-gateway` as a process of its own on a test's cluster."""

from __future__ import annotations

import contextlib
import re
import resource
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import msgspec
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from llmgw_core.events import ReplicaRecord
from llmgw_gateway import GatewayConfig, Proxy, Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.connections import Connections, protocol
from llmgw_gateway.proxy import ROUTED
from llmgw_gateway.web import serve_app
from tests.cluster_support import Cluster
from tests.waiting import eventually


@dataclass(frozen=True)
class Served:
    url: str
    proxy: Proxy
    table: Table
    client: httpx.AsyncClient


async def answers_health(client: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health")).status_code == 200
    except httpx.ConnectError:
        return False


async def serve_proxy(
    proxy: Proxy,
    app: ASGIApp | None = None,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `proxy` on a free loopback port as `llmgw-gateway` serves it: through the
    gateway's HTTP protocol, its express lane and its connection guard included; `app`: an
    ASGI app in front of the proxy's own."""
    connections = Connections(1000, header_timeout_s=30, body_timeout_s=30, registry=CollectorRegistry())
    await serve_app(
        app or proxy.app,
        "127.0.0.1",
        0,
        protocol=protocol(connections, proxy, ROUTED),
        task_status=task_status,
    )


@contextlib.asynccontextmanager
async def proxy_over(
    urls: list[str],
    *,
    engine: str = "sim",
    routing: RoutingConfig | None = None,
    timeout_s: float = 30,
) -> AsyncIterator[Served]:
    """The proxy over ready replicas r0, r1, … of deployment `chat` at `urls`, once each
    answers `/health` (placement would pick r0 first: nothing in flight, none chosen before)."""
    table = Table(routing=routing or RoutingConfig())
    for i, url in enumerate(urls):
        table.set_replica(
            f"chat.r{i}",
            ReplicaRecord(
                deployment="chat",
                replica=f"r{i}",
                profile="tiny",
                profile_fp="x",
                state="ready",
                url=url,
                engine=engine,
            ),
        )
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        for url in urls:
            await eventually(lambda url=url: answers_health(client, url), timeout=30, interval=0.1)
        async with Proxy(table, client) as proxy, anyio.create_task_group() as tg:
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            yield Served(f"http://127.0.0.1:{port}", proxy, table, client)
            tg.cancel_scope.cancel()


@dataclass(frozen=True)
class GatewayProcess:
    """`llmgw-gateway` started by a test: its process and its log."""

    proc: subprocess.Popen[bytes]
    log: Path
    # Where its own lines begin in the log (an earlier process of the same name wrote before).
    start: int = 0

    def text(self) -> str:
        """What this process wrote to its log."""
        with self.log.open("rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    async def endpoint(self, timeout: float = 60) -> str:
        """Its base URL, once it printed its endpoint (failing at once if it exits first)."""

        def found() -> str:
            text = self.text()
            assert self.proc.poll() is None, text
            m = re.search(r"OpenAI endpoint on (http://\S+)/v1", text)
            assert m, text
            return m.group(1)

        return await eventually(found, timeout=timeout, interval=0.1)


@contextlib.contextmanager
def gateway_process(
    c: Cluster,
    root: Path,
    name: str = "gateway",
    *,
    args: tuple[str, ...] = (),
    open_files: int | None = None,
    http: dict[str, Any] | None = None,
    **config: Any,
) -> Iterator[GatewayProcess]:
    """`llmgw-gateway` as a process of its own on `c`'s bus: its config `root/<name>.yaml` (its
    `http` section on port 0 unless `http` says otherwise; `config` more of its keys), its log
    `root/<name>.log` (appended: a restart under the same name keeps the first's), `args` more
    of its command line, `open_files` its open-file limit (soft and hard). Stopped at the end if
    still running: SIGTERM, then SIGKILL after 15 s."""
    root.mkdir(parents=True, exist_ok=True)
    full = {"nats": c.nats("gateway"), "http": {"port": 0, **(http or {})}, **config}
    path = root / f"{name}.yaml"
    path.write_bytes(msgspec.yaml.encode(msgspec.convert(full, GatewayConfig)))
    log = root / f"{name}.log"

    def limit() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    start = log.stat().st_size if log.exists() else 0
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_gateway", "--config", str(path), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=limit if open_files is not None else None,
        )
    try:
        yield GatewayProcess(proc, log, start)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        proc.wait()
