"""Following demand: the count an autoscaled deployment runs, from its demand over time.

`follow(...)` is pure: no awaits, no bus. Each control step hands it what the autoscaler
remembers of a deployment (`Scaling`), the deployment's bounds, its demand as a step
function of time (requests in flight and queued, summed over the gateways; see `demand.py`),
when a request was last seen, and the step's time; it returns what to remember next and
the change of count, with its reason, when there is one. docs/autoscaling.md says why:

- the count is ceil(demand / target_in_flight), demand averaged over the stable window
  (60 s), time-weighted: a step of load is answered within that window, a spike shorter
  than it barely moves the count;
- when the panic window (6 s) alone asks for `panic_factor` times the count, it decides
  instead, and for a stable window after it last asked the count never goes down (a burst
  is followed at once, and the stable window's memory of the quiet before it cannot pull
  the count back down);
- one step up at most multiplies the count by `max_step_factor` and adds at least one, so
  a misread report cannot take every GPU in one step;
- down only once a lower count has been enough for `scale_down_after_s` without a break,
  to the highest count asked for meanwhile; to zero only after that long without any
  request at all;
- from zero at once, on any request queued, arriving or in flight, to what the panic window
  asks (nothing to double at zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from llmgw_core.events import Autoscale

# A count asked for within this of a whole number is that number (12.0000001 / 4 is 3).
EPSILON = 1e-9

Series = tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Windows:
    stable_s: float = 60.0
    panic_s: float = 6.0
    panic_factor: float = 2.0
    max_step_factor: float = 2.0


@dataclass(frozen=True)
class Scaling:
    """What the autoscaler remembers of one deployment between steps."""

    count: int
    # Panicking until then (monotonic seconds); never down meanwhile.
    panic_until: float = -math.inf
    # Since when a lower count has been enough, and the counts asked for within the last
    # scale_down_after_s (time, count), oldest first.
    below_since: float | None = None
    asked: tuple[tuple[float, int], ...] = ()


@dataclass(frozen=True)
class Change:
    before: int
    after: int
    reason: str


def average(series: Series, start: float, now: float) -> float:
    """The time-weighted mean of a step function over [start, now]. `series` is (since,
    value) points, oldest first, each value in force until the next point; history shorter
    than the window is averaged over what there is (a fresh placement knows no more)."""
    if not series:
        return 0.0
    total = 0.0
    span = 0.0
    for i, (since, value) in enumerate(series):
        until = series[i + 1][0] if i + 1 < len(series) else now
        lo, hi = max(since, start), min(until, now)
        if hi > lo:
            total += value * (hi - lo)
            span += hi - lo
    if span <= 0:
        return series[-1][1]
    return total / span


def start(count: int, bounds: Autoscale) -> Scaling:
    """A new leader starts from the replicas that exist, clamped to the bounds."""
    return Scaling(count=min(max(count, bounds.min_replicas), bounds.max_replicas))


def follow(
    s: Scaling,
    bounds: Autoscale,
    series: Series,
    last_request: float,
    now: float,
    w: Windows,
    *,
    waiting: int = 0,
) -> tuple[Scaling, Change | None]:
    """The next state and the change of count, if any (see the module's docstring).
    `waiting`: requests held or arriving now, for a deployment at zero."""
    target = bounds.target_in_flight
    lo, hi = bounds.min_replicas, bounds.max_replicas
    count = s.count
    stable = average(series, now - w.stable_s, now)
    panic = average(series, now - w.panic_s, now)
    current = series[-1][1] if series else 0.0
    want_stable = _replicas(stable, target)
    want_panic = _replicas(panic, target)
    if count < lo or count > hi:
        after = min(max(count, lo), hi)
        bound = f"min_replicas is {lo}" if count < lo else f"max_replicas is {hi}"
        return Scaling(count=after), Change(count, after, f"scaled {count} → {after}: {bound}")
    if count == 0:
        if waiting <= 0 and current <= 0 and want_panic == 0:
            return replace(s, below_since=None), None
        after = min(max(1, want_panic, _replicas(current, target)), hi)
        if waiting > 0:
            said = f"{waiting} request{'s' if waiting != 1 else ''} waiting"
        else:
            said = f"{max(current, panic):.3g} requests"
        return (
            Scaling(count=after, panic_until=now + w.stable_s),
            Change(0, after, f"scaled 0 → {after}: {said} with no replica, target {target:g}"),
        )
    panic_until = s.panic_until
    if want_panic >= w.panic_factor * count and want_panic > count:
        panic_until = now + w.stable_s
    panicking = now < panic_until
    desired = max(want_panic, want_stable, count) if panicking else want_stable
    desired = min(max(desired, lo), hi)
    if desired > count:
        after = min(desired, max(count + 1, math.floor(count * w.max_step_factor)))
        by_panic = panicking and want_panic > want_stable
        window, mean = (w.panic_s, panic) if by_panic else (w.stable_s, stable)
        reason = (
            f"scaled {count} → {after}: {mean / count:.1f} requests in flight per replica "
            f"over {window:g} s, target {target:g}"
        )
        if after < desired:
            reason += f" (asks for {desired}; one step at most {w.max_step_factor:g}x)"
        return Scaling(count=after, panic_until=panic_until), Change(count, after, reason)
    if desired == count:
        return Scaling(count=count, panic_until=panic_until), None

    # Lower is enough: only after it has been for scale_down_after_s without a break, and then
    # to the most any moment of that delay asked for.
    delay = bounds.scale_down_after_s
    below_since = s.below_since if s.below_since is not None else now
    asked = (*(a for a in s.asked if a[0] >= now - delay), (now, desired))
    held = now - below_since
    kept = Scaling(count=count, panic_until=panic_until, below_since=below_since, asked=asked)
    idle = now - last_request
    # Nothing asked for at all: to zero once no request came for the delay.
    if held < delay and not (desired == 0 and idle >= delay):
        return kept, None
    after = max(d for _, d in asked) if held >= delay else 0
    if after == 0 and idle < delay:
        after = 1  # a request within the delay: one replica stays
    if after >= count:
        return kept, None
    if after == 0:
        reason = f"scaled to 0 after {idle:.0f} s without requests"
    else:
        reason = (
            f"scaled {count} → {after}: {stable / count:.1f} requests in flight per replica "
            f"over {w.stable_s:g} s, target {target:g}, for {held:.0f} s"
        )
    return Scaling(count=after, panic_until=panic_until), Change(count, after, reason)


def _replicas(demand: float, target: float) -> int:
    return max(0, math.ceil(demand / target - EPSILON))
