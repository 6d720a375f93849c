"""Prometheus metrics for llmgw's services, on prometheus_client.

Every service instance keeps its own `CollectorRegistry` (`new_registry(service)`),
never the library's global one: tests run several services in one process, and
a global registry would refuse their second set of metrics as duplicates.
Each registry carries `llmgw_build_info{service, version} 1`.

Values that a service already keeps as state (how many nodes, whether it
leads, what the bus counted) are read at scrape time by a `Collector` over
that state, rather than copied into gauges on every change; what happens
(a restart, an install, a control step) is counted or timed where it happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import anyio
import anyio.abc
from prometheus_client import CollectorRegistry, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from . import web
from .version import llmgw_version

if TYPE_CHECKING:
    from .bus import Bus

# Buckets for durations from milliseconds (a control step, a decision) to
# minutes (an install, a replica that loads a large model).
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SLOW_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)


def new_registry(service: str) -> CollectorRegistry:
    """A service's own registry, with `llmgw_build_info{service, version} 1` in it."""
    reg = CollectorRegistry(auto_describe=True)
    Info("llmgw_build", "llmgw's version, per service.", registry=reg).info(
        {"service": service, "version": llmgw_version()}
    )
    return reg


class Collect:
    """A collector over state kept elsewhere: `collect` builds its metric families at scrape time."""

    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()

    def describe(self) -> list[Metric]:
        # Nothing to check for duplicates ahead of time: names are built at scrape time.
        return []


def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    """One unlabelled counter family; `name` without `_total` (prometheus_client adds it)."""
    return CounterMetricFamily(name, documentation, value=value)


def bus_metrics(bus: Bus) -> Iterator[Metric]:
    """What every service's bus client counts: messages that did not decode, refusals of the server."""
    yield counter("llmgw_bus_decode_errors", "Messages that did not decode.", sum(bus.decode_errors.values()))
    yield counter(
        "llmgw_bus_permission_denied",
        "Publishes and subscriptions nats-server refused.",
        bus.denied_total,
    )
    yield GaugeMetricFamily(
        "llmgw_bus_store_full",
        "1 while NATS refuses this service's writes for space (its store, a bucket's limit, the disk).",
        value=int(bus.store.full),
    )
    yield counter(
        "llmgw_bus_writes_refused_for_space",
        "Writes NATS refused for space (not stored).",
        bus.store.refused_total,
    )


def add_bus(reg: CollectorRegistry, bus: Bus) -> None:
    reg.register(Collect(lambda: bus_metrics(bus)))


def exposition(reg: Collector, request: Request | None = None) -> Response:
    """The registry as a response, in the format the scraper's Accept header asks for
    (OpenMetrics for a Prometheus that asks for it, else text format 0.0.4)."""
    encode, content_type = choose_encoder(request.headers.get("accept", "") if request else "")
    return Response(encode(reg), headers={"Content-Type": content_type})


def metrics_app(reg: Collector) -> Starlette:
    """`/metrics` alone: what the node agents serve."""

    async def metrics(request: Request) -> Response:
        return exposition(reg, request)

    async def not_found(request: Request, _: Exception) -> Response:
        return PlainTextResponse(f"no route {request.url.path}: see /metrics\n", 404)

    return Starlette(routes=[Route("/metrics", metrics)], exception_handlers={404: not_found})


async def serve_metrics(
    reg: Collector,
    host: str,
    port: int,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """`/metrics` on host:port until cancelled; `tg.start` returns the bound port."""
    await web.serve(metrics_app(reg), host, port, task_status=task_status)
