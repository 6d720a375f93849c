"""Two reference proxies for the gateway benchmark: what a Python proxy in front of the engine
costs before the gateway's own work, so that the gateway's figure at 1 in flight can be read
against what Python on uvloop allows at all.

- `bare`: an asyncio protocol on uvloop that passes each request's bytes on to the engine over
  a kept-alive connection of its own per client connection and the answer's bytes back,
  framing both by Content-Length alone: no HTTP framework, no keys, no routing.
- `uvicorn`: the gateway's HTTP server (uvicorn with httptools, on uvloop) and its replica
  client (`llmgw_gateway.upstream.Upstream`), with an ASGI app that only forwards the body
  and passes the answer back: the gateway less everything it does per request.

Neither is a product: they are measured, never deployed. Each prints the line the benchmark
waits for (`OpenAI endpoint on http://HOST:PORT/v1`) once it listens.

    python -m bench.floor_proxy {bare,uvicorn} ENGINE_URL
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import uvloop


def _framed(buffer: bytearray) -> int:
    """The length of the first whole message (head and Content-Length body) in `buffer`, or 0."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return 0
    length = 0
    for line in bytes(buffer[:end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    size = end + 4 + length
    return size if len(buffer) >= size else 0


class _Engine(asyncio.Protocol):
    """The kept-alive connection to the engine of one client connection."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.waiting: list[bytes] = []
        self.buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not asyncio's class
        for request in self.waiting:
            self.transport.write(request)
        self.waiting.clear()

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while size := _framed(self.buffer):
            self.client.write(bytes(self.buffer[:size]))
            del self.buffer[:size]

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Client(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.buffer = bytearray()
        self.engine: _Engine | None = None
        self.transport: asyncio.Transport | None = None
        self.connecting: asyncio.Task[Any] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.engine = _Engine(self.transport)
        engine = self.engine
        loop = asyncio.get_running_loop()
        self.connecting = loop.create_task(loop.create_connection(lambda: engine, self.host, self.port))

    def data_received(self, data: bytes) -> None:
        assert self.engine is not None
        self.buffer += data
        while size := _framed(self.buffer):
            request = bytes(self.buffer[:size])
            del self.buffer[:size]
            if self.engine.transport is None:
                self.engine.waiting.append(request)
            else:
                self.engine.transport.write(request)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None and self.engine.transport is not None:
            self.engine.transport.close()


async def _bare(engine: str) -> None:
    parts = urlsplit(engine)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(host, port), "127.0.0.1", 0)
    bound = server.sockets[0].getsockname()[1]
    print(f"OpenAI endpoint on http://127.0.0.1:{bound}/v1", flush=True)
    await server.serve_forever()


async def _uvicorn(engine: str) -> None:
    from llmgw_core.web import serve
    from llmgw_gateway.upstream import Upstream

    upstream = Upstream()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = await upstream.request(
            scope["method"], engine, scope["path"], body, [(b"content-type", b"application/json")]
        )
        data = answer.body() if answer.complete else b"".join([chunk async for chunk in answer.chunks()])
        answer.release()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async with anyio.create_task_group() as tg:
        # The server llmgw's services share (uvicorn, httptools), as the gateway sets it up.
        port = await tg.start(serve, app, "127.0.0.1", 0)
        print(f"OpenAI endpoint on http://127.0.0.1:{port}/v1", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("bare", "uvicorn"))
    parser.add_argument("engine", help="the engine's base URL, http://HOST:PORT")
    args = parser.parse_args()
    uvloop.run(_bare(args.engine) if args.kind == "bare" else _uvicorn(args.engine))


if __name__ == "__main__":
    main()
