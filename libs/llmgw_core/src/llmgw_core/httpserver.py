"""A small HTTP/1.1 server on anyio, for the sim engine and the services' APIs.

It speaks just enough HTTP for JSON APIs, Prometheus scrapes and server-sent
events: keep-alive, Content-Length request bodies, fixed or chunked responses.
Bodies are bounded so one bad client cannot exhaust a service's memory.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

MAX_HEAD = 64 * 1024
MAX_BODY = 8 * 1024 * 1024

REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")


@dataclass
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    # When set, the body is streamed with chunked transfer encoding.
    stream: AsyncIterator[bytes] | None = None


def json_response(value: Any, status: int = 200) -> Response:
    return Response(status=status, body=json.dumps(value).encode() + b"\n")


def text_response(text: str, status: int = 200, content_type: str = "text/plain") -> Response:
    return Response(status=status, body=text.encode(), content_type=content_type)


Handler = Callable[[Request], Awaitable[Response]]


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _read_request(stream: BufferedByteReceiveStream) -> Request | None:
    try:
        head = await stream.receive_until(b"\r\n\r\n", MAX_HEAD)
    except (anyio.IncompleteRead, anyio.EndOfStream):
        return None
    except anyio.DelimiterNotFound as exc:
        raise _BadRequest(400, "request head too large") from exc
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, _version = lines[0].split(" ", 2)
    except ValueError as exc:
        raise _BadRequest(400, f"malformed request line {lines[0]!r}") from exc
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0") or "0")
    if length > MAX_BODY:
        raise _BadRequest(413, f"body of {length} bytes exceeds {MAX_BODY}")
    body = await stream.receive_exactly(length) if length else b""
    path, _, query = target.partition("?")
    return Request(method=method.upper(), path=path, query=query, headers=headers, body=body)


async def _write_response(stream: anyio.abc.ByteStream, response: Response, keep_alive: bool) -> None:
    reason = REASONS.get(response.status, "Status")
    head = [f"HTTP/1.1 {response.status} {reason}", f"Content-Type: {response.content_type}"]
    for name, value in response.headers.items():
        head.append(f"{name}: {value}")
    head.append(f"Connection: {'keep-alive' if keep_alive else 'close'}")
    if response.stream is None:
        head.append(f"Content-Length: {len(response.body)}")
        await stream.send(("\r\n".join(head) + "\r\n\r\n").encode() + response.body)
        return
    head.append("Transfer-Encoding: chunked")
    head.append("Cache-Control: no-cache")
    await stream.send(("\r\n".join(head) + "\r\n\r\n").encode())
    async for chunk in response.stream:
        if chunk:
            await stream.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
    await stream.send(b"0\r\n\r\n")


async def _serve_connection(client: anyio.abc.SocketStream, handler: Handler) -> None:
    async with client:
        reader = BufferedByteReceiveStream(client)
        while True:
            try:
                request = await _read_request(reader)
            except _BadRequest as exc:
                await _write_response(client, text_response(str(exc), exc.status), False)
                return
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                return
            if request is None:
                return
            keep_alive = request.headers.get("connection", "").lower() != "close"
            try:
                response = await handler(request)
            except Exception as exc:  # a handler bug answers 500, never kills the server
                response = text_response(f"internal error: {exc}", 500)
            try:
                await _write_response(client, response, keep_alive)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, ConnectionError):
                return
            except Exception:
                # A streaming body failed half-way: the status line is already
                # out, so all that is left is to drop the connection.
                return
            if not keep_alive:
                return


async def serve(
    handler: Handler,
    host: str,
    port: int,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; `tg.start(serve, …)` returns the bound port once listening."""
    listener = await anyio.create_tcp_listener(local_host=host, local_port=port, reuse_port=False)
    async with listener:
        bound = listener.extra(anyio.abc.SocketAttribute.local_port)
        task_status.started(bound)

        async def on_connect(client: anyio.abc.SocketStream) -> None:
            await _serve_connection(client, handler)

        await listener.serve(on_connect)
