"""The OpenAI-compatible HTTP surface: `/v1/models` and `/v1/models/{id}`,
`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/responses`
and Anthropic's `/v1/messages` (streamed or not), `/healthz` and `/metrics`.
Every error the gateway answers itself, unknown paths included, is OpenAI's
error object (`errors.py`).

A routed request goes through the same steps on either path, each in a module of its own
(as an HTTP client's `send` goes through auth, redirects, one request and a transport):

- admission (`admission.admit`, pure): its key, body and `model`, the deployment, whether
  the deployment's engines serve the path; then its key's rate limits (`budgets.py`);
- pick or hold (`pick.py`): a ready replica (the one its prompt's prefix was sent to, else
  the one with the fewest requests in flight: `routing.py`), or a wait for one;
- the attempts (`attempts.py`): where a replica fails before any byte of answer (it refused
  the connection, or closed or reset it before answering: it died, and placement has not
  said so yet) the request goes to another;
- the relay (`relay.py`): once a replica's answer has begun, it is passed through (status,
  headers less the hop-by-hop ones and its `Date`, body byte for byte, server-sent events
  included) and never retried: a chat or completion answer broken off after that is
  continued on another replica from what the client has (`continuation.py`); any other
  stream, or one that cannot be continued, ends with an SSE error event and `data: [DONE]`,
  never silently truncated.

A routed request takes one of two paths with the same outcome: the express lane
(`express.py`, from the HTTP protocol's callbacks: no task, no ASGI messages) where nothing
needs a wait but the replica's and its answer gives its length, else the ASGI app (`app`,
`complete`), which also takes over what the lane began (`Routed`, in the scope under
`RESUMED`) wherever another wait or a stream turns up: the lane's attempt is its first
(`express.LaneTaken`, a transport).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import httpx
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from llmgw_core.engines import default_registry
from llmgw_core.keys import ApiKey
from llmgw_core.metrics import Collect, exposition

from . import metrics, worker_metrics
from .adapter_limits import AdapterLimits
from .adapter_loads import AdapterLoads, LoadFailed
from .admission import (
    STARTING,
    BadBody,
    Refusal,
    Tables,
    admit,
    identify,
    model_object,
    model_objects,
    parsed_body,
    resolve,
    unknown_model,
)
from .attempts import Attempts, Replicas
from .budgets import Budgets, Limited
from .demand import DemandCounts
from .engine_tokens import EngineTokens
from .errors import error, error_body, internal, not_allowed, not_found
from .express import ExpressLane, LaneTaken
from .holds import Holds
from .keyring import Keyring, file_keys
from .lane import Lane
from .ledger import Ledger
from .names import ServedNames
from .pick import Picker
from .relay import Relay, Relays
from .routed import Routed
from .routing import Table, prompt_blocks
from .surface import NONE, RESUMED, ROUTED, ROUTED_PATHS, UNKNOWN
from .tracing import replica_headers, server_span
from .upstream import Upstream
from .usage import Usage

# The names the gateway's tests and tools import from here.
__all__ = ["ROUTED", "BadBody", "Proxy", "error_body", "parsed_body"]

# How long a request waits for a starting gateway's first snapshot of the buckets.
LOAD_WAIT_S = 10.0


class Proxy:
    """The gateway's ASGI app and express lane over the routing table: the plain endpoints
    here, a routed request's steps each in its own module, wired together once."""

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
        adapter_loads: AdapterLoads | None = None,
        adapter_limits: AdapterLimits | None = None,
    ) -> None:
        self.table = table
        # `client` reads a replica's /v1/models once; `upstream` carries the requests.
        self.client = client
        self.upstream = upstream or Upstream()
        # Without a keyring: open, or the keys of `api_keys` only.
        self.keyring = keyring or Keyring(required=bool(api_keys), file=file_keys(api_keys))
        self.budgets = budgets or Budgets(None)
        # Each LoRA adapter's own limits, from the catalog (the service feeds it).
        self.adapter_limits = adapter_limits or AdapterLimits()
        self.max_body_bytes = max_body_bytes
        self.tracer = tracer or trace.get_tracer("llmgw.gateway")
        self.metrics = metrics.Metrics()
        self.metrics.registry.register(Collect(lambda: metrics.routed(self.table)))
        # Requests waiting for a deployment's first ready replica, and what the demand reports say.
        self.holds = holds or Holds()
        # Requests for a LoRA adapter no ready replica holds, held while one loads it.
        self.adapter_loads = adapter_loads or AdapterLoads(None, table, self.holds.timeout_s)
        self.demand = DemandCounts()
        self.usage = usage or Usage(None, self.metrics.registry)
        # A worker of several: its index, and the other workers' registry ports (read at each
        # scrape, a restarted worker's new one included); `/metrics` answers all of them.
        self.peers: tuple[str, Callable[[], dict[str, int]]] | None = None
        # Set once the first snapshot of the buckets is in: until then "unknown model"
        # would be a lie.
        self.loaded = anyio.Event()
        # Why this gateway cannot hear NATS now ("" while it can): cut off, it serves the
        # replicas it knew, and `/healthz` says so (the service sets it).
        self.cut_off: Callable[[], str] = lambda: ""
        engines = default_registry()
        self.tables = Tables(self.keyring, table, engines, max_json_depth)
        self.ledger = Ledger(table, self.metrics, self.demand, self.usage)
        self.names = ServedNames(client)
        self.picker = Picker(table, self.holds, self.demand, self.keyring, engines, self.ledger, self.metrics)
        self.relays = Relays(table, self.metrics, self.ledger, self.tracer)
        replicas = Replicas(self.names, self.upstream)
        tokens = EngineTokens(client, table, self.names)
        self.attempts = Attempts(self.picker, replicas, self.relays, self.ledger, self.metrics, tokens)
        self.lane = ExpressLane(
            self.tables,
            self.loaded,
            self.budgets,
            self.tracer,
            self.ledger,
            self.names,
            self.upstream,
            self.relays,
        )
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
            exception_handlers={404: not_found, 405: not_allowed, Exception: internal},
        )

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The gateway's ASGI app. A routed POST goes straight to `complete`: through Starlette's
        middleware, router and endpoint wrappers it took seven layers of calls, a fifth of
        the request's Python work in front of the proxy's own. Every other request, and a
        routed path with another method (405), goes through the router."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED_PATHS:
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
            await (await internal(request, exc))(scope, receive, send)
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

    def express(self, lane: Lane) -> bool:
        """A routed POST from the HTTP protocol's express lane: `ExpressLane.express`."""
        return self.lane.express(lane)

    def replicas_changed(self, deployment: str) -> None:
        """A replica or the deployment changed: `Picker.replicas_changed`."""
        self.picker.replicas_changed(deployment)

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def __aenter__(self) -> Proxy:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    # --- plain endpoints ------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        # Open to load balancers, which send no key; the deployments' names only to a client
        # with one, where keys are required.
        if not self.loaded.is_set():
            return JSONResponse({"status": "loading", "detail": "reading the replicas bucket"}, 503)
        cut_off = self.cut_off()
        said = {"status": "ok", **({"nats": cut_off} if cut_off else {})}
        if not isinstance(identify(request.scope["headers"], self.keyring), ApiKey):
            return JSONResponse(said)
        return JSONResponse({**said, "deployments": self.table.known()})

    async def prometheus(self, request: Request) -> Response:
        # Behind the key where keys are required: the labels name every deployment.
        found = await self._authorize(request)
        if isinstance(found, JSONResponse):
            return found
        if self.peers is None:
            return exposition(self.metrics.registry, request)
        index, ports = self.peers
        own = generate_latest(self.metrics.registry).decode()
        merged = await worker_metrics.gather(self.client, (index, own), ports())
        return Response(merged, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _authorize(self, request: Request) -> ApiKey | JSONResponse:
        """The request's key (open access where keys are not required), or its 401. A starting
        gateway has not read the keys bucket yet: it waits for it before refusing a key."""
        headers = request.scope["headers"]
        found = identify(headers, self.keyring)
        if not isinstance(found, ApiKey) and not self.loaded.is_set():
            with anyio.move_on_after(LOAD_WAIT_S):
                await self.loaded.wait()
            found = identify(headers, self.keyring)
        if isinstance(found, ApiKey):
            return found
        self.metrics.errors.labels(UNKNOWN, "unauthorized").inc()
        return error(401, found.message, "authentication_error", found.code)

    async def _loading(self) -> bool:
        """Whether the buckets' first snapshot is still not in, after a little wait for it."""
        if self.loaded.is_set():
            # No cancel scope per request once loaded: it cost about 3% of a request's CPU.
            return False
        with anyio.move_on_after(LOAD_WAIT_S):
            await self.loaded.wait()
        return not self.loaded.is_set()

    async def _models_key(self, request: Request) -> ApiKey | JSONResponse:
        """The key of a `/v1/models` request, or its 401 or 503."""
        key = await self._authorize(request)
        if isinstance(key, ApiKey) and await self._loading():
            return error(STARTING.status, STARTING.message, STARTING.kind, STARTING.code)
        return key

    async def models(self, request: Request) -> Response:
        key = await self._models_key(request)
        if isinstance(key, JSONResponse):
            return key
        return JSONResponse({"object": "list", "data": model_objects(self.table, key)})

    async def model(self, request: Request) -> Response:
        """One model, by a deployment's name or alias, as OpenAI's `GET /v1/models/{model}`."""
        key = await self._models_key(request)
        if isinstance(key, JSONResponse):
            return key
        model = request.path_params["model"]
        deployment = resolve(self.table, key, model)
        if deployment is None:
            self.metrics.errors.labels(UNKNOWN, "unknown_model").inc()
            return error(
                404, unknown_model(self.table, model, key), "invalid_request_error", "model_not_found"
            )
        return JSONResponse(model_object(self.table, deployment))

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

    def _refused(self, refusal: Refusal) -> JSONResponse:
        """A request refused at admission: counted under its reason, then answered."""
        self.metrics.errors.labels(refusal.deployment, refusal.reason).inc()
        return error(refusal.status, refusal.message, refusal.kind, refusal.code, param=refusal.param)

    async def complete(self, request: Request) -> Response:
        arrived = time.monotonic()
        # The key first: a client without one is not read a body of up to max_body_bytes.
        found = await self._authorize(request)
        if isinstance(found, JSONResponse):
            return found
        try:
            body = await self._body(request)
        except ClientDisconnect:
            # The connection closed before the body was in (the client went, or the gateway
            # closed it at http: body_timeout_s): nobody is left to read an answer.
            return self._refused(
                Refusal(
                    400,
                    "the connection closed before the body was in",
                    "invalid_request_error",
                    "incomplete_body",
                    "bad_request",
                )
            )
        if body is None:
            return self._refused(
                Refusal(
                    413,
                    f"request body over {self.max_body_bytes} bytes (the gateway's max_body_bytes)",
                    "invalid_request_error",
                    "request_too_large",
                    "bad_request",
                )
            )
        scope = request.scope
        headers, path = scope["headers"], scope["path"]
        admitted = admit(headers, body, path, self.tables, loaded=self.loaded.is_set())
        if isinstance(admitted, Refusal) and admitted.loading and not await self._loading():
            admitted = admit(headers, body, path, self.tables, loaded=True)
        if isinstance(admitted, Refusal):
            return self._refused(admitted)
        key, payload, body, model, deployment = admitted[:5]
        if admitted.cold is not None:
            try:
                loaded_on = await self.adapter_loads.ensure(deployment, admitted.adapter, admitted.cold)
            except LoadFailed as exc:
                refusal = Refusal(503, str(exc), "service_unavailable", "adapter_not_loaded", "adapter_load")
                refused = self._refused(refusal._replace(deployment=deployment))
                if exc.retry_after is not None:  # every replica's adapters were in use
                    refused.headers["Retry-After"] = str(exc.retry_after)
                return refused
            others = frozenset(k for k, _ in self.table.of(deployment) if k != loaded_on)
            admitted = admitted._replace(unserved=admitted.unserved | others)
        own = self.adapter_limits.of(admitted.adapter) if admitted.adapter else None
        reservation = await self.budgets.reserve(key, admitted.estimate, adapter=own)
        if isinstance(reservation, Limited):
            return self._limited(key, deployment, reservation, admitted.adapter)
        self.ledger.arrived(deployment)
        span = server_span(self.tracer, scope, model, deployment)
        routed = Routed(
            payload,
            body,
            model,
            deployment,
            key,
            span,
            arrived,
            replica_headers(headers, span),
            prompt_blocks(self.table.routing, deployment, path, payload, admitted.adapter),
            reservation,
            strip=admitted.strip,
            adapter=admitted.adapter,
            adapters=self.table.adapters,
        )
        return await self._send(request, routed, admitted.unserved)

    def _limited(self, key: ApiKey, deployment: str, limited: Limited, adapter: str = "") -> JSONResponse:
        """The 429 of a request over one of its key's limits, or of its adapter's own."""
        self.metrics.errors.labels(deployment, "rate_limited").inc()
        per = "requests" if limited.what == "requests" else "tokens (prompt and completion)"
        held = f", {limited.held} of them held for its requests in flight" if limited.held else ""
        said = f"API key {key.name!r} is at its limit of {limited.limit} {per} per minute"
        if limited.window:
            said = (
                f"adapter {adapter!r} is at its own limit of {limited.limit} {per} per minute, "
                "every key's requests for it together"
            )
        return error(
            429,
            f"{said}{held}; retry in {limited.retry_after}s",
            limited.what,
            "rate_limit_exceeded",
            retry_after=limited.retry_after,
        )

    async def _send(self, request: Request, routed: Routed, unserved: frozenset[str] = NONE) -> Response:
        """The request's attempts (`Attempts.forward`; the express lane's first, where it sent
        it), the request's span ended where they raise, and its reservation given back where no
        answer is to be passed on (an error of the gateway's own, or an exception)."""
        sent, routed.sent = routed.sent, None
        try:
            taken = None if sent is None else LaneTaken(sent)
            response = await self.attempts.forward(request, routed, unserved, taken)
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
