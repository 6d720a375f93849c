"""The autoscaler's decisions without a bus: demand over time in, the count and its reason out.

Each case is a deployment's bounds, its demand as the gateways' sums over time, and the
control steps placement takes (one a second); what it must do is said in the count each
step chose and the words of each change, as `ctl describe` and the events show them."""

from __future__ import annotations

import pytest

from llmgw_core.events import Autoscale, Demand, DeploymentDemand, ReplicaInFlight
from llmgw_core.events import ReplicaRecord as Record
from llmgw_placement.autoscale import Change, Scaling, Windows, average, follow, start
from llmgw_placement.demand import DemandBook

W = Windows(stable_s=60.0, panic_s=6.0)


class Run:
    """A deployment's demand as a step function, and the autoscaler stepped once a second."""

    def __init__(self, bounds: Autoscale, count: int, w: Windows = W) -> None:
        self.bounds = bounds
        self.w = w
        self.s = start(count, bounds)
        self.series: list[tuple[float, float]] = [(0.0, 0.0)]
        self.last_request = 0.0
        self.t = 0.0
        self.changes: list[tuple[float, Change]] = []
        self.counts: list[int] = []

    def demand(self, value: float) -> None:
        self.series.append((self.t, value))

    def run(self, seconds: float, *, waiting: int = 0) -> None:
        end = self.t + seconds
        while self.t < end - 1e-9:
            self.t += 1.0
            if self.series[-1][1] > 0 or waiting:
                self.last_request = self.t
            self.s, change = follow(
                self.s, self.bounds, tuple(self.series), self.last_request, self.t, self.w, waiting=waiting
            )
            self.counts.append(self.s.count)
            if change is not None:
                self.changes.append((self.t, change))

    def said(self) -> list[str]:
        return [c.reason for _, c in self.changes]


def test_the_average_is_weighted_by_time_over_what_was_heard() -> None:
    series = ((0.0, 0.0), (50.0, 12.0))
    assert average(series, 0.0, 60.0) == pytest.approx(2.0)
    assert average(series, 54.0, 60.0) == pytest.approx(12.0)
    # Less history than the window: averaged over what there is.
    assert average(((100.0, 8.0),), 40.0, 110.0) == pytest.approx(8.0)
    assert average((), 0.0, 10.0) == 0.0


def test_a_step_of_load_is_followed_within_the_panic_window_a_step_at_most_doubling() -> None:
    r = Run(Autoscale(min_replicas=1, max_replicas=10, target_in_flight=4, scale_down_after_s=300), 1)
    r.run(120)
    assert r.changes == []
    r.demand(20.0)
    r.run(6)
    # 20 in flight at 4 a replica is 5 replicas: reached within the 6 s panic window, each
    # step said with its window; the stable window alone would take most of a minute.
    assert r.s.count == 5
    assert all(c.after <= 2 * c.before for _, c in r.changes), r.changes
    assert r.said()[0] == "scaled 1 → 2: 6.7 requests in flight per replica over 6 s, target 4"


def test_load_gone_lowers_the_count_only_after_the_delay_and_says_how_long() -> None:
    w = Windows(stable_s=10.0, panic_s=2.0)
    r = Run(Autoscale(min_replicas=1, max_replicas=10, target_in_flight=4, scale_down_after_s=20), 4, w)
    r.demand(16.0)
    r.run(30)
    assert r.changes == []
    r.demand(4.0)
    r.run(20)
    assert r.changes == [], "lower is enough, but not yet for scale_down_after_s"
    r.run(60)
    # Down to the most that any moment of the last 20 s asked for: the stable window's ramp
    # down still asked for 3 when the delay had passed, then 1 once that had held as long.
    assert [(c.before, c.after) for _, c in r.changes] == [(4, 3), (3, 1)]
    assert r.said()[0] == "scaled 4 → 3: 1.0 requests in flight per replica over 10 s, target 4, for 20 s"
    assert r.changes[0][0] >= 30 + 20
    assert r.changes[1][0] - r.changes[0][0] >= 20


def test_a_load_that_holds_steady_does_not_flap() -> None:
    r = Run(Autoscale(min_replicas=1, max_replicas=10, target_in_flight=4, scale_down_after_s=30), 3)
    for i in range(600):
        r.demand(8.0 if i % 2 else 12.0)
        r.run(1)
    assert r.changes == []
    assert set(r.counts) == {3}


def test_a_burst_panics_and_the_count_never_goes_down_while_it_panics() -> None:
    w = Windows(stable_s=30.0, panic_s=3.0)
    r = Run(Autoscale(min_replicas=1, max_replicas=20, target_in_flight=1, scale_down_after_s=0), 1, w)
    r.demand(8.0)
    r.run(4)
    assert r.s.count == 8
    r.demand(0.0)
    r.run(25)
    assert r.s.count == 8, "within a stable window of the last panic the count holds"
    r.run(40)
    assert r.s.count == 1


def test_no_request_for_the_delay_scales_to_zero_and_says_so() -> None:
    r = Run(Autoscale(min_replicas=0, max_replicas=4, target_in_flight=4, scale_down_after_s=300), 1)
    r.demand(2.0)
    r.run(10)
    r.demand(0.0)
    r.run(299)
    assert r.changes == [], "one request within the stable window and the delay keeps a replica"
    r.run(120)
    [(at, change)] = r.changes
    assert (change.before, change.after) == (1, 0)
    assert change.reason == "scaled to 0 after 300 s without requests"
    assert at == 310.0


def test_a_request_at_zero_wakes_the_deployment_at_once() -> None:
    r = Run(Autoscale(min_replicas=0, max_replicas=4, target_in_flight=4, scale_down_after_s=60), 0)
    r.run(30)
    assert r.changes == []
    r.run(1, waiting=1)
    [(_, change)] = r.changes
    assert (change.before, change.after) == (0, 1)
    assert change.reason == "scaled 0 → 1: 1 request waiting with no replica, target 4"
    # A crowd at zero starts what it needs at once: there is nothing to double.
    r = Run(Autoscale(min_replicas=0, max_replicas=4, target_in_flight=4, scale_down_after_s=60), 0)
    r.demand(14.0)
    r.run(1, waiting=14)
    assert r.s.count == 4


def test_bounds_written_anew_move_the_count_into_them_at_once() -> None:
    s, change = follow(
        Scaling(count=5), Autoscale(min_replicas=1, max_replicas=3), ((0.0, 40.0),), 0.0, 1.0, W
    )
    assert (s.count, change) == (3, Change(5, 3, "scaled 5 → 3: max_replicas is 3"))
    s, change = follow(Scaling(count=0), Autoscale(min_replicas=2, max_replicas=3), (), 0.0, 1.0, W)
    assert (s.count, change) == (2, Change(0, 2, "scaled 0 → 2: min_replicas is 2"))
    assert start(7, Autoscale(min_replicas=1, max_replicas=4)).count == 4


def _report(gateway: str, in_flight: int, queued: int = 0, on: str = "") -> Demand:
    replicas = (ReplicaInFlight(replica=on, in_flight=in_flight),) if on else ()
    return Demand(
        gateway=gateway,
        deployments=(
            DeploymentDemand(deployment="chat", in_flight=in_flight, queued=queued, replicas=replicas),
        ),
        interval_s=1.0,
    )


def test_the_book_sums_the_gateways_drops_a_silent_one_and_takes_the_engines_where_larger() -> None:
    book = DemandBook(started=0.0)
    book.heard(_report("gw-a", 3, queued=2), 10.0)
    book.heard(_report("gw-b", 4), 10.5)
    assert book.sample(11.0, {})["chat"].demand == 9.0
    # Engines running more than the gateways report (a gateway's report lost): the larger.
    assert book.sample(11.2, {"chat": 12})["chat"].demand == 12.0
    book.heard(_report("gw-b", 4), 13.0)
    # gw-a silent for over 3 of its intervals: what it held is no longer counted.
    assert book.sample(13.5, {})["chat"].demand == 4.0
    assert book.history("chat")[-1] == (13.5, 4.0)
    assert book.requested_at("chat") == 13.5
    assert book.requested_at("other") == 0.0


def test_a_deployment_first_named_had_no_demand_since_a_gateway_was_first_heard() -> None:
    """Regression: the series began at the first report that named the deployment, so the
    stable window averaged a first burst over itself alone and asked for its full count."""
    book = DemandBook(started=0.0)
    book.heard(Demand(gateway="gw-a", interval_s=1.0), 5.0)
    book.sample(5.0, {})
    assert book.history("chat") == ()
    book.heard(_report("gw-a", 6), 59.0)
    book.sample(59.0, {})
    assert book.history("chat") == ((5.0, 0.0), (59.0, 6.0))
    assert average(book.history("chat"), 0.0, 60.0) == pytest.approx(6 / 55)
    # A new placement whose first report names it knows nothing before: no zero put in.
    fresh = DemandBook(started=0.0)
    fresh.heard(_report("gw-a", 6), 3.0)
    fresh.sample(3.0, {})
    assert fresh.history("chat") == ((3.0, 6.0),)


def test_a_draining_replica_is_quiet_once_every_gateway_reported_it_empty_after_the_drain_began() -> None:
    book = DemandBook(started=0.0)
    record = Record(deployment="chat", replica="r1", profile="tp1", profile_fp="x", state="draining")
    book.heard(_report("gw-a", 0), 10.0)
    book.heard(_report("gw-b", 2, on="r1"), 10.0)
    assert not book.quiet(record, 10.0, 10.2), "no report made since the drain began"
    book.heard(_report("gw-a", 0), 11.5)
    book.heard(_report("gw-b", 1, on="r1"), 11.5)
    assert not book.quiet(record, 10.0, 11.6), "gw-b has a request in flight on it"
    book.heard(_report("gw-b", 0), 12.5)
    assert book.quiet(record, 10.0, 12.6)
