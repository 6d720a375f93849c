"""Placement's HTTP API: `/api/nodes`, `/api/deployments`, `/api/replicas`, `/api/shards`,
`/api/explain/<d>`, `/api/warnings`, `/api/store`, `/api/catalog`, `/api/usage`, `/metrics`.

Every placement serves it; a standby answers from the same watched state, but
replicas and decisions are the leader's: there a standby answers 503 naming the
leader. `/healthz` answers 503 while this placement cannot work (NATS out of
reach, or a lease it could not renew within the lease period).
Every route but `/healthz` wants `Authorization: Bearer <token>`: the API
token reads and writes, the read token (for dashboards) only reads.

`Api.app(extra)` is a Starlette app of `Api.routes()` and any routes another
part adds (the cluster page), all behind the same token guard; a route that
must answer without a token adds its path to `Api.public`.

The rows of `/api/nodes` are in `node_rows`, the deployments' routes in
`deployments_api`, a node's cordon and drain in `nodes_api`, the token guard in
`token_guard`.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from llmgw_core.errors import ConfigError
from llmgw_core.events import Deployment, ShardStatus
from llmgw_core.metrics import exposition
from llmgw_core.web import MAX_BODY, json_response

from .deployments_api import catalog_problem, explain, put_deployment
from .node_rows import NodeRow, NodeRows
from .nodes_api import node_routes
from .service import PlacementService
from .token_guard import TokenGuard, no_route, read_token
from .usage import UsageWindow

log = logging.getLogger("llmgw.placement.api")


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


class ShardRow(msgspec.Struct, frozen=True, kw_only=True):
    """One shard in `/api/shards`: how it reads now, and its status as its node last stored it."""

    shard: str
    node: str
    # The stored state, or `unknown (node lost 13 s ago)` while its node is lost.
    state: str
    replica: str
    status: ShardStatus


class CatalogRow(msgspec.Struct, frozen=True, kw_only=True):
    """One profile in `/api/catalog`: what it runs and what a replica of it asks for."""

    name: str
    engine: str
    gpu_class: str
    tp: int
    pp: int
    nodes: int
    # GPUs each node of a replica gives it, and a replica's GPUs in all.
    gpus_per_node: int
    gpus: int
    # Where the weights come from (`model`, a source or a served name) or are read (`model_path`).
    model: str
    model_path: str
    served_name: str
    # The nodes that report holding its weights staged.
    weights_on: tuple[str, ...]
    # The deployments that run it.
    deployments: tuple[str, ...]


class Api:
    def __init__(self, service: PlacementService) -> None:
        self.service = service
        http = service.config.http
        self.token = read_token(http.token_file, "token_file") if http.token_file else b""
        self.read_token = read_token(http.read_token_file, "read_token_file") if http.read_token_file else b""
        # `/api/nodes`' rows, each node's encoded once until it reports anew.
        self.rows = NodeRows(service)
        # Paths that answer without a token (they must say nothing a token would protect).
        self.public: set[str] = {"/healthz"}
        # Tokens spent per key and deployment over the last day (`follow` keeps it current).
        self.usage = UsageWindow(service.bus)
        # Awaited with a deployment's name between reading its revision and writing it: where a
        # test makes another writer's change land.
        self.before_write: Callable[[str], Awaitable[None]] | None = None
        if not self.token and not http.insecure:
            raise ConfigError(
                "http: no token_file: the API would let anyone who reaches it change deployments; "
                "set http: token_file (and read_token_file) to the files `llmgw auth init` writes, "
                "or http: insecure: true"
            )
        if not self.token:
            log.warning(
                "the API on %s:%d has no token (http: insecure: true): anyone who reaches it may change "
                "deployments",
                http.host,
                http.port,
            )

    def access(self, authorization: str) -> str:
        """`write`, `read` or `none`, from a request's Authorization header."""
        if not self.token:
            return "write"
        scheme, _, given = authorization.partition(" ")
        presented = given.strip().encode() if scheme.lower() == "bearer" else b""
        # Both comparisons always run, in constant time: how long a refusal takes says
        # nothing about which token, or how much of one, was right.
        write = hmac.compare_digest(presented, self.token)
        read = bool(self.read_token) and hmac.compare_digest(presented, self.read_token)
        return "write" if write else "read" if read else "none"

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/healthz", self.whoami, methods=["GET"]),
            Route("/api/nodes", self.get_nodes, methods=["GET"]),
            *node_routes(self.service),
            Route("/api/deployments", self.get_deployments, methods=["GET"]),
            Route("/api/deployments", self.put_deployment, methods=["POST"]),
            Route("/api/replicas", self.get_replicas, methods=["GET"]),
            Route("/api/shards", self.get_shards, methods=["GET"]),
            Route("/api/explain/{name}", self.get_explain, methods=["GET"]),
            Route("/api/warnings", self.get_warnings, methods=["GET"]),
            Route("/api/store", self.get_store, methods=["GET"]),
            Route("/api/catalog", self.get_catalog, methods=["GET"]),
            Route("/api/usage", self.get_usage, methods=["GET"]),
            Route("/metrics", self.get_metrics, methods=["GET"]),
        ]

    def app(self, extra: Sequence[BaseRoute] = ()) -> Starlette:
        """The API's routes and `extra`, behind the token guard."""
        app = Starlette(
            routes=[*self.routes(), *extra],
            exception_handlers={404: no_route, 405: no_route},
            max_body_size=MAX_BODY,
        )
        app.add_middleware(TokenGuard, api=self)
        return app

    # --- routes ---------------------------------------------------------------------

    async def whoami(self, _: Request) -> Response:
        body: dict[str, Any] = {"leader": self.service.is_leader, "identity": self.service.identity}
        lost = self.service.store_lost()
        if lost:
            body["store"] = lost
        trouble = self.service.trouble()
        if trouble:
            body["error"] = trouble
            return json_response(body, 503)
        return json_response(body)

    async def get_nodes(self, _: Request) -> Response:
        return Response(self.nodes_json(), media_type="application/json")

    async def get_deployments(self, _: Request) -> Response:
        return json_response({k: _builtins(v) for k, v in sorted(self.service.state.deployments.items())})

    async def get_replicas(self, _: Request) -> Response:
        if self.service.view.mine() is None:
            return self.standby()
        return json_response({k: _builtins(v) for k, v in sorted(self.service.view.replicas().items())})

    async def get_shards(self, _: Request) -> Response:
        return json_response(_builtins(self.shards()))

    def shards(self) -> list[ShardRow]:
        statuses = self.service.state.shard_status
        reading = self.service.view.shard_states(time.monotonic())
        return [
            ShardRow(
                shard=f"{s.node}/{s.shard}",
                node=s.node,
                state=reading.get(k, s.state),
                replica=f"{s.deployment}/{s.replica}" if s.deployment else s.replica,
                status=s,
            )
            for k, s in sorted(statuses.items())
        ]

    async def get_explain(self, request: Request) -> Response:
        if not self.service.is_leader:
            return self.standby()
        return self.explain(request.path_params["name"])

    async def get_warnings(self, _: Request) -> Response:
        return json_response({"warnings": self.service.warnings()})

    def standby(self) -> Response:
        """503 for what only the leader knows (its replicas and decisions), naming the leader."""
        leader = self.service.leader()
        said = f"the leader is {leader}" if leader else "no placement leads now"
        trouble = self.service.trouble()
        return json_response(
            {
                "error": f"standby: {said}; replicas and decisions are the leader's"
                + (f" ({trouble})" if trouble else ""),
                "leader": leader,
            },
            503,
        )

    async def get_store(self, _: Request) -> Response:
        """Whether NATS refuses this placement's writes for space: since when, which streams and
        why, and the one line every surface says (`banner`); `full: false` once a write lands."""
        store = self.service.bus.store
        episode = store.episode
        body: dict[str, Any] = {
            "full": episode is not None,
            "banner": store.banner(),
            "since": episode.since if episode else None,
            "streams": {s: r.reason for s, r in sorted(episode.streams.items())} if episode else {},
            "refused": episode.refused if episode else 0,
            "refused_total": store.refused_total,
            "episodes": store.episodes,
        }
        lost = self.service.bus.losses.last
        # A store emptied or replaced under the cluster: which streams, since when, rebuilt when.
        body["lost"] = (
            {
                "since": lost.since,
                "streams": list(lost.streams),
                "rebuilt": lost.rebuilt,
                "banner": lost.words(),
            }
            if lost is not None
            else None
        )
        return json_response(body)

    async def get_catalog(self, _: Request) -> Response:
        return json_response(_builtins(self.catalog()))

    def catalog(self) -> list[CatalogRow]:
        state = self.service.state
        holders: dict[str, list[str]] = {}
        for node, status in sorted(state.nodes.items()):
            for key, path in status.facts.weights.items():
                if path:
                    holders.setdefault(key, []).append(node)
        users: dict[str, list[str]] = {}
        for name, dep in sorted(state.deployments.items()):
            users.setdefault(dep.profile, []).append(name)
        rows = []
        for name, p in sorted(state.catalog.items()):
            per_node = p.per_node_gpus
            rows.append(
                CatalogRow(
                    name=name,
                    engine=p.engine,
                    gpu_class=p.gpu_class,
                    tp=p.tp,
                    pp=p.pp,
                    nodes=p.nodes,
                    gpus_per_node=per_node,
                    gpus=per_node * p.nodes,
                    model=p.model,
                    model_path=p.model_path,
                    served_name=p.served_name,
                    weights_on=tuple(holders.get(p.weights_key, ())),
                    deployments=tuple(users.get(name, ())),
                )
            )
        return rows

    async def get_usage(self, request: Request) -> Response:
        """The last day's tokens and requests, as `llmgw ctl usage -o json` sums them (`?by=key`
        or `?by=deployment` sums over the other); a stream this placement cannot read is said
        in the `X-Llmgw-Usage-Error` header."""
        by = request.query_params.get("by", "")
        if by not in ("", "key", "deployment"):
            return json_response({"error": f"by={by}: sum by key or by deployment (or leave it out)"}, 400)
        # A header is latin-1: the error's `…` (an nkey cut short) would make it a 500.
        error = self.usage.error.encode("ascii", "replace").decode()
        headers = {"X-Llmgw-Usage-Error": error} if error else None
        return json_response(_builtins(self.usage.rows(by)), headers=headers)

    async def get_metrics(self, request: Request) -> Response:
        return exposition(self.service.metrics.registry, request)

    def nodes(self) -> list[NodeRow]:
        return self.rows.nodes()

    def node_row(self, name: str, at: float) -> NodeRow:
        return self.rows.node_row(name, at)

    def nodes_json(self) -> bytes:
        """`/api/nodes`' body (`NodeRows.nodes_json`)."""
        return self.rows.nodes_json()

    def explain(self, name: str) -> Response:
        """`GET /api/explain/<name>`' answer (`deployments_api.explain`)."""
        return explain(self.service, name)

    async def put_deployment(self, req: Request) -> Response:
        """`POST /api/deployments` (`deployments_api.put_deployment`)."""
        return await put_deployment(self.service, req, self.before_write)

    async def profile_problem(self, dep: Deployment) -> str | None:
        """Why `dep` names a profile that is not in the catalog (`deployments_api.catalog_problem`)."""
        return await catalog_problem(self.service, dep)

    def refused(self) -> None:
        """A request refused for its token (401 or 403): counted."""
        self.service.metrics.api_unauthorized.inc()
