"""The OpenAI-compatible HTTP surface: `/v1/models` and `/v1/models/{id}`,
`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`
and Anthropic's `/v1/messages` (streamed or not), `/healthz` and `/metrics`.
Every error the gateway answers itself, unknown paths included, is OpenAI's
error object.

A request is routed by its `model` (a deployment's name or alias) to a
ready replica (the one its prompt's prefix was sent to, else the one with the
fewest requests in flight: `routing.py`), among those whose engine serves the
path (each engine adapter's `api_paths`); where none does, a 400
names the engine. When a replica fails before any byte of answer (it refused
the connection, or closed or reset it before answering: it died, and
placement has not said so yet) the request goes to another. Once a replica's
answer has begun, it is passed through (status, headers less the hop-by-hop
ones and its `Date`, body byte for byte, server-sent events included) and
never retried: a stream broken off after that ends with an SSE error event
and `data: [DONE]`, never silently truncated.

A routed request takes one of two paths with the same outcome: the express lane
(`express`, from the HTTP protocol's callbacks: no task, no ASGI messages) where
nothing needs a wait but the replica's and its answer gives its length, else the ASGI
app (`app`, `complete`, `_forward`), which also takes over what the lane began
(`Routed`, in the scope under `RESUMED`) wherever another wait or a stream turns up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

import anyio
import httpx
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, TextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmgw_core.engines import BASE_API_PATHS, default_registry
from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import ApiKey, allows
from llmgw_core.metrics import Collect, exposition, new_registry

from . import worker_metrics
from .budgets import Budgets, Limited, Reservation, estimate
from .demand import DemandCounts
from .holds import FULL_RETRY_AFTER_S, RESTART_RETRY_AFTER_S, TIMEOUT_RETRY_AFTER_S, Holds
from .keyring import Keyring, Refused, file_keys
from .limits import body_problem, json_nests_deeper, shown
from .routing import Table, prompt_blocks
from .upstream import FAILED, HIGH_WATER, REFUSED, Answer, Upstream, UpstreamError, before_answer
from .usage import Events, JsonTail, Meter, Usage

if TYPE_CHECKING:
    from .connections import Lane

log = logging.getLogger("llmgw.gateway")

# Hop-by-hop headers (RFC 9110 7.6.1) and those the proxy sets itself.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "authorization",
        # Anthropic's clients send the key here: the gateway's secret, never the replica's.
        "x-api-key",
    }
)
# Also dropped from a replica's answer: the gateway's HTTP server sets its own `Date`.
_HOP_OUT = _HOP | {"date"}
# As the ASGI server and the replica connections carry them.
_HOP_BYTES = frozenset(h.encode() for h in _HOP)
_HOP_OUT_BYTES = frozenset(h.encode() for h in _HOP_OUT)
# The proxied paths (POST, routed by the body's `model`).
ROUTED = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
)
_ROUTED_PATHS = frozenset(ROUTED)
_NONE: frozenset[str] = frozenset()
UNKNOWN = "(unknown)"
# Each routed path's `gen_ai.operation.name` (OpenTelemetry's GenAI semantic conventions).
_OPERATION = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
# How long a request waits for a starting gateway's first snapshot of the buckets.
LOAD_WAIT_S = 10.0
# The paths whose streamed answers end with a usage chunk when asked (`stream_options`).
_USAGE_OPTION = frozenset({"/v1/chat/completions", "/v1/completions"})
# Where a request the express lane handed over carries its `Routed` (an ASGI scope key).
RESUMED = "llmgw.resumed"
# Statuses whose answers carry no body: given no length, and left to the ASGI path.
_NO_BODY = frozenset({204, 304})


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error, as the official clients parse it; `param`: the body's field at fault."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(
    status: int,
    message: str,
    kind: str,
    code: str,
    *,
    retry_after: int | None = None,
    param: str | None = None,
) -> JSONResponse:
    response = JSONResponse(error_body(message, kind, code, param), status_code=status)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


class PassedResponse(StreamingResponse):
    """A replica's answer not streamed as events, passed on chunk by chunk in the request's own
    task. Starlette's `StreamingResponse` also watches for the client leaving, in a task group of
    two tasks per answer; such an answer's body follows its headers at once (the engine sends
    them when it is done), so nothing is left to stop by then, and the watch cost more than the
    rest of the response. Streamed answers (SSE) keep it: they run as long as the generation."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
        except OSError as exc:
            raise ClientDisconnect() from exc


class BadBody(NamedTuple):
    """Why a routed request's body is refused: its status, message and error code, and the
    body's field at fault where one is."""

    status: int
    message: str
    code: str
    param: str | None = None


@dataclass(slots=True)
class _Lookup:
    """A read of a replica's served model name under way (`Proxy._served_name`)."""

    done: anyio.Event = field(default_factory=anyio.Event)
    # Whether it ended with an answer (`name`; None: it could not be read), not cancelled.
    read: bool = False
    name: str | None = None


class Relay:
    """A replica's answer as the server passes it on (`Proxy._relay`'s chunks), ended once
    however the response goes: where the server never asked for a chunk (its client had left),
    `aclose` ends it with `unstarted` (the replica's count released, the reservation settled,
    the span ended), which the relay's own end would have done."""

    __slots__ = ("_chunks", "_unstarted", "started")

    def __init__(self, chunks: AsyncGenerator[bytes, None], unstarted: Callable[[], None]) -> None:
        self._chunks = chunks
        self._unstarted = unstarted
        self.started = False

    def __aiter__(self) -> Relay:
        return self

    async def __anext__(self) -> bytes:
        # `_relay` enters its `try` before its first await: once asked, its end is its own.
        self.started = True
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        if not self.started:
            self.started = True
            self._unstarted()
        await self._chunks.aclose()


class BrokenAnswer(Exception):
    """A replica's answer broke off after the gateway had begun passing it on."""


@dataclass(slots=True)
class Routed:
    """A routed request admitted (its key, body and deployment known, counted, its span begun),
    and what became of it on the express lane before it was handed to the ASGI path."""

    payload: dict[str, Any]
    body: bytes
    model: str
    deployment: str
    key: ApiKey
    span: trace.Span
    arrived: float
    # Its headers as replicas get them (the hop-by-hop ones out, the trace's in).
    headers: list[tuple[bytes, bytes]]
    # The prompt's leading blocks, hashed once for every attempt.
    blocks: Sequence[int]
    # Its tokens held against the key's tpm until its answer ends, and what it was judged to
    # spend: settled with what the answer spent, once (given back where none came).
    reservation: Reservation
    # A streamed answer's usage chunk is taken out: the client did not ask for it.
    strip: bool = False
    # The replica the lane chose (counted as chosen), or None: none could take the request.
    chosen: tuple[str, ReplicaRecord] | None = None
    # What came of sending it there: the answer (its status line in) or the failure before
    # it; None where the lane did not send it (the replica's model name or an idle
    # connection to it was wanting).
    sent: Answer | UpstreamError | None = None
    # The lane decided what comes of the answer (it is past the lane's watch).
    decided: bool = False
    # The deadline of the next read of an answer the lane waits for whole (`_waits_whole`).
    wait: asyncio.TimerHandle | None = None


def parsed_body(body: bytes, max_json_depth: int) -> tuple[dict[str, Any], str] | BadBody:
    """A routed request's body: its JSON object and its `model`, or why it is refused (400).
    Pure."""
    if json_nests_deeper(body, max_json_depth):
        return BadBody(
            400,
            f"the body's JSON nests arrays and objects more than {max_json_depth} deep "
            "(the gateway's max_json_depth)",
            "json_too_deep",
        )
    try:
        payload = json.loads(body)
    except ValueError as exc:
        return BadBody(400, f"the body is not JSON: {exc}", "invalid_json")
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, str) or not model:
        return BadBody(
            400,
            "the body must be a JSON object with a `model` (a deployment's name or alias)",
            "missing_model",
        )
    # The fields the gateway reads to stream, count and reserve, read as the engine reads them.
    problem = body_problem(payload)
    if problem is not None:
        return BadBody(400, problem.message, problem.code, problem.param)
    return payload, model


def _unplaceable(message: str) -> JSONResponse:
    """The answer for a deployment placement cannot place on any node: at once, and with a
    status the OpenAI and Anthropic SDKs do not retry (they retry 408, 409, 429 and 5xx,
    three tries by default: a 503 held 120 s took 381 s to reach the user). 422: the request
    is well formed, and the model it names cannot be served as the cluster stands; sent again
    unchanged it fails the same way until an operator acts. No `Retry-After`, and
    `x-should-retry: false`, which both SDKs obey."""
    response = _error(422, message, "invalid_request_error", "deployment_unplaceable", param="model")
    response.headers["x-should-retry"] = "false"
    return response


def _sse_error(message: str, path: str) -> bytes:
    """The end of a stream broken off: an error event, as OpenAI sends one, and `[DONE]`; on
    Anthropic's `/v1/messages`, its `error` event (its clients read no other)."""
    if path == "/v1/messages":
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    body = error_body(message, "upstream_error", "replica_failed")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def _not_found(request: Request, exc: Exception) -> Response:
    paths = ", ".join(["/v1/models", "/v1/models/{model}", *ROUTED])
    return _error(
        404,
        f"unknown path {shown(request.url.path)}: the gateway serves {paths}",
        "invalid_request_error",
        "unknown_path",
    )


async def _not_allowed(request: Request, exc: Exception) -> Response:
    allow = (getattr(exc, "headers", None) or {}).get("Allow", "")
    response = _error(
        405,
        f"method {request.method} is not allowed on {shown(request.url.path)}: use {allow or 'another'}",
        "invalid_request_error",
        "method_not_allowed",
    )
    if allow:
        response.headers["Allow"] = allow
    return response


async def _internal(request: Request, exc: Exception) -> Response:
    return _error(
        500,
        f"the gateway failed on {shown(request.url.path)}: {type(exc).__name__}; its log says more",
        "server_error",
        "internal_error",
    )


class DeploymentMetrics(NamedTuple):
    """One deployment's series that every request touches, looked up once: `labels()` takes a
    lock and checks its arguments at each call, four times per request."""

    requests: Counter
    outstanding: Gauge
    ttfb: Histogram


class Metrics:
    def __init__(self) -> None:
        self._of: dict[str, DeploymentMetrics] = {}
        self.registry = new_registry("gateway")
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Completion requests per deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.errors = Counter(
            "llmgw_gateway_errors",
            "Requests the gateway answered with an error, or whose replica failed, by reason class: "
            "bad_request, unauthorized, rate_limited, gateway_starting, unknown_model, no_ready_replica, "
            "unplaceable (placement can place the deployment on no node; answered 422 at once), "
            "unsupported_path (the deployment's engine does not serve the path), "
            "connect (a replica refused, retried elsewhere), "
            "reset (a replica closed the connection before answering, retried elsewhere), "
            "upstream (the replica failed after it had the request), "
            "upstream_stream (a streamed answer broke off; the client got an SSE error event), "
            "upstream_status (the replica answered 5xx), "
            "hold_queue_full (no ready replica, and the deployment's held requests at hold_queue), "
            "gateway_restarting (held when the gateway stopped), client_left (gone while held).",
            ["deployment", "reason"],
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "llmgw_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the replica's first byte of answer.",
            ["deployment"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.outstanding = Gauge(
            "llmgw_gateway_outstanding_requests",
            "Requests in flight per deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.held = Gauge(
            "llmgw_gateway_held_requests",
            "Requests held per deployment, waiting for a ready replica (hold_queue at most).",
            ["deployment"],
            registry=self.registry,
        )
        self.hold_wait = Histogram(
            "llmgw_gateway_hold_wait_seconds",
            "How long a request was held for a ready replica, by how the wait ended: sent (a replica "
            "became ready), timeout (hold_timeout_s), left (the client went), restarting (the gateway "
            "stopped).",
            ["deployment", "outcome"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )

    def of(self, deployment: str) -> DeploymentMetrics:
        found = self._of.get(deployment)
        if found is None:
            found = self._of[deployment] = DeploymentMetrics(
                self.requests.labels(deployment),
                self.outstanding.labels(deployment),
                self.ttfb.labels(deployment),
            )
        return found


class Proxy:
    def __init__(
        self,
        table: Table,
        client: httpx.AsyncClient,
        *,
        api_keys: frozenset[str] = frozenset(),
        keyring: Keyring | None = None,
        budgets: Budgets | None = None,
        usage: Usage | None = None,
        max_body_bytes: int = 8 << 20,
        max_json_depth: int = 128,
        tracer: trace.Tracer | None = None,
        upstream: Upstream | None = None,
        holds: Holds | None = None,
    ) -> None:
        self.table = table
        # `client` reads a replica's /v1/models once; `upstream` carries the requests.
        self.client = client
        self.upstream = upstream or Upstream()
        # Without a keyring: open, or the keys of `api_keys` only.
        self.keyring = keyring or Keyring(required=bool(api_keys), file=file_keys(api_keys))
        self.budgets = budgets or Budgets(None)
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.tracer = tracer or trace.get_tracer("llmgw.gateway")
        self.metrics = Metrics()
        self.metrics.registry.register(Collect(self._routed))
        # Requests waiting for a deployment's first ready replica, and what the demand reports say.
        self.holds = holds or Holds()
        self.demand = DemandCounts()
        self.usage = usage or Usage(None, self.metrics.registry)
        # A worker of several: its index, and the other workers' registry ports (read at each
        # scrape, a restarted worker's new one included); `/metrics` answers all of them.
        self.peers: tuple[str, Callable[[], dict[str, int]]] | None = None
        # Set once the first snapshot of the buckets is in: until then "unknown model"
        # would be a lie.
        self.loaded = anyio.Event()
        # (replica URL, profile fingerprint) -> the model name its engine serves (from its
        # /v1/models). The fingerprint: a changed profile restarted on the same port may serve
        # another name.
        self._served: dict[tuple[str, str], str] = {}
        # The reads of those names under way, which the other requests for the replica wait on.
        self._lookups: dict[tuple[str, str], _Lookup] = {}
        self._engines = default_registry()
        # Every path but the routed ones; those `app` takes itself.
        self._routes = Starlette(
            routes=[
                Route("/healthz", self.healthz, methods=["GET"]),
                # As llama-server, vLLM and SGLang answer it: load generators (guidellm) and
                # clients check `/health` before they start.
                Route("/health", self.healthz, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                *(Route(path, self.complete, methods=["POST"]) for path in ROUTED),
            ],
            exception_handlers={404: _not_found, 405: _not_allowed, Exception: _internal},
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The gateway's ASGI app. A routed POST goes straight to `complete`: through Starlette's
        middleware, router and endpoint wrappers it took seven layers of calls, a fifth of
        the request's Python work in front of the proxy's own. Every other request, and a
        routed path with another method (405), goes through the router."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _ROUTED_PATHS:
            await self._routes(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            resumed: Routed | None = scope.get(RESUMED)
            if resumed is None:
                response = await self.complete(request)
            else:
                response = await self._send(request, resumed)
        except Exception as exc:
            # As Starlette's outermost middleware does: the client gets the 500, the server
            # logs the exception.
            await (await _internal(request, exc))(scope, receive, send)
            raise
        try:
            await response(scope, receive, send)
        finally:
            relay = getattr(response, "body_iterator", None)
            if isinstance(relay, Relay):
                # A client gone before the server asked for the first chunk left the relay
                # never begun, and so never ended: its replica counted busy for good.
                with anyio.CancelScope(shield=True):
                    await relay.aclose()

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def __aenter__(self) -> Proxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    def _routed(self) -> Iterator[Metric]:
        # Read from the table's counts at scrape time: nothing added to a request's path.
        family = CounterMetricFamily(
            "llmgw_gateway_routed",
            "Replicas chosen per deployment, by what chose them: prefix (the replica the prompt's "
            "leading blocks were last sent to, within the load bound) or load (least outstanding "
            "requests: none within the bound, no lead, or one replica with room for a new one) or hash (a "
            "lead none holds, among the least busy with room). A retry counts again.",
            labels=["deployment", "how"],
        )
        for (deployment, how), n in sorted(self.table.routed.items()):
            family.add_metric([deployment, how], n)
        yield family

    # --- plain endpoints ------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        # Open to load balancers, which send no key; the deployments' names only to a client
        # with one, where keys are required.
        if not self.loaded.is_set():
            return JSONResponse({"status": "loading", "detail": "reading the replicas bucket"}, 503)
        if not self._key_ok(request):
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "deployments": self.table.known()})

    async def prometheus(self, request: Request) -> Response:
        # Behind the key where keys are required: the labels name every deployment.
        refused = await self._unauthorized(request)
        if refused is not None:
            return refused
        if self.peers is None:
            return exposition(self.metrics.registry, request)
        index, ports = self.peers
        own = generate_latest(self.metrics.registry).decode()
        merged = await worker_metrics.gather(self.client, (index, own), ports())
        return Response(merged, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _key_ok(self, request: Request) -> bool:
        """Whether keys are not required, or the request carries a valid one."""
        return isinstance(self._identify(request), ApiKey)

    def _identify(self, request: Request) -> ApiKey | Refused:
        """The key the request carries: `Authorization: Bearer`, or Anthropic's `x-api-key`."""
        headers = request.headers
        return self.keyring.identify(headers.get("authorization", ""), api_key=headers.get("x-api-key", ""))

    async def _authorize(self, request: Request) -> ApiKey | JSONResponse:
        """The request's key (open access where keys are not required), or its 401. A starting
        gateway has not read the keys bucket yet: it waits for it before refusing a key."""
        found = self._identify(request)
        if not isinstance(found, ApiKey) and not self.loaded.is_set():
            with anyio.move_on_after(LOAD_WAIT_S):
                await self.loaded.wait()
            found = self._identify(request)
        if isinstance(found, ApiKey):
            return found
        self.metrics.errors.labels(UNKNOWN, "unauthorized").inc()
        return _error(401, found.message, "authentication_error", found.code)

    async def _unauthorized(self, request: Request) -> JSONResponse | None:
        found = await self._authorize(request)
        return found if isinstance(found, JSONResponse) else None

    def _visible(self, key: ApiKey) -> list[str]:
        """The deployments `key` may call (and so sees), sorted."""
        return [name for name in self.table.known() if allows(key, name, self.table.resolve)]

    def _resolve(self, key: ApiKey, model: str) -> str | None:
        """The deployment `model` names, if `key` may call it: a model the key may not call is
        unknown to it, as one that does not exist (its name is not confirmed to the key)."""
        deployment = self.table.resolve(model)
        if deployment is None or not allows(key, deployment, self.table.resolve):
            return None
        return deployment

    async def _not_loaded(self) -> JSONResponse | None:
        """None once the buckets' first snapshot is in (waiting a little for it); else a 503."""
        if self.loaded.is_set():
            # No cancel scope per request once loaded: it cost about 3% of a request's CPU.
            return None
        with anyio.move_on_after(LOAD_WAIT_S):
            await self.loaded.wait()
            return None
        return _error(
            503,
            "the gateway has not read the cluster's replicas yet (is NATS reachable?); try again shortly",
            "service_unavailable",
            "gateway_starting",
        )

    async def models(self, request: Request) -> Response:
        key = await self._authorize(request)
        if isinstance(key, JSONResponse):
            return key
        refused = await self._not_loaded()
        if refused is not None:
            return refused
        data = [self._model_object(name) for name in self._visible(key)]
        return JSONResponse({"object": "list", "data": data})

    def _model_object(self, name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "llmgw",
            "aliases": list(self.table.aliases(name)),
            "ready_replicas": len(self.table.ready(name)),
        }

    async def model(self, request: Request) -> Response:
        """One model, by a deployment's name or alias, as OpenAI's `GET /v1/models/{model}`."""
        key = await self._authorize(request)
        if isinstance(key, JSONResponse):
            return key
        refused = await self._not_loaded()
        if refused is not None:
            return refused
        model = request.path_params["model"]
        deployment = self._resolve(key, model)
        if deployment is None:
            self.metrics.errors.labels(UNKNOWN, "unknown_model").inc()
            return self._unknown_model(model, key)
        return JSONResponse(self._model_object(deployment))

    def _unknown_model(self, model: str, key: ApiKey) -> JSONResponse:
        parts = []
        for name in self._visible(key):
            aliases = self.table.aliases(name)
            parts.append(f"{name} (aliases: {', '.join(aliases)})" if aliases else name)
        known = ", ".join(parts) or (
            "none (no deployment exists yet)" if not key.models or not self.table.known() else "none"
        )
        return _error(
            404,
            f"model {shown(model)} is not served here; known models: {known}",
            "invalid_request_error",
            "model_not_found",
        )

    # --- completions ------------------------------------------------------------

    async def _body(self, request: Request) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)

    def _parsed(self, body: bytes) -> tuple[dict[str, Any], str] | BadBody:
        """The body's JSON object and its `model`, or why it is refused."""
        return parsed_body(body, self.max_json_depth)

    def _bad_request(self, status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
        """A request refused before any deployment is known: counted, then answered."""
        self.metrics.errors.labels(UNKNOWN, "bad_request").inc()
        return _error(status, message, "invalid_request_error", code, param=param)

    async def complete(self, request: Request) -> Response:
        arrived = time.monotonic()
        key = await self._authorize(request)
        if isinstance(key, JSONResponse):
            return key
        try:
            body = await self._body(request)
        except ClientDisconnect:
            # The connection closed before the body was in (the client went, or the gateway
            # closed it at http: body_timeout_s): nobody is left to read an answer.
            return self._bad_request(
                400,
                "the connection closed before the body was in",
                "incomplete_body",
            )
        if body is None:
            return self._bad_request(
                413,
                f"request body over {self.max_body_bytes} bytes (the gateway's max_body_bytes)",
                "request_too_large",
            )
        parsed = self._parsed(body)
        if isinstance(parsed, BadBody):
            return self._bad_request(*parsed)
        payload, model = parsed
        starting = await self._not_loaded()
        if starting is not None:
            self.metrics.errors.labels(UNKNOWN, "gateway_starting").inc()
            return starting
        deployment = self._resolve(key, model)
        if deployment is None:
            self.metrics.errors.labels(UNKNOWN, "unknown_model").inc()
            return self._unknown_model(model, key)
        path: str = request.scope["path"]
        unserved = self._unserved(deployment, path)
        unsupported = self._unsupported(deployment, path, unserved)
        if unsupported is not None:
            self.metrics.errors.labels(deployment, "unsupported_path").inc()
            return unsupported
        reservation = await self.budgets.reserve(key, estimate(payload, len(body), path))
        if isinstance(reservation, Limited):
            return self._limited(key, deployment, reservation)
        # A streamed answer's usage comes in its last chunk, where the engine is asked for it;
        # the client sees that chunk only if it asked too.
        strip = False
        if path in _USAGE_OPTION and payload.get("stream") is True:
            options = payload.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                strip = True
                extra = options if isinstance(options, dict) else {}
                payload = {**payload, "stream_options": {**extra, "include_usage": True}}
                body = json.dumps(payload).encode()
        self._arrived(deployment)
        span = self._server_span(request.scope, model, deployment)
        routed = Routed(
            payload,
            body,
            model,
            deployment,
            key,
            span,
            arrived,
            self._replica_headers(request.scope["headers"], span),
            prompt_blocks(self.table.routing, deployment, path, payload),
            reservation,
            strip=strip,
        )
        return await self._send(request, routed, unserved)

    def _limited(self, key: ApiKey, deployment: str, limited: Limited) -> JSONResponse:
        """The 429 of a request over one of its key's limits."""
        self.metrics.errors.labels(deployment, "rate_limited").inc()
        per = "requests" if limited.what == "requests" else "tokens (prompt and completion)"
        held = f", {limited.held} of them held for its requests in flight" if limited.held else ""
        response = _error(
            429,
            f"API key {key.name!r} is at its limit of {limited.limit} {per} per minute{held}; "
            f"retry in {limited.retry_after}s",
            limited.what,
            "rate_limit_exceeded",
        )
        response.headers["Retry-After"] = str(limited.retry_after)
        return response

    async def _send(self, request: Request, routed: Routed, unserved: frozenset[str] = _NONE) -> Response:
        """`_forward`, the request's span ended where it raises, and its reservation given back
        where no answer is to be passed on (an error of the gateway's own, or an exception)."""
        try:
            response = await self._forward(request, routed, unserved)
        except BaseException as exc:
            routed.reservation.settle(0)
            span = routed.span
            span.record_exception(exc)
            span.set_status(trace.StatusCode.ERROR, str(exc))
            span.end()
            raise
        if not isinstance(response, StreamingResponse):
            # Answered whole (settled as it was counted) or refused: nothing more will be spent.
            routed.reservation.settle(0)
        return response

    def _server_span(self, scope: Scope, model: str, deployment: str) -> trace.Span:
        span = self.tracer.start_span(
            f"{scope['method']} {scope['path']}",
            # The client's trace continues here (its `traceparent`, if any), on to the engine.
            context=_client_context(scope["headers"]),
            kind=trace.SpanKind.SERVER,
        )
        if span.is_recording():
            # Read only where traces are kept (OTEL_EXPORTER_OTLP_ENDPOINT set).
            span.set_attributes(_server_attributes(scope, model, deployment))
        return span

    @staticmethod
    def _replica_headers(raw: list[tuple[bytes, bytes]], span: trace.Span) -> list[tuple[bytes, bytes]]:
        """The request's headers as the server read them (names in lower case), less the
        hop-by-hop ones, the trace's continued in the gateway's span."""
        if not span.get_span_context().is_valid:
            # No trace to continue (none kept here, and the client sent none): nothing to add.
            return [(k, v) for k, v in raw if k not in _HOP_BYTES]
        context: dict[str, str] = {}
        propagate.inject(context, context=trace.set_span_in_context(span))
        traced = {k.encode() for k in context}
        headers = [(k, v) for k, v in raw if k not in _HOP_BYTES and k not in traced]
        headers += [(k.encode(), v.encode("latin-1")) for k, v in context.items()]
        return headers

    # --- the express lane ------------------------------------------------------------

    def express(self, lane: Lane) -> bool:
        """Take a routed POST whose body is in, from the HTTP protocol's express lane, where
        it needs no wait: no task, no ASGI messages, the answer written whole as it comes.
        False, with nothing done, where the request needs the ASGI path from its start (a
        key or the buckets to wait for, a limit to claim on the bus, an answer to stream, an
        error to answer): it goes there. Once taken it is counted, and what cannot be
        finished here (no replica to take it, its model name or an idle connection to it
        wanting, a failure, an answer streamed or of no given length) goes on from
        where it stands on the ASGI path (`Routed` in the scope), before any byte went to the
        client."""
        arrived = time.monotonic()
        if not self.loaded.is_set():
            return False
        key = self.keyring.identify(
            _first(lane.headers, b"authorization"), api_key=_first(lane.headers, b"x-api-key")
        )
        if not isinstance(key, ApiKey):
            return False
        body = bytes(lane.body)
        parsed = self._parsed(body)
        if isinstance(parsed, BadBody):
            return False
        payload, model = parsed
        if payload.get("stream") is True:
            return False
        deployment = self._resolve(key, model)
        path = lane.path
        if deployment is None or self._unserved(deployment, path):
            return False
        blocks = prompt_blocks(self.table.routing, deployment, path, payload)
        reservation = self.budgets.reserve_at_once(key, estimate(payload, len(body), path), time.time())
        if reservation is None:
            return False
        # Taken: counted once the request is on its way to a replica, or handed over.
        span = self._server_span(lane.scope, model, deployment)
        headers = self._replica_headers(lane.headers, span)
        routed = Routed(payload, body, model, deployment, key, span, arrived, headers, blocks, reservation)
        chosen = routed.chosen = self.table.pick(deployment, _NONE, routed.blocks)
        served = None if chosen is None else self._served.get((chosen[1].url, chosen[1].profile_fp))
        if chosen is None or served is None:
            self._arrived(deployment)
            lane.hand_over(routed)
            return True
        chosen_key, record = chosen
        content = body if served == model else json.dumps({**payload, "model": served}).encode()

        def watch() -> None:
            # After a read of the replica's bytes, or a failure: from the status line on, the
            # lane decides (`_lane_answer`).
            answer = routed.sent
            if isinstance(answer, Answer) and not routed.decided and answer.head_in:
                self._lane_answer(lane, routed)

        answer = self.upstream.send_idle("POST", record.url, path, content, routed.headers, watch, lane.loop)
        self._arrived(deployment)
        if answer is None:
            lane.hand_over(routed)
            return True
        self._in_flight(chosen_key, record, deployment, span)
        routed.sent = answer
        return True

    def _lane_answer(self, lane: Lane, routed: Routed) -> None:
        """What comes of the answer to a request the lane sent, from its status line on:
        written here once whole where its length is given (`_waits_whole`), else the request
        goes on on the ASGI path (a failure before the answer retried there, after it cut off
        there, any other answer passed on in pieces)."""
        if routed.decided:
            return
        answer = routed.sent
        assert isinstance(answer, Answer)
        assert routed.chosen is not None
        if routed.wait is not None:
            routed.wait.cancel()
            routed.wait = None
        if not answer.complete and not answer.failed and _waits_whole(answer):
            # Its body comes in reads after its head's (engines served by uvicorn write the two
            # apart): waited for here, each read within the read timeout as on the ASGI path.
            timeout = self.upstream.read_timeout_s
            if timeout is not None:
                routed.wait = lane.loop.call_later(timeout, answer.time_out)
            return
        routed.decided = True
        answer.unwatch()
        failure = answer.failed_before_answer
        if failure is not None:
            answer.release()
            routed.sent = failure
            lane.hand_over(routed)
            return
        status = answer.status
        if (
            not answer.complete
            or status < 200
            or status in _NO_BODY
            or answer.header(b"content-type").startswith("text/event-stream")
        ):
            lane.hand_over(routed)
            return
        first_byte = time.monotonic()
        headers = [(n, v) for n, v in ((n.lower(), v) for n, v in answer.headers) if n not in _HOP_OUT_BYTES]
        body = answer.body()
        headers.append((b"content-length", b"%d" % len(body)))

        def count() -> None:
            # After the answer is written: the client waits on none of it.
            chosen_key, deployment = routed.chosen[0], routed.deployment  # type: ignore[index]
            self._answered(routed.span, deployment, status)
            self._count_whole(answer, body, chosen_key, deployment, routed, first_byte)

        lane.answer(status, headers, body, count)

    def _unserved(self, deployment: str, path: str) -> frozenset[str]:
        """The replicas of `deployment` whose engine does not serve `path`: none for a path
        every engine serves, without looking (the common case, on every request)."""
        if path in BASE_API_PATHS:
            return _NONE
        return frozenset(k for k, r in self.table.of(deployment) if not self._serves(r.engine, path))

    def _unsupported(self, deployment: str, path: str, unserved: frozenset[str]) -> JSONResponse | None:
        """The 400 where every replica that could take the request runs an engine that does
        not serve `path`; None otherwise."""
        if not unserved:
            return None
        candidates = {k for k, _ in [*self.table.ready(deployment), *self.table.unknown(deployment)]}
        if not candidates or not candidates <= unserved:
            return None
        engines = sorted({r.engine for k, r in self.table.of(deployment) if k in candidates})
        plural = "s" if len(engines) > 1 else ""
        return _error(
            400,
            f"deployment {deployment} runs on engine{plural} {', '.join(engines)}, which does not "
            f"serve {path}; it serves {', '.join(self._served_paths(engines))}",
            "invalid_request_error",
            "unsupported_endpoint",
        )

    def _serves(self, engine: str, path: str) -> bool:
        """Whether `engine`'s server answers `path`; an engine not named (by an older placement)
        or not known here is sent the request, and answers for itself."""
        paths = self._engines.api_paths(engine)
        return path in BASE_API_PATHS or paths is None or path in paths

    def _served_paths(self, engines: list[str]) -> list[str]:
        """The routed paths every one of `engines` serves."""
        paths = set(ROUTED)
        for engine in engines:
            paths &= self._engines.api_paths(engine) or BASE_API_PATHS
        return sorted(paths)

    async def _served_name(self, record: ReplicaRecord) -> str | None:
        """The model name the replica's engine answers to (engines refuse any other), read
        once however many requests ask at once: the first reads it, the others wait for its
        answer (1,000 held requests released together each read it, and most timed out in
        the pool of the client that reads it, and were sent without the name)."""
        key = (record.url, record.profile_fp)
        while key not in self._served:
            lookup = self._lookups.get(key)
            if lookup is None:
                lookup = self._lookups[key] = _Lookup()
                try:
                    lookup.name = await self._read_served_name(record)
                    lookup.read = True
                finally:
                    del self._lookups[key]
                    lookup.done.set()
                return lookup.name
            await lookup.done.wait()
            if lookup.read:
                return lookup.name
            # The one reading it was cancelled (its client left): another reads it.
        return self._served[key]

    async def _read_served_name(self, record: ReplicaRecord) -> str | None:
        url = record.url
        key = (url, record.profile_fp)
        try:
            r = await self.client.get(f"{url}/v1/models", timeout=5.0)
            r.raise_for_status()
            name = str(r.json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("cannot read the model name %s serves (sending the request as it is): %s", url, exc)
            return None
        if len(self._served) >= 4096:
            self._served.clear()  # replicas come and go on new ports; forget the old ones
        self._served[key] = name
        return name

    async def _forward(self, request: Request, routed: Routed, unserved: frozenset[str] = _NONE) -> Response:
        path: str = request.scope["path"]
        payload, body, model, deployment = routed.payload, routed.body, routed.model, routed.deployment
        span, headers, blocks = routed.span, routed.headers, routed.blocks
        tried: set[str] = set(unserved)
        failures: list[str] = []
        # A replica that closed a pooled connection as the request came is asked once more, on a
        # connection of its own, before another is: llama-server closes its connection after
        # each streamed answer, and a request sent on it in that instant never reached it.
        # Another replica would have to compute the prompt its cache holds.
        again: tuple[str, ReplicaRecord] | None = None
        reconnected: set[str] = set()
        # When the request was first held: its waits, all told, last at most hold_timeout_s.
        held_since: float | None = None
        # The express lane's replica: the request sent there already (what came of it), or to be.
        sent, routed.sent = routed.sent, None
        if routed.chosen is not None and sent is None:
            again = routed.chosen
        while True:
            chosen: tuple[str, ReplicaRecord] | None
            if sent is not None:
                # Sent by the lane, which counted it in flight there.
                chosen = routed.chosen
            else:
                chosen, again = again or self.table.pick(deployment, frozenset(tried), blocks), None
            if chosen is None and not failures and self._holdable(deployment):
                # No replica can take it yet (scaled to zero, starting): held until one is ready.
                held_since = time.monotonic() if held_since is None else held_since
                outcome = await self._hold(request, deployment, held_since + self.holds.timeout_s)
                if outcome == "sent":
                    # Its key may have been revoked, or have expired, while it was held.
                    revoked = self._held_key_refused(routed, held_since)
                    if revoked is not None:
                        return self._refuse(span, deployment, revoked, "unauthorized")
                    # A replica is ready now; it may run an engine that does not serve the path.
                    unserved = self._unserved(deployment, path)
                    unsupported = self._unsupported(deployment, path, unserved)
                    if unsupported is not None:
                        return self._refuse(span, deployment, unsupported, "unsupported_path")
                    tried = set(unserved)
                    continue
                answer, why = self._held_answer(deployment, outcome, held_since)
                return self._refuse(span, deployment, answer, why)
            if chosen is None:
                cannot = None if failures else self.table.refused(deployment)
                if cannot is not None:
                    return self._refuse(span, deployment, _unplaceable(cannot), "unplaceable")
                if failures:
                    attempts = len(tried - unserved)
                    plural = "" if attempts == 1 else "s"
                    reason = (
                        f"deployment {deployment} has {attempts} ready replica{plural} but none "
                        f"accepted the request: {'; '.join(failures)}"
                    )
                else:
                    reason = self.table.unavailable(deployment, time.time())
                refusal = _error(503, reason, "service_unavailable", "no_ready_replica")
                return self._refuse(span, deployment, refusal, "no_ready_replica")
            chosen_key, record = chosen
            tried.add(chosen_key)
            if sent is None:
                # Counted at once, before any await: requests arriving together must see each other.
                self._in_flight(chosen_key, record, deployment, span)
            try:
                if sent is None:
                    served = await self._served_name(record)
                    content = body
                    if served is not None and served != model:
                        content = json.dumps({**payload, "model": served}).encode()
                    upstream = await self.upstream.request(request.method, record.url, path, content, headers)
                else:
                    lane_sent, sent = sent, None
                    if not isinstance(lane_sent, Answer):
                        raise lane_sent
                    upstream = lane_sent
            except FAILED as exc:
                if not before_answer(exc):
                    self._release(chosen_key, deployment)
                    self.metrics.errors.labels(deployment, "upstream").inc()
                    message = (
                        f"replica {record.replica} of deployment {deployment} at {record.url} failed: "
                        f"{exc or type(exc).__name__}"
                    )
                    span.set_attributes({"http.response.status_code": 502, "error.type": "replica_failed"})
                    span.set_status(trace.StatusCode.ERROR, message)
                    span.end()
                    return _error(502, message, "upstream_error", "replica_failed")
                # No byte of answer came: the replica refused the connection, or closed or reset
                # it before answering (it died with the request). Another one may take it.
                self._release(chosen_key, deployment)
                refused = isinstance(exc, REFUSED)
                self.metrics.errors.labels(deployment, "connect" if refused else "reset").inc()
                if not refused and chosen_key not in reconnected:
                    reconnected.add(chosen_key)
                    again = chosen
                    log.info(
                        "%s: %s closed the connection before answering (%s); asking it again",
                        deployment,
                        chosen_key,
                        exc,
                    )
                    continue
                self._served.pop((record.url, record.profile_fp), None)
                failures.append(f"{record.replica} at {record.url}: {exc or type(exc).__name__}")
                what = "refused the connection" if refused else "failed before answering"
                log.warning("%s: %s %s (%s); trying another", deployment, chosen_key, what, exc)
                continue
            except BaseException:
                self._release(chosen_key, deployment)
                raise
            break
        status = upstream.status
        self._answered(span, deployment, status)
        out_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _HOP_OUT_BYTES]
        sse = upstream.header(b"content-type").startswith("text/event-stream")
        if upstream.complete and not sse:
            # The whole answer came with its head (an engine sends an answer not streamed once
            # it is done): passed on in one piece, with its length.
            return self._whole(upstream, out_headers, chosen_key, deployment, routed)
        relay = Relay(
            self._relay(
                upstream,
                chosen_key,
                deployment,
                span,
                routed.arrived,
                sse=path if sse else "",
                reservation=routed.reservation,
                strip=routed.strip,
            ),
            partial(self._relay_end, upstream, chosen_key, deployment, span, routed.reservation),
        )
        response = (StreamingResponse if sse else PassedResponse)(relay, status_code=status)
        response.raw_headers = out_headers
        return response

    def _whole(
        self, upstream: Answer, headers: list[tuple[bytes, bytes]], key: str, deployment: str, routed: Routed
    ) -> Response:
        """A replica's answer already read whole, as the client gets it."""
        body = self._whole_body(upstream, key, deployment, routed)
        response = Response(status_code=upstream.status)
        if upstream.status >= 200 and upstream.status not in _NO_BODY:
            headers.append((b"content-length", b"%d" % len(body)))
        response.raw_headers = headers
        response.body = body
        return response

    def _whole_body(self, upstream: Answer, key: str, deployment: str, routed: Routed) -> bytes:
        """The body of a replica's answer read whole, counted as `_relay` counts one passed on
        in pieces."""
        body = upstream.body()
        self._count_whole(upstream, body, key, deployment, routed, time.monotonic())
        return body

    def _count_whole(
        self, upstream: Answer, body: bytes, key: str, deployment: str, routed: Routed, first_byte: float
    ) -> None:
        """The answer read whole, `body`, counted: its time to first byte (`first_byte`, when it
        was ready to go out), its connection back to the pool, its tokens and its span."""
        self.metrics.of(deployment).ttfb.observe(first_byte - routed.arrived)
        upstream.release()
        meter = Meter()
        tail = JsonTail(upstream.header(b"content-encoding"))
        tail.feed(body)
        tail.read(meter)
        if tail.unread:
            # Encoded past what is inflated to read it: charged for its bytes, as one cut off.
            meter.passed = len(body)
            estimate = routed.reservation.estimate
            meter.estimate(estimate.prompt, generates=estimate.generates)
        self._done(key, deployment, routed.span, routed.reservation, meter)

    def _arrived(self, deployment: str) -> None:
        """A request for `deployment` counted: in its metrics and the demand the autoscaler hears."""
        self.metrics.of(deployment).requests.inc()
        self.demand.arrive(deployment)

    def _in_flight(self, key: str, record: ReplicaRecord, deployment: str, span: trace.Span) -> None:
        """The request counted in flight at the replica chosen for it."""
        self.table.outstanding[key] += 1
        self.metrics.of(deployment).outstanding.inc()
        span.set_attributes({"llmgw.replica": record.replica, "llmgw.replica_url": record.url})

    def _answered(self, span: trace.Span, deployment: str, status: int) -> None:
        """The replica's status line is in."""
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attributes({"error.type": str(status)})
            span.set_status(trace.StatusCode.ERROR)
            self.metrics.errors.labels(deployment, "upstream_status").inc()

    # --- held requests ------------------------------------------------------------

    def _holdable(self, deployment: str) -> bool:
        """Whether a request for `deployment` with no replica to take it waits for one: it is in
        the deployments bucket, meant to run (an autoscale, or a count above 0) and holding is
        on. A deployment scaled to 0 by hand is answered at once: nothing will start it; so is
        one placement could place on no node, with none of its replicas placed (`Table.refused`):
        nothing can serve it until the cluster changes."""
        d = self.table.deployments.get(deployment)
        return (
            self.holds.enabled
            and d is not None
            and (d.autoscale is not None or d.replicas > 0)
            and self.table.refused(deployment) is None
        )

    async def _hold(self, request: Request, deployment: str, deadline: float) -> str:
        """Hold the request until a replica of `deployment` can take it: `sent` (one can now),
        `timeout` (past `deadline`), `full` (the queue is), `left` (the client went),
        `restarting` (the gateway is stopping)."""
        if self.holds.closing:
            return "restarting"
        held = self.holds.add(deployment)
        if held is None:
            return "full"
        if self.holds.queued(deployment) == 1:
            # The deployment's first held request: the autoscaler hears of it now, not at the
            # next report.
            self.demand.wanted.set()
        self.metrics.held.labels(deployment).inc()
        outcome = "timeout"
        try:
            async with anyio.create_task_group() as tg:

                async def client_left() -> None:
                    # The body is in: the next message the server has for this request is the
                    # client's disconnect.
                    nonlocal outcome
                    while (await request.receive())["type"] != "http.disconnect":
                        pass
                    outcome = "left"
                    tg.cancel_scope.cancel()

                tg.start_soon(client_left)
                with anyio.move_on_after(max(0.0, deadline - time.monotonic())):
                    await held.woken.wait()
                    outcome = "restarting" if held.closing else "sent"
                if outcome == "sent":
                    # Its turn among those released together (`Holds.release` paces them),
                    # unless the gateway stops first.
                    with anyio.move_on_after(max(0.0, held.at - time.monotonic())):
                        await held.stopped.wait()
                        outcome = "restarting"
                tg.cancel_scope.cancel()
        finally:
            self.holds.remove(held)
            self.metrics.held.labels(deployment).dec()
            self.metrics.hold_wait.labels(deployment, outcome).observe(time.monotonic() - held.since)
        return outcome

    def _held_key_refused(self, routed: Routed, since: float) -> JSONResponse | None:
        """The 401 for a request whose key was revoked, deleted or expired while it was held;
        None where the key is still active."""
        found = self.keyring.recheck(routed.key)
        if isinstance(found, ApiKey):
            return None
        waited = time.monotonic() - since
        return _error(
            401,
            f"{found.message} (the request was held {waited:.1f}s for a ready replica of deployment "
            f"{routed.deployment} and was not sent)",
            "authentication_error",
            found.code,
        )

    def replicas_changed(self, deployment: str) -> None:
        """A replica or the deployment changed: held requests go where a replica can take them
        now, and are answered where the deployment is no longer meant to run."""
        can_take = self.table.ready(deployment) or self.table.unknown(deployment)
        if can_take or not self._holdable(deployment):
            self.holds.release(deployment)

    def _held_answer(self, deployment: str, outcome: str, since: float) -> tuple[JSONResponse, str]:
        """The answer to a request held and not sent, and its reason for the errors counter."""
        waited = time.monotonic() - since
        if outcome == "full":
            return _error(
                429,
                f"deployment {deployment} has no ready replica and {self.holds.limit} requests are "
                f"already held for one (the gateway's hold_queue); retry in {FULL_RETRY_AFTER_S}s",
                "requests",
                "hold_queue_full",
                retry_after=FULL_RETRY_AFTER_S,
            ), "hold_queue_full"
        if outcome == "restarting":
            return _error(
                503,
                f"gateway restarting: the request was held {waited:.1f}s for a ready replica of "
                f"deployment {deployment} and was not sent; retry in {RESTART_RETRY_AFTER_S}s",
                "service_unavailable",
                "gateway_restarting",
                retry_after=RESTART_RETRY_AFTER_S,
            ), "gateway_restarting"
        why = "client_left" if outcome == "left" else "no_ready_replica"
        # The replicas' own words (`r0 starting for 38s (loading …)`), or placement's refusal.
        reason = (
            f"{self.table.unavailable(deployment, time.time())}; the request was held "
            f"{waited:.1f}s (the gateway's hold_timeout_s: {self.holds.timeout_s:g}s) and no replica "
            "became ready"
        )
        refusal = _error(
            503, reason, "service_unavailable", "no_ready_replica", retry_after=TIMEOUT_RETRY_AFTER_S
        )
        return refusal, why

    def _refuse(self, span: trace.Span, deployment: str, response: JSONResponse, reason: str) -> JSONResponse:
        """Answer a routed request with the gateway's own error: counted under `reason`, its
        span ended with it."""
        error = json.loads(bytes(response.body))["error"]
        self.metrics.errors.labels(deployment, reason).inc()
        span.set_attributes({"http.response.status_code": response.status_code, "error.type": error["code"]})
        span.set_status(trace.StatusCode.ERROR, error["message"])
        span.end()
        return response

    def _release(self, key: str, deployment: str) -> None:
        self.table.outstanding[key] -= 1
        if self.table.outstanding[key] <= 0:
            del self.table.outstanding[key]
        self.metrics.of(deployment).outstanding.dec()

    async def _relay(
        self,
        upstream: Answer,
        key: str,
        deployment: str,
        span: trace.Span,
        arrived: float,
        *,
        sse: str = "",
        reservation: Reservation,
        strip: bool = False,
    ) -> AsyncGenerator[bytes, None]:
        first = True
        meter = Meter()
        # A JSON answer: its end, read for its usage once whole.
        tail = JsonTail(upstream.header(b"content-encoding")) if not sse else None
        # Server-sent events (`sse` is the request's path): passed on whole events at a time, so
        # that a stream broken off mid-event can still end with a well-formed error event.
        events = Events(meter, strip=strip) if sse else None
        # Whether the answer came to its end, or the replica broke it off: else the client left
        # before its end (and its usage), and it is charged for what was passed on.
        ended = False
        try:
            async for chunk in upstream.chunks():
                if first:
                    first = False
                    self.metrics.of(deployment).ttfb.observe(time.monotonic() - arrived)
                if events is not None:
                    chunk = events.feed(chunk)
                    if not chunk:
                        continue
                elif tail is not None:
                    tail.feed(chunk)
                    meter.passed += len(chunk)
                yield chunk
            if events is not None:
                rest = events.end()
                if rest:
                    yield rest
            if tail is not None:
                tail.read(meter)
            ended = True
        except FAILED as exc:
            ended = True  # by the replica: what it said is charged, as before it failed
            # Mid-answer: never retried (the replica had the request). A streamed answer ends
            # with an error event and [DONE]; any other is cut off without its last chunk
            # (raised to the server, which closes the connection), so the client sees it
            # incomplete rather than taking what came for the whole answer.
            failure = f"{exc or type(exc).__name__}"
            span.set_status(trace.StatusCode.ERROR, failure)
            log.warning("%s: %s broke off its answer: %s", deployment, key, failure)
            if sse:
                self.metrics.errors.labels(deployment, "upstream_stream").inc()
                record = self.table.replicas.get(key)
                where = f"replica {record.replica} at {record.url}" if record else f"replica {key}"
                yield _sse_error(
                    f"{where} of deployment {deployment} broke off its answer: {failure}; "
                    "the answer is incomplete and was not retried",
                    sse,
                )
            else:
                self.metrics.errors.labels(deployment, "upstream").inc()
                raise BrokenAnswer(f"{deployment}: {key} broke off its answer: {failure}") from exc
        finally:
            self._relay_end(upstream, key, deployment, span, reservation, meter, tail, ended=ended)

    def _relay_end(
        self,
        upstream: Answer,
        key: str,
        deployment: str,
        span: trace.Span,
        reservation: Reservation,
        meter: Meter | None = None,
        tail: JsonTail | None = None,
        *,
        ended: bool = False,
    ) -> None:
        """The end of a replica's answer passed on (`_relay`), or never begun: its client left
        before the server asked for its first chunk (`Relay.aclose`), and the replica's count
        was held for ever."""
        meter = meter or Meter()
        # Read to its end, the connection is back in the pool already; else it is closed.
        upstream.release()
        if tail is not None and tail.unread:
            # An encoded answer past what is inflated to read it: charged as one cut off.
            ended = False
        if not ended and 200 <= upstream.status < 300:
            # A successful answer the client cut off: what was passed on, charged.
            if tail is not None:
                tail.read(meter)  # its usage, where what was passed on holds it
            meter.estimate(reservation.estimate.prompt, generates=reservation.estimate.generates)
        self._done(key, deployment, span, reservation, meter)

    def _done(
        self, key: str, deployment: str, span: trace.Span, reservation: Reservation, meter: Meter
    ) -> None:
        """A replica's answer passed on, whole or not: its replica's count released, its tokens
        recorded and charged, its reservation settled, its span ended."""
        self._release(key, deployment)
        self.usage.add(reservation.key.name, deployment, meter)
        reservation.settle(meter.prompt + meter.completion)
        if meter.prompt:
            span.set_attribute("gen_ai.usage.input_tokens", meter.prompt)
        if meter.completion:
            span.set_attribute("gen_ai.usage.output_tokens", meter.completion)
        span.end()


def _server_attributes(scope: Scope, model: str, deployment: str) -> dict[str, str | int]:
    """A routed request's server span attributes, by OpenTelemetry's HTTP and GenAI semantic
    conventions (the stable names: `http.request.method`, `url.path`, `server.address`…;
    the response's status and the token counts are added when they are known). Read from the
    ASGI scope and the `Host` header, not a whole URL built: that cost more than the rest."""
    path: str = scope["path"]
    attributes: dict[str, str | int] = {
        "http.request.method": scope["method"],
        "http.route": path,
        "url.path": path,
        "url.scheme": scope["scheme"],
        "gen_ai.operation.name": _OPERATION.get(path, "chat"),
        "gen_ai.request.model": model[:256],
        "llmgw.deployment": deployment,
    }
    headers = scope["headers"]
    host = _first(headers, b"host")
    if host:
        try:
            where = urlsplit(f"//{host}")
            hostname, port = where.hostname, where.port
        except ValueError:  # a Host header that names no host and port: no attribute from it
            hostname, port = None, None
        if hostname:
            attributes["server.address"] = hostname
        if port:
            attributes["server.port"] = port
    client = scope.get("client")
    if client:
        attributes["client.address"] = client[0]
    agent = _first(headers, b"user-agent")
    if agent:
        attributes["user_agent.original"] = agent[:256]
    return attributes


def _waits_whole(answer: Answer) -> bool:
    """Whether the express lane waits for the rest of an answer whose status line is in: a
    final answer, not server-sent events, whose body's length is given and within what is read
    ahead of a client. Any other goes on from the ASGI path, passed on as it comes."""
    status = answer.status
    if status < 200 or status in _NO_BODY or answer.header(b"content-type").startswith("text/event-stream"):
        return False
    length = answer.header(b"content-length")
    return length.isdigit() and int(length) <= HIGH_WATER


def _first(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    """The first value of header `name` (lower case, as the server read it), or ""."""
    for n, v in headers:
        if n == name:
            return v.decode("latin-1")
    return ""


class _RawHeadersGetter(Getter[list[tuple[bytes, bytes]]]):
    """The trace propagators' reader of the request's headers as the server read them."""

    def get(self, carrier: list[tuple[bytes, bytes]], key: str) -> list[str] | None:
        name = key.lower().encode("latin-1")
        values = [v.decode("latin-1") for n, v in carrier if n == name]
        return values or None

    def keys(self, carrier: list[tuple[bytes, bytes]]) -> list[str]:
        return [n.decode("latin-1") for n, _ in carrier]


_RAW_HEADERS = _RawHeadersGetter()


class _TraceFields:
    """The headers the trace propagators read (their `fields`; W3C trace context and baggage:
    `traceparent`, `tracestate`, `baggage`), as the server reads names: looked up again only
    when another propagator is set."""

    __slots__ = ("names", "textmap")

    def __init__(self) -> None:
        self.textmap: object = None
        self.names: frozenset[bytes] = frozenset()

    def of(self, textmap: TextMapPropagator) -> frozenset[bytes]:
        if textmap is not self.textmap:
            self.names = frozenset(f.lower().encode("latin-1") for f in textmap.fields)
            self.textmap = textmap
        return self.names


_TRACE_FIELDS = _TraceFields()
# What a request without trace headers continues: nothing (as the propagators make of it).
_NO_TRACE = Context()


def _client_context(headers: list[tuple[bytes, bytes]]) -> Context:
    """The trace context the client sent in `headers`; the propagators are not asked where
    none of their headers came (most requests)."""
    textmap = propagate.get_global_textmap()
    names = _TRACE_FIELDS.of(textmap)
    for name, _ in headers:
        if name in names:
            return propagate.extract(headers, getter=_RAW_HEADERS)
    return _NO_TRACE
