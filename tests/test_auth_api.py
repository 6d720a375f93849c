"""Placement's HTTP API wants a bearer token: the API token reads and writes, the read token reads."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from llmgw.auth import AuthDir
from llmgw_core.bus import Bus
from llmgw_core.errors import ConfigError
from llmgw_core.events import Deployment
from llmgw_core.web import serve
from llmgw_placement import PlacementService, ServerConfig
from llmgw_placement.api import Api
from tests.cluster_support import sim_catalog
from tests.metrics_support import value
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def config(nats_url: str, prefix: str, http: dict[str, object]) -> ServerConfig:
    return msgspec.convert(
        {
            "nats": {"url": nats_url, "prefix": prefix},
            "engines": [],
            "catalog": [sim_catalog()],
            "http": http,
        },
        ServerConfig,
    )


@pytest.fixture
async def api(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> AsyncIterator[tuple[str, AuthDir, Api]]:
    auth = AuthDir(tmp_path / "auth")
    auth.init([], prefix=prefix)
    cfg = config(
        nats_url,
        prefix,
        {"port": 0, "token_file": str(auth.api_token_file), "read_token_file": str(auth.api_read_token_file)},
    )
    service = PlacementService(cfg, bus)
    handler = Api(service)
    async with anyio.create_task_group() as tg:
        await tg.start(service.run)
        port = await tg.start(serve, handler.app(), "127.0.0.1", 0)
        yield f"http://127.0.0.1:{port}", auth, handler
        tg.cancel_scope.cancel()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_without_the_token_nothing_is_read_or_written(api: tuple[str, AuthDir, Api], bus: Bus) -> None:
    url, auth, handler = api
    chat = {"name": "chat", "profile": "tiny", "replicas": 1}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for headers in (
            {},
            bearer("wrong-" + auth.token()),
            bearer(auth.token()[:-1]),
            {"Authorization": auth.token()},
        ):
            for method, path in [("GET", "/api/nodes"), ("GET", "/api/deployments"), ("GET", "/metrics")]:
                r = await client.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                assert r.headers["www-authenticate"] == 'Bearer realm="llmgw"'
            r = await client.post("/api/deployments", json=chat, headers=headers)
            assert r.status_code == 401
            assert r.json() == {"error": "this API wants Authorization: Bearer <token>"}
        # The read token reads, and cannot write.
        r = await client.get("/api/deployments", headers=bearer(auth.token(read_only=True)))
        assert r.status_code == 200
        r = await client.post("/api/deployments", json=chat, headers=bearer(auth.token(read_only=True)))
        assert r.status_code == 403
        assert r.json() == {"error": "the read token cannot change anything; use the API token"}
        assert await bus.get(bus.names.deployments_bucket, "chat", Deployment) is None
        # The API token does both (once the catalog, seeded as placement takes the lease, has
        # the deployment's profile: a deployment naming no profile is refused).
        await eventually(lambda: "tiny" in handler.service.state.catalog, timeout=30)
        r = await client.post("/api/deployments", json=chat, headers=bearer(auth.token()))
        assert r.status_code == 200
        written = await bus.get(bus.names.deployments_bucket, "chat", Deployment)
        assert written is not None
        assert (written[0].name, written[0].replicas) == ("chat", 1)
        # Health checks need no token; they say only whether this placement leads.
        r = await client.get("/healthz")
        assert r.status_code == 200
        assert set(r.json()) == {"leader", "identity"}
        metrics = (await client.get("/metrics", headers=bearer(auth.token(read_only=True)))).text
        assert value(metrics, "llmgw_api_unauthorized_total") == 17


async def test_permission_refusals_are_counted_in_metrics(api: tuple[str, AuthDir, Api], bus: Bus) -> None:
    url, auth, handler = api
    # The harness may do anything; a refusal is what the server says, so feed one in as it would.
    assert handler.service.bus.nc.refused(Exception('nats: permissions violation for publish to "x.y"'))
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(auth.token())) as client:
        metrics = (await client.get("/metrics")).text
    assert value(metrics, "llmgw_bus_permission_denied_total") == 1


async def test_an_api_without_a_token_must_be_asked_for(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    service = PlacementService(config(nats_url, prefix, {"port": 0}), bus)
    with pytest.raises(ConfigError) as err:
        Api(service)
    assert str(err.value) == (
        "http: no token_file: the API would let anyone who reaches it change deployments; set http: "
        "token_file (and read_token_file) to the files `llmgw auth init` writes, or http: insecure: true"
    )
    short = tmp_path / "short"
    short.write_text("abc\n")
    service = PlacementService(config(nats_url, prefix, {"port": 0, "token_file": str(short)}), bus)
    with pytest.raises(ConfigError, match="holds 3 characters; a token needs at least 16"):
        Api(service)
    open_api = Api(PlacementService(config(nats_url, prefix, {"port": 0, "insecure": True}), bus))
    assert open_api.token == b""


async def test_routes_that_do_not_exist_say_so_and_a_trailing_slash_is_the_same_route(
    api: tuple[str, AuthDir, Api],
) -> None:
    url, auth, _ = api
    async with httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(auth.token())) as client:
        r = await client.get("/api/nope")
        assert (r.status_code, r.json()) == (404, {"error": "no route GET /api/nope"})
        r = await client.post("/api/nodes", json={})
        assert (r.status_code, r.json()) == (405, {"error": "no route POST /api/nodes"})
        assert (await client.get("/api/deployments/")).json() == (await client.get("/api/deployments")).json()
        # A body past the bound is refused before it is read whole.
        r = await client.post("/api/deployments", content=b"x" * (8 * 1024 * 1024 + 1))
        assert (r.status_code, r.text) == (413, "Content Too Large")
        r = await client.post("/api/deployments", content=b'{"name": "chat"}')
        assert r.status_code == 400
        assert r.json()["error"].startswith("invalid deployment: Object missing required field")
    # Without a token, a route that does not exist is no different from one that does.
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        assert (await client.get("/api/nope")).status_code == 401


async def test_another_part_adds_routes_behind_the_same_token(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    auth = AuthDir(tmp_path / "auth")
    auth.init([], prefix=prefix)
    cfg = config(nats_url, prefix, {"port": 0, "token_file": str(auth.api_token_file)})
    handler = Api(PlacementService(cfg, bus))

    async def page(_: Request) -> Response:
        return HTMLResponse("<h1>cluster</h1>")

    handler.public.add("/status")
    app = handler.app([Route("/page", page), Route("/status", page)])
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, app, "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.get("/page")).status_code == 401
            r = await client.get("/page", headers=bearer(auth.token()))
            assert (r.status_code, r.text) == (200, "<h1>cluster</h1>")
            assert (await client.get("/status")).status_code == 200
            assert (await client.get("/api/nodes")).status_code == 401
        tg.cancel_scope.cancel()
