"""A load generator for HTTP/1.1 servers on loopback: N kept-alive connections, each sending one
request after another for a fixed time; prints the latencies and the count as JSON.

Run as its own process (`python -m bench.load`), apart from the servers it measures, so that
its CPU is not theirs. Plain asyncio streams, not an HTTP client library: at 1 in flight a
library's own per-request work would be part of every side's figure, and at 32 in flight a
client that saturates its core first would cap direct and gateway alike, hiding the difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit


class BadAnswer(Exception):
    pass


def request_bytes(url: str, body: bytes, token: str) -> bytes:
    """A POST of `body` (JSON) to `url`, kept alive, with `token` as its bearer key."""
    parts = urlsplit(url)
    head = [
        f"POST {parts.path} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    if token:
        head.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_answer(
    reader: asyncio.StreamReader, first: bytes = b"", *, until_close: bool = False
) -> tuple[int, bool]:
    """One answer's status and whether the server keeps the connection; its body read whole
    (by Content-Length or chunked). `first`: its bytes already read; `until_close`: an answer
    with neither is read to the close (else BadAnswer)."""
    head = first + await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif until_close:
        await reader.read()
    else:
        raise BadAnswer(f"status {status}: neither Content-Length nor chunked")
    return status, headers.get("connection", "").lower() != "close"


class _Run:
    """What the connections share: the measuring window, opened once every one is warm."""

    def __init__(self, concurrency: int, duration_s: float) -> None:
        self.waiting = concurrency
        self.duration_s = duration_s
        self.go = asyncio.Event()
        self.start = self.end = 0.0
        self.latencies: list[float] = []
        self.done = 0
        self.errors = 0

    async def ready(self) -> None:
        self.waiting -= 1
        if self.waiting == 0:
            self.start = time.perf_counter()
            self.end = self.start + self.duration_s
            self.go.set()
        await self.go.wait()


async def _connection(host: str, port: int, request: bytes, run: _Run) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        # One answer before the clock starts: the connection is open and every server warm.
        writer.write(request)
        await read_answer(reader)
        await run.ready()
        while True:
            sent = time.perf_counter()
            if sent >= run.end:
                return
            writer.write(request)
            try:
                status, keep = await asyncio.wait_for(read_answer(reader), 60)
            except (BadAnswer, asyncio.IncompleteReadError, TimeoutError, ConnectionError):
                run.errors += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            if status != 200:
                run.errors += 1
            else:
                run.latencies.append(time.perf_counter() - sent)
                run.done += 1
            if not keep:
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
    finally:
        writer.close()


async def measure(
    url: str, body: bytes, token: str, concurrency: int, duration_s: float
) -> dict[str, object]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = request_bytes(url, body, token)
    run = _Run(concurrency, duration_s)
    await asyncio.gather(*(_connection(host, port, request, run) for _ in range(concurrency)))
    elapsed = time.perf_counter() - run.start
    return {"latencies_s": run.latencies, "done": run.done, "errors": run.errors, "elapsed_s": elapsed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("url", help="http://host:port/path to POST to")
    parser.add_argument("--body", required=True, help="file holding the JSON body")
    parser.add_argument("--token", default="", help="bearer key")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=2.0, help="seconds to measure")
    args = parser.parse_args(argv)
    result = asyncio.run(
        measure(args.url, Path(args.body).read_bytes(), args.token, args.concurrency, args.duration)
    )
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
