"""Every service of a real cluster (`llmgw up`) serves Prometheus metrics worth scraping,
and the Grafana dashboard asks only for metrics that some service exposes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmgw.auth import AuthDir
from tests.cluster_support import up_engine_ports
from tests.metrics_support import families, samples, value
from tests.test_sim_engine import free_port
from tests.test_up import printed_key
from tests.waiting import eventually

ROOT = Path(__file__).parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "llmgw.json"

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


def dashboard_metrics() -> set[str]:
    """Every metric name in the dashboard's expressions."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    return {name for e in exprs for name in re.findall(r"\bllmgw_[a-z0-9_]+", e)}


def test_the_dashboard_reads_only_metrics_whose_names_prometheus_accepts() -> None:
    names = dashboard_metrics()
    # What the issue asks the dashboard to show, at least.
    for wanted in (
        "llmgw_placement_step_duration_seconds_bucket",
        "llmgw_placement_decision_duration_seconds_bucket",
        "llmgw_placement_deploy_ready_seconds_bucket",
        "llmgw_placement_nodes",
        "llmgw_placement_replicas",
        "llmgw_launcher_restarts_total",
        "llmgw_installer_install_duration_seconds_bucket",
    ):
        assert wanted in names


@pytest.fixture
def llmgw_up(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, Path]]:
    """`llmgw up` in its own process group, stopped with Ctrl-C at the end (killed if that fails)."""
    data = tmp_path / "cluster"
    out = tmp_path / "up.log"
    argv = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "up"]
    argv += ["--data-dir", str(data), "--port", str(free_port()), "--api-port", str(free_port())]
    argv += up_engine_ports()
    with out.open("wb") as log:
        proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        yield proc, data, out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


async def test_every_service_of_a_cluster_serves_its_metrics_and_the_dashboard_finds_them(
    llmgw_up: tuple[subprocess.Popen[bytes], Path, Path],
) -> None:
    proc, data, out = llmgw_up

    def metrics_urls() -> dict[str, str]:
        text = out.read_text(errors="replace")
        assert proc.poll() is None, text
        m = re.search(
            r"metrics: placement (\S+) \(with the API token\), the gateway (\S+), "
            r"local-1 installer (\S+), local-1 launcher (\S+)$",
            text,
            re.M,
        )
        assert m, text[-2000:]
        return dict(zip(("placement", "gateway", "installer", "launcher"), m.groups(), strict=True))

    urls = await eventually(metrics_urls, timeout=240, interval=0.5)
    # The line comes once the deployment's replica is ready.
    assert "deployment chat is ready (replica r0" in out.read_text()
    token = AuthDir(data / "auth").token(read_only=True)

    async with httpx.AsyncClient(timeout=10) as client:

        async def scrape(service: str) -> str:
            # Placement's behind its API token; the gateway's behind a client key (its labels
            # name every deployment): `up`'s key `default`, as it printed it.
            headers = {"Authorization": f"Bearer {token}"} if service == "placement" else {}
            if service == "gateway":
                headers = printed_key(out.read_text())
            r = await client.get(urls[service], headers=headers)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
            return r.text

        texts = {service: await scrape(service) for service in urls}
        # Placement's metrics are behind its token; a refusal is counted.
        assert (await client.get(urls["placement"])).status_code == 401
        refused = await scrape("placement")

    for service, text in texts.items():
        # Prometheus' own parser reads it all, and every service says what it runs.
        list(text_string_to_metric_families(text))
        build = [s for s in samples(text) if s.name == "llmgw_build_info"]
        assert [(s.labels["service"], s.value) for s in build] == [(service, 1)]
        assert build[0].labels["version"]

    placement = texts["placement"]
    kinds = families(placement)
    for histogram in (
        "llmgw_placement_step_duration_seconds",
        "llmgw_placement_decision_duration_seconds",
        "llmgw_placement_deploy_ready_seconds",
    ):
        assert kinds[histogram] == "histogram", histogram
    # One replica went ready: its time from creation to ready was observed, once, and it
    # took the sim engine's load time at least (it loads for 1 s).
    assert value(placement, "llmgw_placement_deploy_ready_seconds_count") == 1
    assert value(placement, "llmgw_placement_deploy_ready_seconds_sum") >= 1.0
    assert value(placement, "llmgw_placement_decision_duration_seconds_count") >= 1
    assert value(placement, "llmgw_placement_step_duration_seconds_count") >= 1
    assert value(placement, "llmgw_placement_replicas", deployment="chat", state="ready") == 1
    assert value(placement, "llmgw_placement_replicas", deployment="chat", state="failed") == 0
    assert value(placement, "llmgw_placement_nodes", liveness="alive") == 1
    assert value(placement, "llmgw_placement_nodes", liveness="lost") == 0
    assert value(placement, "llmgw_placement_leader") == 1
    for counter in ("llmgw_placement_stalls", "llmgw_placement_step_failures", "llmgw_api_unauthorized"):
        assert kinds[counter] == "counter", counter
    assert value(placement, "llmgw_api_unauthorized_total") == 0
    assert value(refused, "llmgw_api_unauthorized_total") == 1

    installer = texts["installer"]
    assert families(installer)["llmgw_installer_install_duration_seconds"] == "histogram"
    assert value(installer, "llmgw_installer_engine_up", engine="sim") == 1
    launcher = texts["launcher"]
    assert families(launcher)["llmgw_launcher_restarts"] == "counter"
    assert value(launcher, "llmgw_launcher_shards", state="ready") == 1

    # Every metric the dashboard asks for is exposed by some service.
    exposed = {s.name for text in texts.values() for s in samples(text)}
    # A family with no samples yet (no install happened here) still names its series.
    suffixes = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "info": ("_info",)}
    for text in texts.values():
        for name, kind in families(text).items():
            exposed |= {name + suffix for suffix in suffixes.get(kind, ("",))}
    missing = sorted(dashboard_metrics() - exposed)
    assert missing == [], f"the dashboard asks for metrics no service exposes: {missing}"
