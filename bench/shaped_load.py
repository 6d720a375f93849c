"""A load generator whose load changes over time, for HTTP/1.1 servers on loopback: either a
number of clients in flight that steps up and down (each sends one request after another while
the schedule has room for it), or requests that arrive at given times whatever is in flight.
Prints, as JSON, when it started (the wall clock) and every request's send, first byte, end
(seconds from the start) and status.

Run as its own process (`python -m bench.shaped_load PLAN`), apart from the servers it loads,
as `bench.load` is. PLAN is a JSON file: `{"url", "body", "timeout_s",
"steps": [[at_s, clients], …], "end_s"}` or `{"url", "body", "timeout_s", "arrivals": [at_s, …]}`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench.load import BadAnswer, read_answer, request_bytes


def clients_at(steps: list[list[float]], t: float) -> int:
    """How many clients the schedule `steps` ([[at_s, clients], …], sorted) has at `t`."""
    n = 0
    for at, clients in steps:
        if at > t:
            break
        n = int(clients)
    return n


async def _read_whole(reader: asyncio.StreamReader) -> tuple[int, float]:
    """The status of one answer and when its first byte came (perf_counter); its body read whole."""
    first = await reader.read(1)
    at = time.perf_counter()
    if not first:
        raise BadAnswer("connection closed before any answer")
    status, _ = await read_answer(reader, first, until_close=True)
    return status, at


async def _one(host: str, port: int, request: bytes, timeout_s: float, start: float) -> list[float]:
    """[sent, first byte, end, status] of one request on a connection of its own (status -1: no
    answer: refused, cut off or past `timeout_s`)."""
    sent = time.perf_counter()
    first = -1.0
    status = -1
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        writer.write(request)
        status, at = await asyncio.wait_for(_read_whole(reader), timeout_s)
        first = at - start
    except (BadAnswer, OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        status = -1
    finally:
        if writer is not None:
            writer.close()
    return [sent - start, first, time.perf_counter() - start, float(status)]


async def drive(plan: dict[str, Any]) -> dict[str, Any]:
    parts = urlsplit(plan["url"])
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = request_bytes(plan["url"], plan["body"].encode(), plan.get("token", ""))
    request = request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    timeout_s = float(plan.get("timeout_s", 180))
    records: list[list[float]] = []
    wall = time.time()
    start = time.perf_counter()

    async def at(t: float) -> None:
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    if "arrivals" in plan:

        async def arrival(t: float) -> None:
            await at(t)
            records.append(await _one(host, port, request, timeout_s, start))

        await asyncio.gather(*(arrival(t) for t in plan["arrivals"]))
    else:
        steps = sorted(plan["steps"])
        end_s = float(plan["end_s"])
        most = max(int(c) for _, c in steps)

        async def client(i: int) -> None:
            # Client i sends while the schedule has more than i clients; it waits for its turn
            # in 10 ms ticks, so a step up is followed within 10 ms.
            while (now := time.perf_counter() - start) < end_s:
                if clients_at(steps, now) > i:
                    records.append(await _one(host, port, request, timeout_s, start))
                else:
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(client(i) for i in range(most)))
    return {"started_at": wall, "records": sorted(records)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m bench.shaped_load PLAN.json", file=sys.stderr)
        return 2
    json.dump(asyncio.run(drive(json.loads(Path(args[0]).read_text()))), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
