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

A report is read as a hostile gateway identity could write it (`bounded`): its interval is
clamped to what a gateway's own config allows (`demand_interval_s`, at most 60 s; a report of
`interval_s: 1e9` held its demand for ever, one of NaN too), each count to `COUNT_MAX`, and a
deployment named twice, or by no name a deployment can have, is dropped; a report names at
most `DEPLOYMENTS_MAX` deployments and `REPLICAS_MAX` replicas of each, and at most
`GATEWAYS_MAX` gateways are heard at once. What was clamped is logged, once a minute per gateway.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from llmgw_core.events import Demand, DeploymentDemand, ReplicaRecord, ShardStatus
from llmgw_core.limits import DEMAND_INTERVAL_MAX_S, NAME_MAX, TOKEN_MAX, TOKEN_PATTERN

from .autoscale import Series

log = logging.getLogger("llmgw.placement")

# Below this, an interval is taken as this (the report is still dropped within milliseconds).
INTERVAL_MIN_S = 0.001
# Requests one gateway may hold in flight, queued or arrived in one interval for one deployment:
# far above what a gateway's connections allow, low enough that sums stay exact in a float.
COUNT_MAX = 1_000_000
DEPLOYMENTS_MAX = 4096
# Replicas with requests in flight, per deployment (placement's `max_replicas` ceiling is larger,
# but a gateway reports only those it has requests on).
REPLICAS_MAX = 10_000
GATEWAYS_MAX = 4096
# How often one gateway's clamped reports are logged.
SAID_EVERY_S = 60.0
_NAME = re.compile(TOKEN_PATTERN)


def bounded(report: Demand) -> tuple[Demand, list[str]]:
    """`report` with every number and count within its bounds (see the module's docstring), and
    what was changed, one phrase each; the report itself when nothing was."""
    said: list[str] = []
    interval = report.interval_s
    if not math.isfinite(interval) or interval > DEMAND_INTERVAL_MAX_S:
        said.append(f"interval_s {interval:g} taken as {DEMAND_INTERVAL_MAX_S:g}")
        interval = DEMAND_INTERVAL_MAX_S
    elif interval < INTERVAL_MIN_S:
        said.append(f"interval_s {interval:g} taken as {INTERVAL_MIN_S:g}")
        interval = INTERVAL_MIN_S
    rows: list[DeploymentDemand] = []
    seen: set[str] = set()
    for d in report.deployments:
        if len(rows) == DEPLOYMENTS_MAX:
            said.append(
                f"{len(report.deployments) - DEPLOYMENTS_MAX} deployments over {DEPLOYMENTS_MAX} dropped"
            )
            break
        name = d.deployment
        if len(name) > NAME_MAX or not _NAME.match(name) or name in seen:
            said.append(f"deployment {name[:NAME_MAX]!r} dropped (no deployment's name, or named twice)")
            continue
        seen.add(name)
        counts = {k: getattr(d, k) for k in ("in_flight", "queued", "arrived")}
        over = {k: v for k, v in counts.items() if v > COUNT_MAX}
        replicas = tuple(r for r in d.replicas if len(r.replica) <= TOKEN_MAX + NAME_MAX + 1)
        if len(replicas) > REPLICAS_MAX:
            replicas = replicas[:REPLICAS_MAX]
        replicas = tuple(
            msgspec.structs.replace(r, in_flight=COUNT_MAX) if r.in_flight > COUNT_MAX else r
            for r in replicas
        )
        if over:
            said.append(
                f"{name}: " + ", ".join(f"{k} {v} taken as {COUNT_MAX}" for k, v in sorted(over.items()))
            )
        if replicas != d.replicas:
            said.append(f"{name}: replicas bounded ({len(d.replicas)} named)")
        if over or replicas != d.replicas:
            d = msgspec.structs.replace(d, **{k: COUNT_MAX for k in over}, replicas=replicas)
        rows.append(d)
    if not said:
        return report, said
    return msgspec.structs.replace(report, interval_s=interval, deployments=tuple(rows)), said


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
    # When each gateway's bounded report was last logged ("": a gateway not heard for GATEWAYS_MAX).
    _said: dict[str, float] = field(default_factory=dict, init=False, repr=False)

    def heard(self, report: Demand, at: float) -> bool:
        """Keep `report`, bounded (`bounded`), as its gateway's latest; False when it is not kept
        (GATEWAYS_MAX other gateways are heard now)."""
        report, said = bounded(report)
        gateway = report.gateway
        if gateway not in self.reports and len(self.reports) >= GATEWAYS_MAX:
            self.fresh(at)
            if len(self.reports) >= GATEWAYS_MAX:
                if at - self._said.get("", -math.inf) >= SAID_EVERY_S:
                    self._said[""] = at
                    log.warning(
                        "demand report of gateway %s not heard: %d gateways are heard already",
                        gateway,
                        GATEWAYS_MAX,
                    )
                return False
        if said and at - self._said.get(gateway, -math.inf) >= SAID_EVERY_S:
            self._said[gateway] = at
            log.warning("demand report of gateway %s bounded: %s", gateway, "; ".join(said[:8]))
        self.reports[gateway] = (report, at)
        if self.hearing_since is None:
            self.hearing_since = at
        return True

    def fresh(self, at: float) -> list[tuple[Demand, float]]:
        """The reports not yet stale, by gateway; stale ones are forgotten."""
        for gateway, (report, heard) in list(self.reports.items()):
            if at - heard > self.stale_intervals * report.interval_s:
                del self.reports[gateway]
                self._said.pop(gateway, None)
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
