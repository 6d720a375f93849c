"""Admission, written once: whether a routed request goes on, and as what. `admit` is pure
(plain values in, a value out, no I/O): the key its headers carry, its body's JSON and
`model`, the deployment that names (one the key may call), whether that deployment's
engines serve the path, and what the request may spend. Both of the gateway's paths call
it: the ASGI path answers a `Refusal` with its error, the express lane declines the request
(the ASGI path then answers it).

What comes after admission is not pure and is not here: the key's rate limits (claimed
against the cluster's budget, `budgets.py`), then the replica (`pick.py`)."""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from llmgw_core.engines import BASE_API_PATHS, Registry
from llmgw_core.keys import ApiKey, allows

from .budgets import Estimate, estimate
from .keyring import Keyring, Refused
from .limits import body_problem, json_nests_deeper, shown
from .routing import Table
from .surface import NONE, ROUTED, UNKNOWN, USAGE_OPTION, first


class BadBody(NamedTuple):
    """Why a routed request's body is refused: its status, message and error code, and the
    body's field at fault where one is."""

    status: int
    message: str
    code: str
    param: str | None = None


class Tables(NamedTuple):
    """What admission reads: the keys, the deployments and their replicas, the engines' paths,
    and how deep a body's JSON may nest."""

    keyring: Keyring
    table: Table
    engines: Registry
    max_json_depth: int


class Admitted(NamedTuple):
    """A request admitted: its key, its body (with `stream_options` added where its streamed
    answer's usage must be asked for), the deployment it goes to, the replicas of it whose
    engine does not serve the path, and what it may spend (judged on the body as it came)."""

    key: ApiKey
    payload: dict[str, Any]
    body: bytes
    model: str
    deployment: str
    unserved: frozenset[str]
    estimate: Estimate
    # The usage chunk of its streamed answer is taken out: the client did not ask for it.
    strip: bool
    # The LoRA adapter of `deployment` it asks for (`model` names it); "" for the base.
    adapter: str = ""
    # No ready replica holds the adapter; these may load it (replica key -> node, shard): the
    # request is held while one does (`adapter_loads`).
    cold: dict[str, tuple[str, str]] | None = None


class Refusal(NamedTuple):
    """A request refused, as its error says it (status, message, OpenAI's `type` and `code`,
    the body's field at fault), counted under `reason` for `deployment`. `loading`: the
    gateway has not read the cluster's buckets yet, and the answer may change once it has."""

    status: int
    message: str
    kind: str
    code: str
    reason: str
    deployment: str = UNKNOWN
    param: str | None = None
    loading: bool = False


STARTING = Refusal(
    503,
    "the gateway has not read the cluster's replicas yet (is NATS reachable?); try again shortly",
    "service_unavailable",
    "gateway_starting",
    "gateway_starting",
    loading=True,
)


def identify(
    headers: list[tuple[bytes, bytes]], keyring: Keyring, now: float | None = None
) -> ApiKey | Refused:
    """The key the request carries: `Authorization: Bearer`, or Anthropic's `x-api-key`."""
    return keyring.identify(first(headers, b"authorization"), now, api_key=first(headers, b"x-api-key"))


def admit(
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    path: str,
    tables: Tables,
    *,
    loaded: bool,
    now: float | None = None,
) -> Admitted | Refusal:
    """Whether the request of `headers` and `body` to routed `path` goes on, and as what.
    `loaded`: the buckets' first snapshot is in (before it, an unknown model may not be
    unknown). Pure: it reads `tables` and the clock (`now`, else the time) only."""
    key = identify(headers, tables.keyring, now)
    if not isinstance(key, ApiKey):
        return Refusal(401, key.message, "authentication_error", key.code, "unauthorized")
    parsed = parsed_body(body, tables.max_json_depth)
    if isinstance(parsed, BadBody):
        status, message, code, param = parsed
        return Refusal(status, message, "invalid_request_error", code, "bad_request", param=param)
    if not loaded:
        return STARTING
    payload, model = parsed
    table = tables.table
    deployment = resolve(table, key, model)
    adapter, holding, cold = "", None, None
    if deployment is None:
        held = table.adapters.holders(model)
        loaders = table.adapters.loaders(model)
        if held is not None and loaders is not None and not table_holds_ready(table, *held):
            held = None  # no replica that holds it is ready: one that is may load it
        if held is not None and adapter_allowed(key, model):
            (deployment, holding), adapter = held, model
        elif loaders is not None and adapter_allowed(key, model):
            deployment, cold = loaders
            holding, adapter = frozenset(cold), model
    if deployment is None:
        scoped = adapter_scoped(table, key, model)
        if scoped is not None:
            return Refusal(403, scoped, "permission_error", "model_not_allowed", "forbidden")
        return Refusal(
            404, unknown_model(table, model, key), "invalid_request_error", "model_not_found", "unknown_model"
        )
    unserved = unserved_by(table, tables.engines, deployment, path)
    unsupported = unsupported_by(table, tables.engines, deployment, path, unserved)
    if unsupported is not None:
        return Refusal(
            400, unsupported, "invalid_request_error", "unsupported_endpoint", "unsupported_path", deployment
        )
    if holding is not None:
        # Only a replica whose engine loaded the adapter may answer for it.
        unserved = unserved | frozenset(k for k, _ in table.of(deployment) if k not in holding)
    spends = estimate(payload, len(body), path)
    # A streamed answer's usage comes in its last chunk, where the engine is asked for it;
    # the client sees that chunk only if it asked too.
    strip = False
    if path in USAGE_OPTION and payload.get("stream") is True:
        options = payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            strip = True
            extra = options if isinstance(options, dict) else {}
            payload = {**payload, "stream_options": {**extra, "include_usage": True}}
            body = json.dumps(payload).encode()
    return Admitted(key, payload, body, model, deployment, unserved, spends, strip, adapter, cold)


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


def visible(table: Table, key: ApiKey) -> list[str]:
    """The deployments `key` may call (and so sees), sorted."""
    return [name for name in table.known() if allows(key, name, table.resolve)]


def resolve(table: Table, key: ApiKey, model: str) -> str | None:
    """The deployment `model` names, if `key` may call it: a model the key may not call is
    unknown to it, as one that does not exist (its name is not confirmed to the key)."""
    deployment = table.resolve(model)
    if deployment is None or not allows(key, deployment, table.resolve):
        return None
    return deployment


def unknown_model(table: Table, model: str, key: ApiKey) -> str:
    """What a 404 for `model` says: the models `key` may call, with their aliases."""
    parts = []
    for name in visible(table, key):
        aliases = table.aliases(name)
        parts.append(f"{name} (aliases: {', '.join(aliases)})" if aliases else name)
    known = ", ".join(parts) or (
        "none (no deployment exists yet)" if not key.models or not table.known() else "none"
    )
    return f"model {shown(model)} is not served here; known models: {known}"


def table_holds_ready(table: Table, deployment: str, holding: frozenset[str]) -> bool:
    """Whether a ready replica of `deployment` is among `holding`."""
    return any(k in holding for k, _ in table.ready(deployment))


def adapter_allowed(key: ApiKey, adapter: str) -> bool:
    """Whether `key` may call `adapter`: a key made for some models calls an adapter only where
    it names it; a key for its base deployment does not reach it, nor one for another adapter."""
    return not key.models or adapter in key.models


def adapter_scoped(table: Table, key: ApiKey, model: str) -> str | None:
    """Why a key scoped to adapters is refused `model` (403), where `model` exists and the key
    was made for adapters; None otherwise (an unknown model, or a key of deployments: 404, as
    ever, the name not confirmed)."""
    adapters = table.adapters.names()
    if not key.models or not any(m in adapters for m in key.models):
        return None
    if table.resolve(model) is None and model not in adapters:
        return None
    allowed = ", ".join(sorted(key.models))
    return f"this key may call {allowed} only, not {shown(model)}; ask for a key that names it"


def model_objects(table: Table, key: ApiKey) -> list[dict[str, Any]]:
    """`/v1/models`: the deployments `key` may call, then the adapters it may call, each with
    the deployment serving it as `parent` (as OpenAI's and vLLM's model objects have it)."""
    data = [model_object(table, name) for name in visible(table, key)]
    for adapter in table.adapters.names():
        held = table.adapters.holders(adapter)
        loaders = table.adapters.loaders(adapter)
        if held is None and loaders is not None:
            held = (loaders[0], frozenset())  # loaded on demand, held by none yet
        if held is None or not adapter_allowed(key, adapter):
            continue
        deployment, holding = held
        ready = sum(1 for k, _ in table.ready(deployment) if k in holding)
        data.append(
            {"id": adapter, "object": "model", "created": 0, "owned_by": "llmgw", "parent": deployment}
            | {"ready_replicas": ready}
        )
    return data


def model_object(table: Table, name: str) -> dict[str, Any]:
    """A deployment as OpenAI's `/v1/models` lists a model."""
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "llmgw",
        "aliases": list(table.aliases(name)),
        "ready_replicas": len(table.ready(name)),
    }


def unserved_by(table: Table, engines: Registry, deployment: str, path: str) -> frozenset[str]:
    """The replicas of `deployment` whose engine does not serve `path`: none for a path
    every engine serves, without looking (the common case, on every request)."""
    if path in BASE_API_PATHS:
        return NONE
    return frozenset(k for k, r in table.of(deployment) if not _serves(engines, r.engine, path))


def unsupported_by(
    table: Table, engines: Registry, deployment: str, path: str, unserved: frozenset[str]
) -> str | None:
    """Why the request is refused (400) where every replica that could take it runs an engine
    that does not serve `path`; None otherwise."""
    if not unserved:
        return None
    candidates = {k for k, _ in [*table.ready(deployment), *table.unknown(deployment)]}
    if not candidates or not candidates <= unserved:
        return None
    names = sorted({r.engine for k, r in table.of(deployment) if k in candidates})
    plural = "s" if len(names) > 1 else ""
    return (
        f"deployment {deployment} runs on engine{plural} {', '.join(names)}, which does not "
        f"serve {path}; it serves {', '.join(_served_paths(engines, names))}"
    )


def _serves(engines: Registry, engine: str, path: str) -> bool:
    """Whether `engine`'s server answers `path`; an engine not named (by an older placement)
    or not known here is sent the request, and answers for itself."""
    paths = engines.api_paths(engine)
    return path in BASE_API_PATHS or paths is None or path in paths


def _served_paths(engines: Registry, names: list[str]) -> list[str]:
    """The routed paths every one of `names` serves."""
    paths = set(ROUTED)
    for engine in names:
        paths &= engines.api_paths(engine) or BASE_API_PATHS
    return sorted(paths)
