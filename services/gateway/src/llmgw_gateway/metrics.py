"""The gateway's own series (requests, errors by reason, time to first byte, requests in
flight and held) and the replicas chosen per deployment, read from the table at scrape time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, Metric

from llmgw_core.metrics import new_registry

from .routing import Table


class DeploymentMetrics(NamedTuple):
    """One deployment's series that every request touches, looked up once: `labels()` takes a
    lock and checks its arguments at each call, four times per request."""

    requests: Counter
    outstanding: Gauge
    ttfb: Histogram


class Metrics:
    def __init__(self) -> None:
        self._of: dict[str, DeploymentMetrics] = {}
        self.registry = new_registry("gateway")
        self.requests = Counter(
            "llmgw_gateway_requests",
            "Completion requests per deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.errors = Counter(
            "llmgw_gateway_errors",
            "Requests the gateway answered with an error, or whose replica failed, by reason class: "
            "bad_request, unauthorized, rate_limited, gateway_starting, unknown_model, no_ready_replica, "
            "unplaceable (placement can place the deployment on no node; answered 422 at once), "
            "unsupported_path (the deployment's engine does not serve the path), "
            "connect (a replica refused, retried elsewhere), "
            "reset (a replica closed the connection before answering, retried elsewhere), "
            "upstream (the replica failed after it had the request), "
            "upstream_stream (a streamed answer broke off: continued on another replica "
            "(llmgw_gateway_continued_total), or else the client got an SSE error event), "
            "upstream_status (the replica answered 5xx), "
            "hold_queue_full (no ready replica, and the deployment's held requests at hold_queue), "
            "gateway_restarting (held when the gateway stopped), client_left (gone while held).",
            ["deployment", "reason"],
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "llmgw_gateway_time_to_first_byte_seconds",
            "From the request's arrival to the replica's first byte of answer.",
            ["deployment"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.outstanding = Gauge(
            "llmgw_gateway_outstanding_requests",
            "Requests in flight per deployment.",
            ["deployment"],
            registry=self.registry,
        )
        self.held = Gauge(
            "llmgw_gateway_held_requests",
            "Requests held per deployment, waiting for a ready replica (hold_queue at most).",
            ["deployment"],
            registry=self.registry,
        )
        self.hold_wait = Histogram(
            "llmgw_gateway_hold_wait_seconds",
            "How long a request was held for a ready replica, by how the wait ended: sent (a replica "
            "became ready), timeout (hold_timeout_s), left (the client went), restarting (the gateway "
            "stopped).",
            ["deployment", "outcome"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
            registry=self.registry,
        )

        self.continued = Counter(
            "llmgw_gateway_continued",
            "Answers a replica broke off or handed over, continued on another replica of the same "
            "profile, by cause: connection_lost (the replica closed or reset the connection "
            "mid-answer), error_event (it sent an error event mid-stream), timeout (it sent nothing "
            "for the read timeout), drained (it began draining: the stream was handed over).",
            ["deployment", "cause"],
            registry=self.registry,
        )
        self.seam = Histogram(
            "llmgw_gateway_continuation_seam_seconds",
            "From a replica's break (or the start of its drain) to the continuing replica's first "
            "event passed on to the client.",
            ["deployment"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )

    def of(self, deployment: str) -> DeploymentMetrics:
        found = self._of.get(deployment)
        if found is None:
            found = self._of[deployment] = DeploymentMetrics(
                self.requests.labels(deployment),
                self.outstanding.labels(deployment),
                self.ttfb.labels(deployment),
            )
        return found


def routed(table: Table) -> Iterator[Metric]:
    """The replicas chosen per deployment, by what chose them. Read from the table's counts at
    scrape time: nothing added to a request's path."""
    family = CounterMetricFamily(
        "llmgw_gateway_routed",
        "Replicas chosen per deployment, by what chose them: engine (the replica whose engine "
        "says it holds the prompt's leading token blocks, within the load bound) or prefix (the "
        "replica the prompt's leading blocks were last sent to, within the load bound) or load "
        "(least outstanding requests: none within the bound, no lead, or one replica with room for "
        "a new one) or hash (a "
        "lead none holds, among the least busy with room). A retry counts again.",
        labels=["deployment", "how"],
    )
    for (deployment, how), n in sorted(table.routed.items()):
        family.add_metric([deployment, how], n)
    yield family
