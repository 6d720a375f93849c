"""The API's deployments: `POST /api/deployments` (a deployment judged, then written by
compare-and-set) and `GET /api/explain/<d>` (a deployment as it stands, and where one more
replica would go now).

A posted deployment that any reader would refuse is refused here (400), before it is
stored, with the rule it breaks; one based on a revision another writer moved past is
refused (409) with what changed since.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from llmgw_core import failures
from llmgw_core.adapter_rules import all_adapters, deployment_meets_adapters
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError, StoreFull
from llmgw_core.events import Autoscale, Deployment, ReplicaRecord, decoder
from llmgw_core.limits import profile_problem, shown
from llmgw_core.telemetry import context_from, current_traceparent
from llmgw_core.validate import check_deployment, check_profile, names_problem
from llmgw_core.web import json_response

from .decide import Refusal, decide

if TYPE_CHECKING:
    from .service import PlacementService

tracer = trace.get_tracer("llmgw.placement.api")

_encode = msgspec.json.Encoder().encode

log = logging.getLogger("llmgw.placement")


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


class _EnteredAutoscale(msgspec.Struct, frozen=True, kw_only=True):
    min_replicas: int = 1
    max_replicas: int = 1
    target_in_flight: float = 4.0
    scale_down_after_s: float = 300.0


class _Entered(msgspec.Struct, frozen=True, kw_only=True):
    """The named and counted fields of a posted deployment, without the wire type's constraints."""

    name: str
    profile: str
    replicas: int = 1
    aliases: tuple[str, ...] = ()
    autoscale: _EnteredAutoscale | None = None

    def deployment(self) -> Deployment:
        # Not decoded, so not validated: `check_deployment` judges these fields as they came.
        a = self.autoscale
        return Deployment(
            name=self.name,
            profile=self.profile,
            replicas=self.replicas,
            aliases=self.aliases,
            autoscale=Autoscale(**msgspec.structs.asdict(a)) if a is not None else None,
        )


_entered = msgspec.json.Decoder(_Entered)


def _replica_entry(r: ReplicaRecord) -> dict[str, Any]:
    """A replica as `explain` shows it: its state, nodes and reason, and its last failure in
    one line and as fields."""
    failure = failures.failure_of(r)
    return {
        "replica": r.replica,
        "state": r.state,
        "nodes": [k.split(".", 1)[0] for k in r.shards],
        "reason": failures.one_line(r.reason),
        "last_failure": failures.summary(failure),
        "failure": _builtins(failure) if failure is not None else None,
    }


def explain(service: PlacementService, name: str) -> Response:
    """The deployment as it stands (its published status and replicas), the last decision,
    and where one more replica would go now (`next_replica`: a what-if, not the current
    replicas' places)."""
    dep = service.state.deployments.get(name)
    if dep is None:
        return json_response({"error": f"no deployment {name!r}"}, 404)
    profile = service.state.catalog.get(dep.profile)
    view = service.view
    last = view.decision(name)
    status = view.statuses().get(name)
    replicas = sorted((r for r in view.replicas().values() if r.deployment == name), key=lambda r: r.replica)
    body: dict[str, Any] = {
        "deployment": name,
        "status": _builtins(status) if status else None,
        "replicas": [_replica_entry(r) for r in replicas],
        "last_decision": _builtins(last) if last else None,
    }
    if dep.autoscale is not None:
        summed = service.demand.summed.get(name)
        body["autoscale"] = {
            "bounds": _builtins(dep.autoscale),
            **(view.scaling(name) or {"count": None, "last_decision": None}),
            "demand": summed.demand if summed is not None else 0.0,
        }
    if profile is None:
        body["next_replica"] = {
            "outcome": "refused",
            "reason": f"profile {dep.profile} is not in the catalog",
        }
    elif (views := view.views()) is not None:
        decision = decide(
            dep,
            profile,
            views,
            port_range=service.config.dist_port_range,
        )
        if isinstance(decision, Refusal):
            body["next_replica"] = {
                "outcome": "refused",
                "reasons": [{"node": r.node, "reason": r.reason} for r in decision.node_reasons()],
            }
        else:
            body["next_replica"] = {
                "outcome": "placed",
                "members": _builtins(decision.members),
                "fabric": decision.fabric,
            }
    return json_response(body)


async def put_deployment(
    service: PlacementService, req: Request, before_write: Callable[[str], Awaitable[None]] | None
) -> Response:
    """Store a deployment that every reader decodes and placement acts on; anything else is
    refused here (400), before it is stored, with the rule it breaks."""
    body = await req.body()
    max_replicas = service.config.max_replicas
    # The names and sizes first, read without the wire type's constraints, so a refusal says
    # the rule in its words (the limit, what to do) rather than msgspec's.
    try:
        entered = _entered.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    else:
        problem = check_deployment(entered.name, entered.deployment(), max_replicas=max_replicas)
        if problem is not None:
            return json_response({"error": f"invalid deployment: {problem}"}, 400)
    try:
        dep = decoder(Deployment).decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return json_response({"error": f"invalid deployment: {exc}"}, 400)
    try:
        problem = await catalog_problem(service, dep)
    except BusError as exc:
        return json_response({"error": str(exc)}, 503)
    if problem is not None:
        return json_response({"error": f"invalid deployment: {problem}"}, 400)
    based_on = if_match(req.headers.get("if-match"))
    if isinstance(based_on, str):
        return json_response({"error": based_on}, 400)
    bus = service.bus
    bucket = bus.names.deployments_bucket
    try:
        history = await bus.revisions(bucket, dep.name)
        others = await bus.entries(bucket, Deployment)
    except BusError as exc:
        return json_response({"error": str(exc)}, 503)
    # A model name routes to one deployment: names that meet another's are refused, naming both.
    problem = names_problem(dep, (c.value for c in others.values() if c.value is not None))
    # Nor one an adapter holds (its base's deployments serve it under that name).
    problem = problem or deployment_meets_adapters(dep, all_adapters(service.state.catalog))
    if problem is not None:
        return json_response({"error": f"invalid deployment: {problem}"}, 409)
    last = history[0][0] if history and history[0][1] is not None else 0
    if based_on is not None and based_on != last:
        return _conflict(dep.name, f"the request was based on revision {based_on}", history, based_on)
    if before_write is not None:
        await before_write(dep.name)
    with tracer.start_as_current_span(
        f"api deploy {dep.name}", context=context_from(req.headers.get("traceparent", ""))
    ):
        dep = msgspec.structs.replace(dep, traceparent=current_traceparent())
        try:
            # Compare-and-set at the revision read above: two writers of one deployment at
            # once each got 200, and the last write won without a word.
            if last:
                written = await bus.update(bucket, dep.name, dep, last=last)
            else:
                written = await bus.create(bucket, dep.name, dep)
            if written is None:
                history = await bus.revisions(bucket, dep.name)
                return _conflict(dep.name, "another writer wrote it meanwhile", history, last)
        except StoreFull as exc:
            # Not stored: 507 Insufficient Storage, in NATS's words.
            return json_response({"error": str(exc)}, 507)
        except BusError as exc:
            return json_response({"error": str(exc)}, 503)
    blocked = service.cannot_write()
    if blocked:
        # Stored, but nothing acts on it until placement can write again: not done.
        return json_response(
            {
                "error": f"deployment {dep.name} written, but placement cannot act on it: {blocked}",
                "stored": True,
            },
            503,
        )
    return json_response(_builtins(dep), headers={"ETag": f'"{written}"'})


async def catalog_problem(service: PlacementService, dep: Deployment) -> str | None:
    """Why `dep` names a profile that is not in the catalog; None when it is. The catalog
    placement holds first; a name it lacks is read from the bucket before it is refused,
    so a profile written a moment ago (not yet mirrored here) is not refused."""
    catalog = service.state.catalog
    if dep.profile in catalog:
        return None
    bus = service.bus
    try:
        stored = await bus.get(bus.names.catalog_bucket, dep.profile, Profile)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # Said, then refused as a profile the catalog lacks: mirrored, it went to the DLQ.
        log.warning("%s: catalog profile %s does not decode: %s", service.identity, shown(dep.profile), exc)
        stored = None
    if stored is not None and check_profile(dep.profile, stored[0]) is None:
        return None
    return profile_problem(dep.name, dep.profile, catalog)


def if_match(header: str | None) -> int | str | None:
    """The revision an `If-Match` header bases a write on (0: the deployment must not exist
    yet); None without one; the refusal's words for one that is no revision."""
    if header is None:
        return None
    given = header.strip().removeprefix("W/").strip('"')
    if not given.isascii() or not given.isdigit() or len(given) > 19:
        return (
            f"If-Match {shown(header)}: give the revision the write is based on, as the ETag of the "
            'answer that wrote it ("12"), or "0" for a deployment that must not exist yet'
        )
    return int(given)


def _changed(old: Deployment | None, new: Deployment | None) -> list[str]:
    """`field: old -> new` for each field that differs (the writer's traceparent left out)."""
    if old is None or new is None:
        return [] if old is new else ["added"] if old is None else ["deleted"]
    a, b = msgspec.to_builtins(old), msgspec.to_builtins(new)
    return [
        f"{k}: {_encode(a.get(k)).decode()} -> {_encode(b.get(k)).decode()}"
        for k in sorted(a.keys() | b.keys())
        if k != "traceparent" and a.get(k) != b.get(k)
    ]


def _conflict(name: str, why: str, history: list[tuple[int, bytes | None]], since: int) -> Response:
    """409 for a write that lost to another writer: the revision now, and what changed since the
    revision the write was based on, from the key's history (newest first, None: deleted)."""
    now = history[0][0] if history and history[0][1] is not None else 0

    def value_at(revision: int) -> Deployment | str | None:
        data = next((d for rev, d in history if rev <= revision), None)
        try:
            return decoder(Deployment).decode(data) if data is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return f"revision {revision} does not decode ({exc})"

    if since and not any(rev <= since for rev, _ in history):
        changed = [f"revision {since} is older than the history the bucket keeps"]
    else:
        old, new = value_at(since), value_at(now)
        if isinstance(old, str) or isinstance(new, str):
            changed = [v for v in (old, new) if isinstance(v, str)]
        else:
            changed = _changed(old, new)
    return json_response(
        {
            "error": f"deployment {name} is at revision {now}, not {since}: {why}; nothing was written; "
            "read it again and send the change again",
            "revision": now,
            "changed": changed,
        },
        409,
    )
