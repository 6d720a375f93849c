"""An in-process placement served over HTTP (its API and cluster page), for tests that assert what
every surface says: the deployment's status on the bus, `ctl explain`/`describe`/`get` run
in-process over a real NATS, `/api/*` and the page."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from llmgw.ctl import _commands
from llmgw_core.bus import Bus
from llmgw_core.events import DeploymentStatus, ReplicaStatus
from llmgw_core.web import serve
from llmgw_placement.api import Api
from llmgw_placement.page import Page
from tests.control_support import ControlPlane, Placement


@contextlib.asynccontextmanager
async def served(cp: ControlPlane, identity: str = "a", **overrides: Any) -> AsyncIterator[Surfaces]:
    """A placement of `cp` with its API and page on a loopback port, as `llmgw-placement` serves them."""
    p = await cp.start_placement(identity, http={"port": 0, "insecure": True}, **overrides)
    api = Api(p.service)
    page = Page(p.service, api.nodes, catalog=api.catalog)
    cp.tg.start_soon(page.listen)
    port = await cp.tg.start(serve, api.app(page.routes()), "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        yield Surfaces(p, client)


class Surfaces:
    def __init__(self, placement: Placement, client: httpx.AsyncClient) -> None:
        self.placement = placement
        self.client = client

    async def page(self) -> str:
        r = await self.client.get("/")
        assert r.status_code == 200, r.text
        return r.text

    async def nodes(self) -> dict[str, dict[str, Any]]:
        return {r["node"]: r for r in (await self.client.get("/api/nodes")).json()}


def count_on_page(page: str, what: str) -> int:
    """A count of the page's summary line (`GPUs <b data-count='held'>2</b> held`)."""
    found = re.search(rf"<b data-count='{what}'[^>]*>(\d+)</b>", page)
    assert found is not None, what
    return int(found.group(1))


async def last_status(bus: Bus, deployment: str) -> DeploymentStatus | None:
    found = await bus.history(bus.names.deployment_event(deployment), DeploymentStatus, idle_s=0.3)
    return found[-1] if found else None


async def replica_events(bus: Bus, deployment: str, replica: str) -> list[tuple[str, str]]:
    found = await bus.history(bus.names.replica_event(deployment, replica), ReplicaStatus, idle_s=0.3)
    return [(e.state, e.reason) for e in found]


async def explain(bus: Bus, deployment: str) -> str:
    """`llmgw ctl explain DEPLOYMENT`, in-process."""
    return await _commands.explain(bus, deployment)


async def describe(bus: Bus, kind: str, name: str) -> str:
    """`llmgw ctl describe KIND NAME`, in-process."""
    return await _commands.describe(bus, kind, name)


async def get(bus: Bus, kind: str, name: str = "", output: str = "") -> str:
    """`llmgw ctl get KIND [NAME]`, in-process."""
    return await _commands.get(bus, kind, name, output)
