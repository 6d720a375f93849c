"""A request body the sim reads: one JSON object."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request


async def json_object(req: Request) -> dict[str, Any] | str:
    """The request's body as a JSON object, or why it is not one (an empty body is none)."""
    try:
        body = json.loads(await req.body() or b"null")
    except ValueError as exc:
        return f"invalid JSON body: {exc}"
    if not isinstance(body, dict):
        return "body must be a JSON object"
    return body
