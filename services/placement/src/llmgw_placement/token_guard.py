"""The API's token guard: every request but those to public paths shows a token, and only
the API token writes (the read token, and a browser's cookie, only read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from llmgw_core.errors import ConfigError
from llmgw_core.web import json_response

UNAUTHORIZED = {"WWW-Authenticate": 'Bearer realm="llmgw"'}
# The cluster page's cookie: the token a browser opened `/?token=…` with.
COOKIE = "llmgw_token"


class Guarded(Protocol):
    """What the guard asks of the API it guards."""

    @property
    def public(self) -> set[str]:
        """Paths that answer without a token."""
        ...

    def access(self, authorization: str) -> str:
        """`write`, `read` or `none`, from a request's Authorization header."""
        ...

    def refused(self) -> None:
        """A request was refused for its token (counted)."""
        ...


def read_token(path: str, what: str) -> bytes:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"http: {what} {path}: cannot read it: {exc.strerror or exc}") from exc
    if len(token) < 16:
        raise ConfigError(f"http: {what} {path} holds {len(token)} characters; a token needs at least 16")
    return token.encode()


async def no_route(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 404)
    return json_response({"error": f"no route {request.method} {request.url.path}"}, status)


class TokenGuard:
    """Every request but those to `Api.public` paths shows a token; only the API token writes.

    A path's trailing slash is dropped before anything else (`/api/nodes/` is
    `/api/nodes`), as the API always did.
    """

    def __init__(self, app: ASGIApp, api: Guarded) -> None:
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
                self.api.refused()
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)
