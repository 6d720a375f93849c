"""The answers the gateway gives itself: OpenAI's error object (Anthropic's on a stream of
`/v1/messages` broken off), and the handlers of the paths and methods it does not serve."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from .limits import shown
from .surface import ROUTED


def error_body(message: str, kind: str, code: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error, as the official clients parse it; `param`: the body's field at fault."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error(
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


def unplaceable(message: str) -> JSONResponse:
    """The answer for a deployment placement cannot place on any node: at once, and with a
    status the OpenAI and Anthropic SDKs do not retry (they retry 408, 409, 429 and 5xx,
    three tries by default: a 503 held 120 s took 381 s to reach the user). 422: the request
    is well formed, and the model it names cannot be served as the cluster stands; sent again
    unchanged it fails the same way until an operator acts. No `Retry-After`, and
    `x-should-retry: false`, which both SDKs obey."""
    response = error(422, message, "invalid_request_error", "deployment_unplaceable", param="model")
    response.headers["x-should-retry"] = "false"
    return response


def sse_error(message: str, path: str) -> bytes:
    """The end of a stream broken off: an error event, as OpenAI sends one, and `[DONE]`; on
    Anthropic's `/v1/messages`, its `error` event (its clients read no other)."""
    if path == "/v1/messages":
        event = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
    body = error_body(message, "upstream_error", "replica_failed")
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


async def not_found(request: Request, exc: Exception) -> Response:
    paths = ", ".join(["/v1/models", "/v1/models/{model}", *ROUTED])
    return error(
        404,
        f"unknown path {shown(request.url.path)}: the gateway serves {paths}",
        "invalid_request_error",
        "unknown_path",
    )


async def not_allowed(request: Request, exc: Exception) -> Response:
    allow = (getattr(exc, "headers", None) or {}).get("Allow", "")
    response = error(
        405,
        f"method {request.method} is not allowed on {shown(request.url.path)}: use {allow or 'another'}",
        "invalid_request_error",
        "method_not_allowed",
    )
    if allow:
        response.headers["Allow"] = allow
    return response


async def internal(request: Request, exc: Exception) -> Response:
    return error(
        500,
        f"the gateway failed on {shown(request.url.path)}: {type(exc).__name__}; its log says more",
        "server_error",
        "internal_error",
    )
