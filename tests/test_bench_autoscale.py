"""The autoscaling benchmark's parts on a small scale: its load generator (`bench.shaped_load`,
a process of its own) against a real sim engine follows a step schedule and an arrival list
and records every answer; the figures and the plot are drawn from what it recorded."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from bench.autoscale import Load, bursty_trace, chat, square_wave, svg
from tests.test_bench_load import serving
from tests.test_gateway_api import sim_engines


def shaped(plan: dict[str, object], path: Path) -> list[list[float]]:
    path.write_text(json.dumps(plan))
    done = subprocess.run(
        [sys.executable, "-m", "bench.shaped_load", str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    records: list[list[float]] = json.loads(done.stdout)["records"]
    return records


def test_the_load_follows_its_steps_and_arrivals_and_the_figures_and_plot_come_from_it(
    tmp_path: Path,
) -> None:
    # 5 tokens at 20 a second: each request about 0.25 s in flight.
    with sim_engines(["--tokens-per-second", "20"]) as (url,):
        serving(url)
        target = f"{url}/v1/chat/completions"
        stepped = shaped(
            {"url": target, "body": chat("tiny"), "steps": [[0, 3], [1.0, 0], [1.5, 1]], "end_s": 2.0},
            tmp_path / "steps.json",
        )
        arrived = shaped(
            {"url": target, "body": chat("tiny"), "arrivals": [0.1, 0.2, 0.2, 0.6]},
            tmp_path / "arrivals.json",
        )
    assert stepped
    assert all(status == 200 for *_, status in stepped), stepped
    assert all(sent <= first <= end for sent, first, end, _ in stepped), stepped
    sent = [r[0] for r in stepped]
    assert not [s for s in sent if 1.05 < s < 1.5], "no client sends while the schedule has none"
    assert [s for s in sent if s >= 1.5], "a client sends again once the schedule has one"
    most = max(sum(1 for s, _, e, _ in stepped if s <= t < e) for t in sent)
    assert most == 3, stepped
    sent_at = sorted(r[0] for r in arrived)
    assert all(0 <= s - at < 0.5 for s, at in zip(sent_at, [0.1, 0.2, 0.2, 0.6], strict=True)), sent_at
    assert all(r[3] == 200 for r in arrived), arrived

    load = Load("wave", 0.0, 2.0, stepped, [(0.0, 2, 1), (1.0, 4, 4), (2.0, 0, 0)])
    assert load.replica_seconds() == 2 * 1.0 + 4 * 1.0
    assert load.failed() == 0
    plot = tmp_path / "wave.svg"
    svg(load, plot)
    drawn = plot.read_text()
    assert drawn.startswith("<svg ")
    assert drawn.rstrip().endswith("</svg>")
    # Demand and replicas (any state, and ready) as lines, queue wait a dot per second.
    assert len(re.findall(r"<polyline ", drawn)) == 3
    assert len(re.findall(r"<circle ", drawn)) == len({int(r[0]) for r in stepped})
    for title in ("Demand: requests in flight", "Replicas", "Queue wait"):
        assert title in drawn

    steps, end = square_wave(40, 20, 25, 3)
    assert end == 135
    assert steps[:3] == [[0, 40], [20, 0], [45, 40]]
    assert bursty_trace(7, 150, 5, 40) == bursty_trace(7, 150, 5, 40) != bursty_trace(8, 150, 5, 40)
    assert max(bursty_trace(7, 150, 5, 40)) < 130, "the last 20 s are quiet"
