"""Demand as every placement hears it: each gateway's latest `Demand`, summed per deployment.

Every placement, leading or standing by, keeps the book (a new leader has the stable
window's history at once, not a window of its own silence). A report is dropped once older
than `stale_intervals` of its own `interval_s` (a gateway that stopped, or was cut off):
what it held is no longer known to be there. Per deployment the book keeps the sum as a
step function of time, one point per change, for the windows `autoscale.follow` averages
over, and when a request was last seen.

The engines' own running and waiting counts (`ShardStatus.load`) are added where they say
more than the gateways: per deployment the larger of the two sums is taken. Every request
an engine runs came through a gateway, so adding both would count it twice; the larger
covers a gateway whose reports are lost or late (its requests still run) and, the other
way, requests a gateway holds that no engine has seen.

Times are this placement's monotonic clock, when a report was heard: gateways' clocks are
never compared with placement's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from llmgw_core.events import Demand, ReplicaRecord, ShardStatus

from .autoscale import Series


@dataclass(frozen=True)
class Summed:
    """One deployment's demand now: in flight and queued over the fresh reports, requests
    arrived in their last intervals, and the engines' running and waiting."""

    in_flight: int = 0
    queued: int = 0
    arrived: int = 0
    engines: int = 0

    @property
    def demand(self) -> float:
        return float(max(self.in_flight + self.queued, self.engines))


@dataclass
class DemandBook:
    started: float
    stale_intervals: float = 3.0
    # Points older than this are dropped (the one in force at the cut is kept).
    history_s: float = 600.0
    reports: dict[str, tuple[Demand, float]] = field(default_factory=dict)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    last_request: dict[str, float] = field(default_factory=dict)
    # The last sums, for the metrics and the page.
    summed: dict[str, Summed] = field(default_factory=dict)
    # When this book first heard a gateway (None: never yet).
    hearing_since: float | None = None

    def heard(self, report: Demand, at: float) -> None:
        self.reports[report.gateway] = (report, at)
        if self.hearing_since is None:
            self.hearing_since = at

    def fresh(self, at: float) -> list[tuple[Demand, float]]:
        """The reports not yet stale, by gateway; stale ones are forgotten."""
        for gateway, (report, heard) in list(self.reports.items()):
            if at - heard > self.stale_intervals * max(report.interval_s, 0.001):
                del self.reports[gateway]
        return [self.reports[g] for g in sorted(self.reports)]

    def sample(self, at: float, engines: dict[str, int]) -> dict[str, Summed]:
        """Sum the fresh reports now, and record each deployment's demand where it changed."""
        sums: dict[str, Summed] = {}
        for report, _ in self.fresh(at):
            for d in report.deployments:
                s = sums.get(d.deployment, Summed())
                sums[d.deployment] = Summed(
                    in_flight=s.in_flight + d.in_flight,
                    queued=s.queued + d.queued,
                    arrived=s.arrived + d.arrived,
                )
        for name, running in engines.items():
            s = sums.get(name, Summed())
            sums[name] = Summed(s.in_flight, s.queued, s.arrived, engines=running)
        for name in set(self.series) | set(sums):
            s = sums.get(name, Summed())
            points = self.series.get(name)
            if points is None:
                # Gateways heard from, none naming it: no demand since the first was heard. A
                # series begun at its first request instead made the stable window average
                # a first burst over itself alone, and a spike of a second asked for the
                # stable window's full count.
                since = self.hearing_since
                points = self.series[name] = [(since, 0.0)] if since is not None and since < at else []
            if not points or points[-1][1] != s.demand:
                points.append((at, s.demand))
            while len(points) > 1 and points[1][0] <= at - self.history_s:
                del points[0]
            if s.demand > 0 or s.arrived > 0:
                self.last_request[name] = at
        self.summed = sums
        return sums

    def history(self, deployment: str) -> Series:
        return tuple(self.series.get(deployment, ()))

    def requested_at(self, deployment: str) -> float:
        """When a request for it was last seen; this placement's start when never (a fresh
        placement grants a full delay before scaling to zero)."""
        return self.last_request.get(deployment, self.started)

    def forget(self, deployments: Iterable[str]) -> None:
        for name in deployments:
            self.series.pop(name, None)
            self.last_request.pop(name, None)

    def quiet(self, record: ReplicaRecord, since: float, at: float) -> bool:
        """Whether every gateway heard from has reported, in a report heard an interval after
        `since` (when the replica began draining), no request in flight on the replica."""
        for report, heard in self.fresh(at):
            # One interval's grace: a report made as the drain was written may predate the
            # gateway's reading of it, and a request it sent since would not be in it.
            if heard <= since + report.interval_s:
                return False
            for d in report.deployments:
                if d.deployment != record.deployment:
                    continue
                for r in d.replicas:
                    if r.in_flight > 0 and r.replica in (
                        record.replica,
                        f"{record.deployment}/{record.replica}",
                    ):
                        return False
        return True


def engine_demand(shard_status: dict[str, ShardStatus]) -> dict[str, int]:
    """Per deployment, the requests its ready engines say they run or queue."""
    out: dict[str, int] = {}
    for status in shard_status.values():
        if status.state != "ready" or status.load is None or not status.deployment:
            continue
        out[status.deployment] = out.get(status.deployment, 0) + status.load.running + status.load.waiting
    return out
