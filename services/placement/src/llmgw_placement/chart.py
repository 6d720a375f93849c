"""A deployment's recent demand and replica count as a small inline SVG, for the page.

`demand_chart(...)` is pure: the two step functions placement already keeps (the gateways'
demand summed, `demand.DemandBook`; the count the autoscaler chose, `Held.counts`), the
time now, and out comes the markup. Time is cut in buckets of `bucket_s` and each bucket
drawn at the most it held (a burst shorter than a bucket still shows), and the buckets are
aligned on the clock: between two bucket ends only the last bucket can change, so the
page's stream of changed parts sends the chart again when something happened, or once a
bucket, not on every look.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SPAN_S = 300.0
BUCKET_S = 5.0
WIDTH = 300
HEIGHT = 60

Series = Sequence[tuple[float, float]]


def peaks(series: Series, starts: Sequence[float], bucket_s: float, now: float) -> list[float | None]:
    """The most the step function `series` ((since, value) points, oldest first, each in
    force until the next) held in each bucket [start, start + bucket_s), up to `now`; None
    for a bucket wholly before its first point or after `now` (nothing known there)."""
    out: list[float | None] = []
    for lo in starts:
        hi = min(lo + bucket_s, now)
        if not series or hi <= series[0][0] or lo > now:
            out.append(None)
            continue
        most: float | None = None
        for i, (since, value) in enumerate(series):
            until = series[i + 1][0] if i + 1 < len(series) else math.inf
            if since < hi and until > lo:
                most = value if most is None else max(most, value)
        out.append(most)
    return out


def _line(values: list[float | None], top: float, cls: str) -> str:
    """A stepped polyline through the known buckets (a gap where one is unknown): each value a
    flat segment across its buckets, the same value in a row one segment."""
    step = WIDTH / len(values)
    runs: list[list[tuple[int, int, float]]] = [[]]
    for i, v in enumerate(values):
        if v is None:
            if runs[-1]:
                runs.append([])
            continue
        y = HEIGHT - 1 - (HEIGHT - 2) * v / top
        run = runs[-1]
        if run and run[-1][2] == y:
            run[-1] = (run[-1][0], i + 1, y)
        else:
            run.append((i, i + 1, y))
    return "".join(
        "<polyline class={} points='{}' fill=none />".format(
            cls, " ".join(f"{a * step:.1f},{y:.1f} {b * step:.1f},{y:.1f}" for a, b, y in run)
        )
        for run in runs
        if run
    )


def _n(value: float) -> str:
    return f"{value:g}"


def demand_chart(
    demand: Series,
    counts: Series,
    now: float,
    *,
    span_s: float = SPAN_S,
    bucket_s: float = BUCKET_S,
) -> str:
    """The chart's markup: an `<svg>` with the demand (requests in flight and queued, summed
    over the gateways) and the replicas chosen, each bucket at its most, over the last
    `span_s`, and a line that says the numbers now and at their most."""
    n = max(1, round(span_s / bucket_s))
    end = (math.floor(now / bucket_s) + 1) * bucket_s
    starts = [end - (n - i) * bucket_s for i in range(n)]
    wanted = peaks(demand, starts, bucket_s, now)
    chosen = peaks(counts, starts, bucket_s, now)
    known = [v for v in (*wanted, *chosen) if v is not None]
    top = max([1.0, *known])
    demand_now = demand[-1][1] if demand else 0.0
    count_now = counts[-1][1] if counts else None
    demand_peak = max((v for v in wanted if v is not None), default=0.0)
    minutes = f"{span_s / 60:g} min"
    wants = f"demand now {_n(demand_now)}, at most {_n(demand_peak)} in the last {minutes}"
    runs = ""
    if count_now is not None:
        count_peak = max((v for v in chosen if v is not None), default=count_now)
        runs = f"replicas {_n(count_now)}, at most {_n(count_peak)}"
    said = f"{wants} · {runs}" if runs else wants
    return (
        f"<figure id=dep-chart data-demand='{_n(demand_now)}' data-replicas='"
        f"{'' if count_now is None else _n(count_now)}'>"
        f"<svg viewBox='0 0 {WIDTH} {HEIGHT}' width={WIDTH} height={HEIGHT} role=img "
        f"aria-label='demand and replicas over the last {minutes}'>"
        f"<title>{said}</title>"
        f"<line x1=0 y1={HEIGHT - 1} x2={WIDTH} y2={HEIGHT - 1} class=axis />"
        + _line(wanted, top, "demand")
        + _line(chosen, top, "replicas")
        + "</svg>"
        f"<figcaption><span class=demand>■</span> {wants}"
        + (f" <span class=replicas>■</span> {runs}" if runs else "")
        + f" (scale 0 to {_n(top)})</figcaption></figure>"
    )
