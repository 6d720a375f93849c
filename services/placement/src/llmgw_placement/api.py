"""Placement's HTTP API: `/api/nodes`, `/api/deployments`, `/api/replicas`, `/api/explain/<d>`, `/metrics`.

Every placement serves it; a standby answers from the same watched state.
Every route but `/healthz` wants `Authorization: Bearer <token>`: the API
token reads and writes, the read token (for dashboards) only reads.
"""

from __future__ import annotations

import hmac
import logging
import time
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import trace

from llmgw_core.engines import GPUInfo
from llmgw_core.errors import BusError, ConfigError
from llmgw_core.events import Deployment, EngineState
from llmgw_core.httpserver import Request, Response, json_response, text_response
from llmgw_core.telemetry import context_from, current_traceparent

from .decide import Refusal, decide
from .service import PlacementService

tracer = trace.get_tracer("llmgw.placement.api")
log = logging.getLogger("llmgw.placement.api")

UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="llmgw"'}


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


_encode = msgspec.json.Encoder().encode


class NodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One node in `/api/nodes`: as its agents reported it, and whether placement hears it."""

    node: str
    alive: bool
    # Seconds since its launcher was last heard; -1 if never since this placement started.
    seen_s_ago: float
    gpus: tuple[GPUInfo, ...]
    engines: tuple[EngineState, ...]
    install: str
    warnings: tuple[str, ...]
    probed_at: float


def _read_token(path: str, what: str) -> bytes:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"http: {what} {path}: cannot read it: {exc.strerror or exc}") from exc
    if len(token) < 16:
        raise ConfigError(f"http: {what} {path} holds {len(token)} characters; a token needs at least 16")
    return token.encode()


class Api:
    def __init__(self, service: PlacementService) -> None:
        self.service = service
        http = service.config.http
        self.token = _read_token(http.token_file, "token_file") if http.token_file else b""
        self.read_token = (
            _read_token(http.read_token_file, "read_token_file") if http.read_token_file else b""
        )
        self.refused = 0
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

    def _access(self, req: Request) -> str:
        """`write`, `read` or `none`, from the request's bearer token."""
        if not self.token:
            return "write"
        scheme, _, given = req.headers.get("authorization", "").partition(" ")
        presented = given.strip().encode() if scheme.lower() == "bearer" else b""
        # Both comparisons always run, in constant time: how long a refusal takes says
        # nothing about which token, or how much of one, was right.
        write = hmac.compare_digest(presented, self.token)
        read = bool(self.read_token) and hmac.compare_digest(presented, self.read_token)
        return "write" if write else "read" if read else "none"

    async def handle(self, req: Request) -> Response:
        path = req.path.rstrip("/")
        if path == "/healthz":
            return json_response({"leader": self.service.is_leader, "identity": self.service.identity})
        access = self._access(req)
        if access == "none":
            self.refused += 1
            response = json_response({"error": "this API wants Authorization: Bearer <token>"}, 401)
            response.headers.update(UNAUTHORIZED)
            return response
        if req.method not in ("GET", "HEAD") and access != "write":
            self.refused += 1
            return json_response({"error": "the read token cannot change anything; use the API token"}, 403)
        return await self._route(req, path)

    async def _route(self, req: Request, path: str) -> Response:
        if path == "/api/nodes" and req.method == "GET":
            # msgspec encodes 10,000 nodes with their GPUs in milliseconds; stdlib json does not.
            return Response(body=_encode(self.nodes()) + b"\n")
        if path == "/api/deployments":
            if req.method == "POST":
                return await self.put_deployment(req)
            return json_response({k: _builtins(v) for k, v in sorted(self.service.state.deployments.items())})
        if path == "/api/replicas":
            controller = self.service.controller
            replicas = controller.replicas if controller else {}
            return json_response({k: _builtins(v) for k, v in sorted(replicas.items())})
        if path.startswith("/api/explain/"):
            return self.explain(path.removeprefix("/api/explain/"))
        if path == "/metrics":
            return text_response(self.metrics(), content_type="text/plain; version=0.0.4")
        if path == "":
            return json_response({"leader": self.service.is_leader, "identity": self.service.identity})
        return json_response({"error": f"no route {req.method} {req.path}"}, 404)

    def nodes(self) -> list[NodeRow]:
        controller = self.service.controller
        at = time.monotonic()
        out = []
        for name in sorted(self.service.state.nodes):
            status = self.service.state.nodes[name]
            alive, since = controller.alive(status.node, at) if controller else (True, 0.0)
            out.append(
                NodeRow(
                    node=status.node,
                    alive=alive,
                    seen_s_ago=round(since, 1) if since != float("inf") else -1.0,
                    gpus=status.facts.gpus,
                    engines=status.engines,
                    install=status.install,
                    warnings=status.warnings,
                    probed_at=status.probed_at,
                )
            )
        return out

    def explain(self, name: str) -> Response:
        dep = self.service.state.deployments.get(name)
        if dep is None:
            return json_response({"error": f"no deployment {name!r}"}, 404)
        profile = self.service.state.catalog.get(dep.profile)
        controller = self.service.controller
        last = controller.decisions.get(name) if controller else None
        body: dict[str, Any] = {"deployment": name, "last_decision": _builtins(last) if last else None}
        if profile is None:
            body["now"] = {"outcome": "refused", "reason": f"profile {dep.profile} is not in the catalog"}
        elif controller is not None:
            decision = decide(
                dep,
                profile,
                controller.views(time.monotonic()),
                port_range=self.service.config.dist_port_range,
            )
            if isinstance(decision, Refusal):
                body["now"] = {
                    "outcome": "refused",
                    "reasons": [{"node": n, "reason": r} for n, r in decision.reasons],
                }
            else:
                body["now"] = {
                    "outcome": "placed",
                    "members": _builtins(decision.members),
                    "fabric": decision.fabric,
                }
        return json_response(body)

    async def put_deployment(self, req: Request) -> Response:
        try:
            dep = msgspec.json.decode(req.body, type=Deployment)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return json_response({"error": f"invalid deployment: {exc}"}, 400)
        with tracer.start_as_current_span(
            f"api deploy {dep.name}", context=context_from(req.headers.get("traceparent", ""))
        ):
            dep = msgspec.structs.replace(dep, traceparent=current_traceparent())
            try:
                await self.service.bus.put(self.service.bus.names.deployments_bucket, dep.name, dep)
            except BusError as exc:
                return json_response({"error": str(exc)}, 503)
        return json_response(_builtins(dep))

    def metrics(self) -> str:
        controller = self.service.controller
        replicas = controller.replicas.values() if controller else []
        lines = [
            "# HELP llmgw_placement_leader 1 if this placement holds the lease.",
            "# TYPE llmgw_placement_leader gauge",
            f"llmgw_placement_leader {int(self.service.is_leader)}",
            "# HELP llmgw_replicas Replicas by deployment and state.",
            "# TYPE llmgw_replicas gauge",
        ]
        counts: dict[tuple[str, str], int] = {}
        for r in replicas:
            counts[(r.deployment, r.state)] = counts.get((r.deployment, r.state), 0) + 1
        for (dep, state), n in sorted(counts.items()):
            lines.append(f'llmgw_replicas{{deployment="{dep}",state="{state}"}} {n}')
        lines += [
            "# HELP llmgw_placement_behind 1 while placement is behind (node deadlines extended).",
            "# TYPE llmgw_placement_behind gauge",
            f"llmgw_placement_behind {int(self.service.behind)}",
            "# HELP llmgw_placement_stalls_total Times placement's loop ran over 0.5 s late.",
            "# TYPE llmgw_placement_stalls_total counter",
            f"llmgw_placement_stalls_total {self.service.stalls}",
            "# HELP llmgw_placement_step_failures_total Control steps that failed (retried with backoff).",
            "# TYPE llmgw_placement_step_failures_total counter",
            f"llmgw_placement_step_failures_total {self.service.step_failures}",
            "# HELP llmgw_nodes Nodes known.",
            "# TYPE llmgw_nodes gauge",
            f"llmgw_nodes {len(self.service.state.nodes)}",
            "# HELP llmgw_bus_decode_errors_total Messages that did not decode.",
            "# TYPE llmgw_bus_decode_errors_total counter",
            f"llmgw_bus_decode_errors_total {sum(self.service.bus.decode_errors.values())}",
            "# HELP llmgw_bus_permission_denied_total Publishes and subscriptions nats-server refused.",
            "# TYPE llmgw_bus_permission_denied_total counter",
            f"llmgw_bus_permission_denied_total {getattr(self.service.bus.nc, 'denied_total', 0)}",
            "# HELP llmgw_api_unauthorized_total API requests refused for their token (401 and 403).",
            "# TYPE llmgw_api_unauthorized_total counter",
            f"llmgw_api_unauthorized_total {self.refused}",
        ]
        return "\n".join(lines) + "\n"
