"""Placement's metrics: its own registry, the timings it observes, and a collector over its state.

Timed where it happens: each control step, each placement decision, and each
replica's time from created to first ready (deploy→ready). Read at scrape
time from the service's state: leadership, whether it is behind, nodes alive
and lost, replicas by deployment and state, and the counts the service keeps.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, get_args

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from llmgw_core.events import ReplicaRecord, ReplicaState, now
from llmgw_core.metrics import FAST_BUCKETS, SLOW_BUCKETS, Collect, add_bus, counter, new_registry
from llmgw_core.subjects import Names

if TYPE_CHECKING:
    from llmgw_core.bus import Bus

    from .demand import DemandBook
    from .state import ClusterState
    from .view import ClusterView

REPLICA_STATES: tuple[str, ...] = get_args(ReplicaState)
# Replicas whose first ready was observed, kept so that a replica that goes
# degraded and comes back is not timed again. Ids are never reused, so the
# memory is bounded by forgetting the oldest instead.
READY_MEMORY = 65536


class Watched(Protocol):
    """What the metrics read of the placement service at every scrape. A protocol, so that the
    metrics, which the controller and the applier observe into, import no service."""

    @property
    def bus(self) -> Bus: ...
    @property
    def state(self) -> ClusterState: ...
    @property
    def view(self) -> ClusterView: ...
    @property
    def demand(self) -> DemandBook: ...
    @property
    def is_leader(self) -> bool: ...
    @property
    def behind(self) -> bool: ...
    @property
    def stalls(self) -> int: ...
    @property
    def step_failures(self) -> int: ...
    @property
    def invalid_inputs(self) -> int: ...
    def warnings(self) -> list[str]: ...


class PlacementMetrics:
    def __init__(self) -> None:
        self.registry: CollectorRegistry = new_registry("placement")
        self.step_seconds = Histogram(
            "llmgw_placement_step_duration_seconds",
            "Time one control step took (every deployment converged once), failed steps included.",
            buckets=FAST_BUCKETS,
            registry=self.registry,
        )
        self.decision_seconds = Histogram(
            "llmgw_placement_decision_duration_seconds",
            "Time one placement decision took (candidates, choice or refusal).",
            buckets=FAST_BUCKETS,
            registry=self.registry,
        )
        self.deploy_ready_seconds = Histogram(
            "llmgw_placement_deploy_ready_seconds",
            "From a replica's creation to its first ready: placement, install, start, load, health.",
            buckets=SLOW_BUCKETS,
            registry=self.registry,
        )
        self.api_unauthorized = Counter(
            "llmgw_api_unauthorized",
            "API requests refused for their token (401 and 403).",
            registry=self.registry,
        )
        self._ready: OrderedDict[str, None] = OrderedDict()

    def watch(self, service: Watched) -> None:
        """Read the service's state at every scrape."""
        self.registry.register(Collect(lambda: _state(service)))
        add_bus(self.registry, service.bus)

    def replica_ready(self, record: ReplicaRecord) -> None:
        """A replica is ready: time it from its creation, the first time only."""
        key = Names.replica_key(record.deployment, record.replica)
        if key in self._ready:
            return
        self._ready[key] = None
        if len(self._ready) > READY_MEMORY:
            self._ready.popitem(last=False)
        # created_at is the wall clock of whichever placement created it (perhaps before a failover).
        self.deploy_ready_seconds.observe(max(0.0, now() - record.created_at))


def _state(service: Watched) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "llmgw_placement_leader", "1 if this placement holds the lease.", value=int(service.is_leader)
    )
    yield GaugeMetricFamily(
        "llmgw_placement_behind",
        "1 while placement is behind (node deadlines extended).",
        value=int(service.behind),
    )
    yield counter("llmgw_placement_stalls", "Times placement's loop ran over 0.5 s late.", service.stalls)
    yield counter(
        "llmgw_placement_step_failures",
        "Control steps that failed (retried with backoff).",
        service.step_failures,
    )
    yield counter(
        "llmgw_placement_invalid_inputs",
        "Bucket entries placement refused as invalid (sent to the dead-letter subject).",
        service.invalid_inputs,
    )
    yield GaugeMetricFamily(
        "llmgw_placement_warnings",
        "Warnings placement shows now (`/api/warnings`): another placement's server.yaml differs, "
        "or a key's stored value is refused.",
        value=len(service.warnings()),
    )
    view = service.view
    nodes = GaugeMetricFamily(
        "llmgw_placement_nodes",
        "Nodes known, by liveness (what this placement hears, leader or standby).",
        labels=["liveness"],
    )
    at = time.monotonic()
    alive = len(view.liveness.alive_nodes(at) & service.state.nodes.keys())
    nodes.add_metric(["alive"], alive)
    nodes.add_metric(["lost"], len(service.state.nodes) - alive)
    yield nodes
    yield GaugeMetricFamily(
        "llmgw_placement_nodes_claimed_twice",
        "Nodes whose heartbeats two machines (or two agents of one service) send: nothing more "
        "is placed on them.",
        value=len(service.state.claims.contested(at)),
    )
    replicas = GaugeMetricFamily(
        "llmgw_placement_replicas",
        "Replicas by deployment and state (every state of every deployment, 0 included).",
        labels=["deployment", "state"],
    )
    counts: dict[tuple[str, str], int] = {}
    # What this placement holds (an ex-leader: what it held last).
    for r in view.held.replicas.values() if view.held else ():
        counts[(r.deployment, r.state)] = counts.get((r.deployment, r.state), 0) + 1
    for dep in sorted(service.state.deployments.keys() | {d for d, _ in counts}):
        for state in REPLICA_STATES:
            replicas.add_metric([dep, state], counts.get((dep, state), 0))
    yield replicas
    chosen = GaugeMetricFamily(
        "llmgw_placement_autoscale_replicas",
        "The replica count the autoscaler chose, by autoscaled deployment (the leader's; within "
        "its bounds, never written into the deployment).",
        labels=["deployment"],
    )
    for dep, scaling in sorted(view.held.scaling.items()) if view.held else ():
        chosen.add_metric([dep], scaling.count)
    yield chosen
    demand = GaugeMetricFamily(
        "llmgw_placement_demand",
        "Requests in flight and queued by deployment: the gateways' fresh reports summed, or the "
        "engines' running and waiting where larger (every placement, leader or standby).",
        labels=["deployment"],
    )
    for dep, summed in sorted(service.demand.summed.items()):
        demand.add_metric([dep], summed.demand)
    yield demand
