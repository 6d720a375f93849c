"""What a routed request counts as it goes: its arrival (the metrics and the demand the
autoscaler hears), its place in flight at a replica (the count routing reads), the replica's
status line, its tokens once its answer ends, and the gateway's own refusals."""

from __future__ import annotations

import json

from opentelemetry import trace
from starlette.responses import JSONResponse

from llmgw_core.events import ReplicaRecord

from .budgets import Reservation
from .demand import DemandCounts
from .metrics import Metrics
from .routing import Table
from .usage import Meter, Usage


class Ledger:
    """The counts of the requests in flight, kept by every path a request takes (the express
    lane, the attempts, the relay) in one place, so that each count goes up and down once."""

    __slots__ = ("demand", "metrics", "table", "usage")

    def __init__(self, table: Table, metrics: Metrics, demand: DemandCounts, usage: Usage) -> None:
        self.table = table
        self.metrics = metrics
        self.demand = demand
        self.usage = usage

    def arrived(self, deployment: str) -> None:
        """A request for `deployment` counted: in its metrics and the demand the autoscaler hears."""
        self.metrics.of(deployment).requests.inc()
        self.demand.arrive(deployment)

    def in_flight(self, key: str, record: ReplicaRecord, deployment: str, span: trace.Span) -> None:
        """The request counted in flight at the replica chosen for it."""
        self.table.outstanding[key] += 1
        self.metrics.of(deployment).outstanding.inc()
        span.set_attributes({"llmgw.replica": record.replica, "llmgw.replica_url": record.url})

    def release(self, key: str, deployment: str) -> None:
        outstanding = self.table.outstanding
        outstanding[key] -= 1
        if outstanding[key] <= 0:
            del outstanding[key]
        self.metrics.of(deployment).outstanding.dec()

    def answered(self, span: trace.Span, deployment: str, status: int) -> None:
        """The replica's status line is in."""
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_attributes({"error.type": str(status)})
            span.set_status(trace.StatusCode.ERROR)
            self.metrics.errors.labels(deployment, "upstream_status").inc()

    def refuse(self, span: trace.Span, deployment: str, response: JSONResponse, reason: str) -> JSONResponse:
        """Answer a routed request with the gateway's own error: counted under `reason`, its
        span ended with it."""
        error = json.loads(bytes(response.body))["error"]
        self.metrics.errors.labels(deployment, reason).inc()
        span.set_attributes({"http.response.status_code": response.status_code, "error.type": error["code"]})
        span.set_status(trace.StatusCode.ERROR, error["message"])
        span.end()
        return response

    def done(
        self,
        key: str,
        deployment: str,
        span: trace.Span,
        reservation: Reservation,
        meter: Meter,
        adapter: str = "",
    ) -> None:
        """A replica's answer passed on, whole or not: its replica's count released, its tokens
        recorded and charged (under the LoRA `adapter` it asked for, where it named one), its
        reservation settled, its span ended."""
        self.release(key, deployment)
        self.usage.add(reservation.key.name, adapter or deployment, meter)
        reservation.settle(meter.prompt + meter.completion)
        if meter.prompt:
            span.set_attribute("gen_ai.usage.input_tokens", meter.prompt)
        if meter.completion:
            span.set_attribute("gen_ai.usage.output_tokens", meter.completion)
        span.end()
