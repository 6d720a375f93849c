"""The launcher's Prometheus metrics: its shards by state, restarts, health probes, record
writes, status batches and corrections, weights served, and the bus client's own figures;
served on `launcher_metrics_port` where one is set."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator
from typing import get_args

import anyio
import anyio.abc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw_core.bus import Bus
from llmgw_core.events import ShardState
from llmgw_core.metrics import Collect, add_bus, counter, new_registry, serve_metrics

from .audit import StatusAudit
from .health import HealthProber
from .outbox import StatusOutbox
from .peers import Peers
from .records import RecordWriter
from .runner import ShardRunner

SHARD_STATES: tuple[str, ...] = get_args(ShardState)


class LauncherMetrics:
    """Read from the launcher's members at each scrape; `runners()` is the shards it runs now."""

    def __init__(
        self,
        bus: Bus,
        runners: Callable[[], Collection[ShardRunner]],
        prober: HealthProber,
        writer: RecordWriter,
        outbox: StatusOutbox,
        audit: StatusAudit,
        peers: Peers | None,
    ) -> None:
        self.runners = runners
        self.prober = prober
        self.writer = writer
        self.outbox = outbox
        self.audit = audit
        self.peers = peers
        self.registry = new_registry("launcher")
        self.registry.register(Collect(self.collect))
        add_bus(self.registry, bus)
        self.port = 0  # where they are served, once they are
        # Restarts of shards that are no longer on this node: with those still here, a counter.
        self.restarts_gone = 0

    async def run(
        self, host: str, port: int, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """`/metrics` on host:port until cancelled; started once it listens (a port taken raises)."""
        async with anyio.create_task_group() as tg:
            self.port = await tg.start(serve_metrics, self.registry, host, port)
            task_status.started()

    def collect(self) -> Iterator[Metric]:
        runners = self.runners()
        peers = self.peers
        states: Counter[str] = Counter(r.state for r in runners)
        shards = GaugeMetricFamily(
            "llmgw_launcher_shards",
            "Shards on this node by state (every state, 0 included).",
            labels=["state"],
        )
        for state in SHARD_STATES:
            shards.add_metric([state], states[state])
        yield shards
        yield counter(
            "llmgw_launcher_restarts",
            "Restarts of shards by this launcher (an adopted shard brings the restarts it had).",
            self.restarts_gone + sum(r.restarts for r in runners),
        )
        yield counter("llmgw_launcher_health_probes", "Health probes sent to engines.", self.prober.probes)
        yield counter(
            "llmgw_launcher_health_probe_failures",
            "Health probes that got no 200 in time.",
            self.prober.failures,
        )
        yield counter(
            "llmgw_launcher_health_connections_opened",
            "Connections the health prober opened (kept alive between probes).",
            self.prober.connections_opened,
        )
        yield counter(
            "llmgw_launcher_record_writes",
            "Shard record writes that reached the disk (after coalescing).",
            self.writer.writes,
        )
        yield counter(
            "llmgw_launcher_status_batches",
            "Batches of shard statuses sent to the bus.",
            self.outbox.batches,
        )
        yield counter("llmgw_launcher_statuses", "Shard statuses sent to the bus.", self.outbox.sent)
        yield counter(
            "llmgw_launcher_weights_served_bytes",
            "Bytes of staged weights this node sent to the cluster's other nodes.",
            peers.served_bytes if peers is not None else 0,
        )
        closed = CounterMetricFamily(
            "llmgw_launcher_weights_connections_closed",
            "Connections to the blob server this node closed: evicted (at the cap, the one that had "
            "waited longest for its request), refused (at the cap, every one sending: 503), "
            "timed_out (no whole request within the header timeout).",
            labels=["reason"],
        )
        for reason, n in sorted(peers.closed.items() if peers is not None else ()):
            closed.add_metric([reason], n)
        yield closed
        yield counter(
            "llmgw_launcher_statuses_corrected",
            "Shard statuses in the bucket written again or removed because they were not what this "
            "launcher runs (another machine with this node id wrote them, say).",
            self.audit.corrected,
        )
