"""Prometheus text exposition for the services, served on the small HTTP server."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import anyio
import anyio.abc

from .httpserver import Request, Response, serve, text_response


@dataclass(frozen=True)
class Sample:
    name: str
    kind: str  # "gauge" | "counter"
    help: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(samples: Iterable[Sample]) -> str:
    lines: list[str] = []
    seen: set[str] = set()
    for s in samples:
        if s.name not in seen:
            seen.add(s.name)
            lines.append(f"# HELP {s.name} {s.help}")
            lines.append(f"# TYPE {s.name} {s.kind}")
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
        value = int(s.value) if float(s.value).is_integer() else s.value
        lines.append(f"{s.name}{{{labels}}} {value}" if labels else f"{s.name} {value}")
    return "\n".join(lines) + "\n"


async def serve_metrics(
    collect: Callable[[], Iterable[Sample]],
    host: str,
    port: int,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """`/metrics` on host:port until cancelled; `tg.start` returns the bound port."""

    async def handle(req: Request) -> Response:
        if req.path == "/metrics":
            return text_response(render(collect()), content_type="text/plain; version=0.0.4")
        return text_response("see /metrics\n", 404)

    await serve(handle, host, port, task_status=task_status)
