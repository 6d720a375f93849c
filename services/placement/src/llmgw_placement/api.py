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
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
from opentelemetry import trace
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw_core import failures
from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.errors import BusError, ConfigError, StoreFull
from llmgw_core.events import (
    Autoscale,
    Deployment,
    EngineState,
    NodeStatus,
    ReplicaRecord,
    ShardStatus,
    decoder,
)
from llmgw_core.limits import profile_problem, shown
from llmgw_core.metrics import exposition
from llmgw_core.telemetry import context_from, current_traceparent
from llmgw_core.validate import check_deployment, check_profile, names_problem
from llmgw_core.web import MAX_BODY, json_response

from .decide import Refusal, decide
from .nodes_api import node_routes
from .service import PlacementService
from .usage import UsageWindow

tracer = trace.get_tracer("llmgw.placement.api")
log = logging.getLogger("llmgw.placement.api")

UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="llmgw"'}
# The cluster page's cookie: the token a browser opened `/?token=…` with.
COOKIE = "llmgw_token"


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


class NodeRow(msgspec.Struct, frozen=True, kw_only=True):
    """One node in `/api/nodes`: as its agents reported it, and whether placement hears it."""

    node: str
    alive: bool
    # Seconds since its launcher was last heard; -1 if never since this placement started.
    seen_s_ago: float
    # `n1 is claimed by two machines: …` while two machines send its heartbeats, else "".
    claimed: str = ""
    gpus: tuple[GPUInfo, ...]
    engines: tuple[EngineState, ...]
    install: str
    warnings: tuple[str, ...]
    probed_at: float
    # `cordoned by ops at …: why`, `draining (1 replica left) by …`, `drained by …`, else "".
    intent: str = ""
    # The model files its launcher reports missing (profiles reading them go elsewhere).
    missing_models: tuple[str, ...] = ()
    # What placement says is wrong with the node, each in one line (`installer on node-b silent
    # for 53 s: install progress stale`, `clock 600 s ahead of placement's`); `install` is then
    # marked stale too (`…, stale: no word for 53 s`).
    problems: tuple[str, ...] = ()


class ShardRow(msgspec.Struct, frozen=True, kw_only=True):
    """One shard in `/api/shards`: how it reads now, and its status as its node last stored it."""

    shard: str
    node: str
    # The stored state, or `unknown (node lost 13 s ago)` while its node is lost.
    state: str
    replica: str
    status: ShardStatus


class _Reported(msgspec.Struct, frozen=True, kw_only=True):
    """A `NodeRow` after `seen_s_ago`: what changes only when the node reports anew."""

    gpus: tuple[GPUInfo, ...]
    engines: tuple[EngineState, ...]
    install: str
    warnings: tuple[str, ...]
    probed_at: float


_encode = msgspec.json.Encoder().encode


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
        # Per node: the status its `/api/nodes` row was last encoded from, and the encoded
        # rest of the row (see `nodes_json`).
        self._reported: dict[str, tuple[NodeStatus, bytes, bytes]] = {}
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
            exception_handlers={404: _no_route, 405: _no_route},
            max_body_size=MAX_BODY,
        )
        app.add_middleware(_TokenGuard, api=self)
        return app

    # --- routes ---------------------------------------------------------------------

    async def whoami(self, _: Request) -> Response:
        body: dict[str, Any] = {"leader": self.service.is_leader, "identity": self.service.identity}
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
        held = self.service.view.mine()
        if held is None:
            return self.standby()
        return json_response({k: _builtins(v) for k, v in sorted(held.replicas.items())})

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
        at = time.monotonic()
        return [self.node_row(name, at) for name in sorted(self.service.state.nodes)]

    def node_row(self, name: str, at: float) -> NodeRow:
        view = self.service.view
        status = self.service.state.nodes[name]
        alive, since = view.alive(status.node, at)
        judged = view.judged(status.node, at)
        return NodeRow(
            node=status.node,
            alive=alive,
            seen_s_ago=round(since, 1) if since != float("inf") else -1.0,
            claimed=self.service.state.claims.claimed(status.node, at) or "",
            gpus=status.facts.gpus,
            engines=status.engines,
            install=judged.install_shown(status.install),
            warnings=status.warnings,
            probed_at=status.probed_at,
            intent=view.intent(status.node),
            missing_models=tuple(sorted(self.service.state.missing_models.get(status.node, ()))),
            problems=judged.problems(),
        )

    def nodes_json(self) -> bytes:
        """`nodes()` as JSON, newline-ended: the text encoding it writes, made from each node's
        row encoded once and kept until the node reports anew (its GPUs and engines are nine
        tenths of the bytes); per request only `alive`, `seen_s_ago` and `claimed` are written into it.
        Building and encoding every row afresh took a tenth of a second a request at 10,000
        nodes, on the loop that also hears their heartbeats."""
        heard = self.service.view.alive
        claims = self.service.state.claims
        contested = set(claims.contested(time.monotonic()))
        nodes = self.service.state.nodes
        at = time.monotonic()
        cached = self._reported
        kept: dict[str, tuple[NodeStatus, bytes, bytes]] = {}
        ages: dict[float, bytes] = {}
        parts: list[bytes] = [b"["]
        liveness = self.service.view.liveness
        clock_off = self.service.state.clock_off
        for name in sorted(nodes):
            status = nodes[name]
            if name in clock_off or liveness.installer_stale(name, at):
                # A node placement says something is wrong with: its whole row, made afresh.
                parts += (_encode(self.node_row(name, at)), b",")
                continue
            row = cached.get(name)
            if row is None or row[0] is not status:
                rest = _Reported(
                    gpus=status.facts.gpus,
                    engines=status.engines,
                    install=status.install,
                    warnings=status.warnings,
                    probed_at=status.probed_at,
                )
                # `{"node":…,"alive":` and `,"gpus":…}`: NodeRow's fields in its order.
                row = (
                    status,
                    b'{"node":' + _encode(status.node) + b',"alive":',
                    b"," + _encode(rest)[1:-1],
                )
            claimed = (claims.claimed(name, at) or "") if name in contested else ""
            kept[name] = row
            alive, since = heard(status.node, at)
            seen = round(since, 1) if since != float("inf") else -1.0
            age = ages.get(seen)
            if age is None:
                age = ages[seen] = _encode(seen)
            parts += (
                row[1],
                b'true,"seen_s_ago":' if alive else b'false,"seen_s_ago":',
                age,
                b',"claimed":' + _encode(claimed) if claimed else b',"claimed":""',
                row[2],
                b',"intent":' + _encode(self.service.view.intent(name)),
                b',"missing_models":'
                + _encode(sorted(self.service.state.missing_models.get(name, ())))
                + b',"problems":[]}',
                b",",
            )
        self._reported = kept  # a node that left is dropped here
        if len(parts) > 1:
            parts.pop()  # the last row's comma
        parts.append(b"]\n")
        return b"".join(parts)

    def explain(self, name: str) -> Response:
        """The deployment as it stands (its published status and replicas), the last decision,
        and where one more replica would go now (`next_replica`: a what-if, not the current
        replicas' places)."""
        dep = self.service.state.deployments.get(name)
        if dep is None:
            return json_response({"error": f"no deployment {name!r}"}, 404)
        profile = self.service.state.catalog.get(dep.profile)
        view = self.service.view
        last = view.decision(name)
        status = view.statuses().get(name)
        replicas = sorted(
            (r for r in view.replicas().values() if r.deployment == name), key=lambda r: r.replica
        )
        body: dict[str, Any] = {
            "deployment": name,
            "status": _builtins(status) if status else None,
            "replicas": [_replica_entry(r) for r in replicas],
            "last_decision": _builtins(last) if last else None,
        }
        if dep.autoscale is not None:
            summed = self.service.demand.summed.get(name)
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
                port_range=self.service.config.dist_port_range,
            )
            if isinstance(decision, Refusal):
                body["next_replica"] = {
                    "outcome": "refused",
                    "reasons": [{"node": n, "reason": r} for n, r in decision.reasons],
                }
            else:
                body["next_replica"] = {
                    "outcome": "placed",
                    "members": _builtins(decision.members),
                    "fabric": decision.fabric,
                }
        return json_response(body)

    async def put_deployment(self, req: Request) -> Response:
        """Store a deployment that every reader decodes and placement acts on; anything else is
        refused here (400), before it is stored, with the rule it breaks."""
        body = await req.body()
        max_replicas = self.service.config.max_replicas
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
            problem = await self.profile_problem(dep)
        except BusError as exc:
            return json_response({"error": str(exc)}, 503)
        if problem is not None:
            return json_response({"error": f"invalid deployment: {problem}"}, 400)
        based_on = _if_match(req.headers.get("if-match"))
        if isinstance(based_on, str):
            return json_response({"error": based_on}, 400)
        bus = self.service.bus
        bucket = bus.names.deployments_bucket
        try:
            history = await bus.revisions(bucket, dep.name)
            others = await bus.entries(bucket, Deployment)
        except BusError as exc:
            return json_response({"error": str(exc)}, 503)
        # A model name routes to one deployment: names that meet another's are refused, naming both.
        problem = names_problem(dep, (c.value for c in others.values() if c.value is not None))
        if problem is not None:
            return json_response({"error": f"invalid deployment: {problem}"}, 409)
        last = history[0][0] if history and history[0][1] is not None else 0
        if based_on is not None and based_on != last:
            return _conflict(dep.name, f"the request was based on revision {based_on}", history, based_on)
        if self.before_write is not None:
            await self.before_write(dep.name)
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
        blocked = self.service.cannot_write()
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

    async def profile_problem(self, dep: Deployment) -> str | None:
        """Why `dep` names a profile that is not in the catalog; None when it is. The catalog
        placement holds first; a name it lacks is read from the bucket before it is refused,
        so a profile written a moment ago (not yet mirrored here) is not refused."""
        catalog = self.service.state.catalog
        if dep.profile in catalog:
            return None
        bus = self.service.bus
        try:
            stored = await bus.get(bus.names.catalog_bucket, dep.profile, Profile)
        except (msgspec.DecodeError, msgspec.ValidationError):
            stored = None
        if stored is not None and check_profile(dep.profile, stored[0]) is None:
            return None
        return profile_problem(dep.name, dep.profile, catalog)


def _if_match(header: str | None) -> int | str | None:
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

    def value_at(revision: int) -> Deployment | None:
        data = next((d for rev, d in history if rev <= revision), None)
        try:
            return decoder(Deployment).decode(data) if data is not None else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    if since and not any(rev <= since for rev, _ in history):
        changed = [f"revision {since} is older than the history the bucket keeps"]
    else:
        changed = _changed(value_at(since), value_at(now))
    return json_response(
        {
            "error": f"deployment {name} is at revision {now}, not {since}: {why}; nothing was written; "
            "read it again and send the change again",
            "revision": now,
            "changed": changed,
        },
        409,
    )


async def _no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    return json_response({"error": f"no route {request.method} {request.url.path}"}, status)


class _TokenGuard:
    """Every request but those to `Api.public` paths shows a token; only the API token writes.

    A path's trailing slash is dropped before anything else (`/api/nodes/` is
    `/api/nodes`), as the API always did.
    """

    def __init__(self, app: ASGIApp, api: Api) -> None:
        self.app = app
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"].rstrip("/") or "/"
        scope = {**scope, "path": path}
        if path not in self.api.public:
            request = Request(scope)
            access = self.api.access(request.headers.get("authorization", ""))
            if access == "none" and scope["method"] in ("GET", "HEAD"):
                # A browser on the cluster page: the token it was given as `?token=` is kept in
                # a cookie, which reads and never writes (a page cannot be made to change things).
                given = request.query_params.get("token") if path == "/" else None
                if given and self.api.access(f"Bearer {given}") != "none":
                    response = RedirectResponse("/", 303)
                    response.set_cookie(COOKIE, given, httponly=True, samesite="strict")
                    await response(scope, receive, send)
                    return
                cookie = request.cookies.get(COOKIE, "")
                if cookie and self.api.access(f"Bearer {cookie}") != "none":
                    access = "read"
            refusal: Response | None = None
            if access == "none":
                refusal = json_response(
                    {"error": "this API wants Authorization: Bearer <token>"}, 401, UNAUTHORIZED
                )
            elif scope["method"] not in ("GET", "HEAD") and access != "write":
                refusal = json_response(
                    {"error": "the read token cannot change anything; use the API token"}, 403
                )
            if refusal is not None:
                self.api.service.metrics.api_unauthorized.inc()
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)
