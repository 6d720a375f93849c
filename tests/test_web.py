"""`llmgw_core.web.serve`: a Starlette app on uvicorn inside a task group, as the services run it."""

from __future__ import annotations

import signal
import socket
from collections.abc import AsyncIterator

import anyio
import anyio.abc
import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from llmgw_core.web import json_response, serve

pytestmark = pytest.mark.anyio


def app(closed: anyio.Event | None = None) -> Starlette:
    async def hello(_: Request) -> Response:
        return json_response({"hello": "world"})

    async def echo(request: Request) -> Response:
        return Response(await request.body())

    async def forever(_: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: tick\n\n"
                    await anyio.sleep(0.05)
            finally:
                if closed is not None:
                    closed.set()

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/", hello), Route("/echo", echo, methods=["POST"]), Route("/forever", forever)],
        max_body_size=16,
    )


def refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def test_serve_reports_the_port_it_bound_and_stops_when_cancelled() -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    closed = anyio.Event()
    server = anyio.CancelScope()

    async def run(*, task_status: anyio.abc.TaskStatus[int]) -> None:
        with server:
            await serve(app(closed), "127.0.0.1", 0, task_status=task_status)

    async with anyio.create_task_group() as tg:
        port = await tg.start(run)
        assert port > 0
        # uvicorn does not take over the signals: the service's own handler decides when to stop.
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert (await client.get("/")).json() == {"hello": "world"}
            assert (await client.post("/echo", content=b"short")).content == b"short"
            r = await client.post("/echo", content=b"x" * 17)
            assert r.status_code == 413
            async with client.stream("GET", "/forever") as stream:
                lines = stream.aiter_lines()
                assert await anext(lines) == "data: tick"
                # Stopped while a stream is open: the stream is cut after the grace, not waited for.
                server.cancel()
                with anyio.fail_after(10):
                    try:
                        async for _ in lines:
                            pass
                    except httpx.HTTPError:
                        pass  # cut off mid-stream: what a client of a stopped engine sees
    assert refused(port), "the listener is closed once serve returns"
    assert closed.is_set(), "the stream's generator was closed with the server, not left ticking"


async def test_a_port_in_use_fails_in_the_caller_with_the_address() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with anyio.create_task_group() as tg:
            with pytest.raises(OSError, match="cannot listen") as err:
                await tg.start(serve, app(), "127.0.0.1", port)
    assert str(err.value) == f"[Errno 98] cannot listen on 127.0.0.1:{port}: Address already in use"
