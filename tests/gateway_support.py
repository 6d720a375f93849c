"""A gateway's proxy in this process over fixed replicas, for tests and benchmarks that are
about the gateway alone (no bus: the replicas are set in its table as placement would)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import httpx

from llmgw_core.events import ReplicaRecord
from llmgw_gateway import Proxy, Table
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.web import serve_app
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
            port = await tg.start(serve_app, proxy.app, "127.0.0.1", 0)
            yield Served(f"http://127.0.0.1:{port}", proxy, table, client)
            tg.cancel_scope.cancel()
