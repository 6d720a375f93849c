"""The gateway's HTTP server: llmgw's shared one (`llmgw_core.web`), with a port it cannot
take said as a mistake in its config."""

from __future__ import annotations

import asyncio

import anyio
import anyio.abc
from starlette.types import ASGIApp

from llmgw_core.errors import ConfigError
from llmgw_core.web import bind, serve

__all__ = ["bind", "cors", "serve_app"]


async def serve_app(
    app: ASGIApp,
    host: str,
    port: int,
    *,
    protocol: type[asyncio.Protocol] | None = None,
    backlog: int = 2048,
    reuse_port: bool = False,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on host:port until cancelled; `task_status.started(port)` once bound.
    `protocol`, `backlog` and `reuse_port` as `llmgw_core.web.serve` takes them."""
    try:
        await serve(
            app,
            host,
            port,
            protocol=protocol,
            backlog=backlog,
            reuse_port=reuse_port,
            task_status=task_status,
        )
    except OSError as exc:
        raise ConfigError(
            f"{exc.strerror or exc}; choose another http: port (0 takes a free one) or stop what holds it"
        ) from exc


def cors(app: ASGIApp, origins: tuple[str, ...]) -> ASGIApp:
    """`app`, answering browsers' preflights and letting scripts of `origins` read its answers
    (`http: cors_origins`); `app` itself when there are none. Only the headers a client of
    the API sends are allowed: its key and its body's type."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware(
        app,
        allow_origins=list(origins),
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type", "traceparent"],
        max_age=600,
    )
