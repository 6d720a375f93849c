"""The API's node lifecycle: `POST /api/nodes/{name}/cordon|drain|uncordon` and
`DELETE /api/nodes/{name}` (a lost node forgotten), token-checked like every write.

The same rules as `llmgw ctl cordon|drain|uncordon|delete node`: the intent is stored in the
node-intent bucket (placement acts on it from there, leader or not, after any restart); only
a node this placement judges lost is deleted (409 for one it hears)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from llmgw_core.errors import BusError, StoreFull
from llmgw_core.events import NodeIntent
from llmgw_core.web import json_response

if TYPE_CHECKING:
    from .service import PlacementService


class _Asked(msgspec.Struct, frozen=True, kw_only=True):
    """A cordon's or drain's body, all optional: why, and who asks."""

    reason: str = ""
    by: str = ""


def node_routes(service: PlacementService) -> list[BaseRoute]:
    async def act(request: Request) -> Response:
        node = request.path_params["name"]
        verb = request.path_params["verb"]
        if verb not in ("cordon", "drain", "uncordon"):
            return json_response({"error": f"no action {verb!r}: cordon, drain or uncordon"}, 404)
        if node not in service.state.nodes:
            return json_response({"error": f"no node {node!r} (GET /api/nodes lists them)"}, 404)
        names = service.bus.names
        try:
            if verb == "uncordon":
                await service.bus.delete(names.node_intent_bucket, node)
                return json_response({"node": node, "intent": ""})
            body = await request.body()
            try:
                asked = msgspec.json.decode(body, type=_Asked) if body.strip() else _Asked()
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return json_response({"error": f"invalid {verb} request: {exc}"}, 400)
            intent = NodeIntent(
                node=node,
                drain=verb == "drain",
                by=asked.by or "the API",
                at=time.time(),
                reason=asked.reason,
            )
            await service.bus.put(names.node_intent_bucket, node, intent)
        except StoreFull as exc:
            return json_response({"error": str(exc)}, 507)
        except BusError as exc:
            return json_response({"error": str(exc)}, 503)
        return json_response({"node": node, "intent": intent.words()})

    async def forget(request: Request) -> Response:
        node = request.path_params["name"]
        if node not in service.state.nodes:
            return json_response({"error": f"no node {node!r} (GET /api/nodes lists them)"}, 404)
        alive, _ = service.view.alive(node, time.monotonic())
        if alive:
            return json_response(
                {"error": f"node {node} is alive: only a lost node is deleted; drain it first"},
                409,
            )
        held = [k for k, r in service.view.replicas().items() if any(m.node == node for m in r.members)]
        if held:
            return json_response(
                {
                    "error": f"node {node} is lost but {len(held)} replica(s) are still on it: failed over "
                    "within a step; ask again then"
                },
                409,
            )
        names = service.bus.names
        try:
            statuses = sorted(
                k for k in await service.bus.keys(names.shard_status_bucket) if k.startswith(f"{node}.")
            )
            for key in statuses:
                await service.bus.delete(names.shard_status_bucket, key)
            await service.bus.delete(names.node_intent_bucket, node)
            await service.bus.delete(names.nodes_bucket, node)
        except BusError as exc:
            return json_response({"error": str(exc)}, 503)
        return json_response({"node": node, "deleted": True, "shard_statuses": len(statuses)})

    return [
        Route("/api/nodes/{name}/{verb}", act, methods=["POST"]),
        Route("/api/nodes/{name}", forget, methods=["DELETE"]),
    ]
