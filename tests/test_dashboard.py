"""The Grafana dashboard and the Prometheus scrape configurations, read as Grafana and
Prometheus would: every metric a panel queries is defined in the services' code (the
gateway's exposed by its own registry), and each scrape target is where `llmgw up` and
compose.yaml serve /metrics."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import generate_latest

from llmgw.auth import API_READ_TOKEN
from llmgw.up import Options, metrics_ports
from llmgw_gateway import Proxy, Table
from llmgw_gateway.connections import Connections
from tests.metrics_support import families

ROOT = Path(__file__).parent.parent
GRAFANA = ROOT / "docs" / "grafana"
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created", "_info")

pytestmark = pytest.mark.anyio


def queried() -> dict[str, set[str]]:
    """Every metric name in the dashboard's expressions, with the panels that query it."""
    dash = json.loads((GRAFANA / "llmgw.json").read_text())
    found: dict[str, set[str]] = {}
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\bllmgw_[a-z0-9_]+", target["expr"]):
                found.setdefault(name, set()).add(panel["title"])
    return found


def defined() -> set[str]:
    """Metric names the code defines: a string literal `llmgw_…` as the first argument (or
    `name=`) of a call, as prometheus_client's constructors, its metric families and
    llmgw's own helpers take it."""
    names: set[str] = set()
    for tree in ("services", "libs", "src"):
        for path in (ROOT / tree).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call):
                    continue
                args = [*node.args[:1], *(k.value for k in node.keywords if k.arg == "name")]
                for arg in args:
                    literal = arg.value if isinstance(arg, ast.Constant) else None
                    if isinstance(literal, str) and re.fullmatch(r"llmgw_[a-z0-9_]+", literal):
                        names.add(literal)
    return names


def base(name: str) -> str:
    """A series' family name (`…_total`, `…_bucket` and the like stripped)."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def test_every_metric_the_dashboard_queries_is_defined_in_the_services_code() -> None:
    code = defined()
    assert "llmgw_gateway_requests" in code
    missing = {
        name: sorted(panels)
        for name, panels in queried().items()
        if name not in code and base(name) not in code
    }
    assert missing == {}, f"the dashboard queries metrics no service defines: {missing}"


async def test_the_gateway_panels_query_what_the_gateway_exposes() -> None:
    """Requests, errors by reason, time to first byte, tokens, in flight per deployment and
    connections: each panel's metric is in the exposition of a gateway's own registry, of
    the type its expression expects."""
    async with httpx.AsyncClient() as client, Proxy(Table(), client) as proxy:
        Connections(8, header_timeout_s=1.0, body_timeout_s=1.0, registry=proxy.metrics.registry)
        exposed = families(generate_latest(proxy.metrics.registry).decode())
    gateway = {name: panels for name, panels in queried().items() if name.startswith("llmgw_gateway_")}
    expected_kinds = {
        "llmgw_gateway_requests_total": "counter",
        "llmgw_gateway_errors_total": "counter",
        "llmgw_gateway_time_to_first_byte_seconds_bucket": "histogram",
        "llmgw_gateway_prompt_tokens_total": "counter",
        "llmgw_gateway_completion_tokens_total": "counter",
        "llmgw_gateway_outstanding_requests": "gauge",
        "llmgw_gateway_connections": "gauge",
    }
    assert set(expected_kinds) <= set(gateway), sorted(gateway)
    for name in gateway:
        family = name if name in exposed else base(name)
        assert family in exposed, f"{name} ({sorted(gateway[name])}) is not exposed by the gateway"
        if name in expected_kinds:
            assert exposed[family] == expected_kinds[name], (name, exposed[family])


def targets(config: dict[str, Any]) -> dict[str, list[str]]:
    return {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }


def test_the_scrape_configuration_for_up_names_ups_ports_and_token() -> None:
    config = yaml.safe_load((GRAFANA / "prometheus-up.yml").read_text())
    options = Options()
    installer, launcher = metrics_ports(options.api_port)
    assert targets(config) == {
        "llmgw-placement": [f"127.0.0.1:{options.api_port}"],
        "llmgw-gateway": [f"127.0.0.1:{options.gateway_port}"],
        "llmgw-installer": [f"127.0.0.1:{installer}"],
        "llmgw-launcher": [f"127.0.0.1:{launcher}"],
    }
    (placement,) = (j for j in config["scrape_configs"] if j["job_name"] == "llmgw-placement")
    # `llmgw up`'s default --data-dir is .llmgw; its auth directory holds the tokens.
    assert placement["authorization"]["credentials_file"] == f".llmgw/auth/{API_READ_TOKEN}"


def test_the_scrape_configuration_for_compose_names_the_services_and_their_ports() -> None:
    config = yaml.safe_load((GRAFANA / "prometheus-compose.yml").read_text())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    agent = yaml.safe_load((ROOT / "examples" / "agent.yaml").read_text())
    server = yaml.safe_load((ROOT / "examples" / "server.yaml").read_text())
    gateway = yaml.safe_load((ROOT / "examples" / "gateway.yaml").read_text())
    found = targets(config)
    assert found == {
        "llmgw-placement": [f"placement:{server['http']['port']}"],
        "llmgw-gateway": [f"gateway:{gateway['http']['port']}"],
        "llmgw-installer": [f"{agent['mgmt_addr']}:{agent['installer_metrics_port']}"],
        "llmgw-launcher": [f"{agent['mgmt_addr']}:{agent['launcher_metrics_port']}"],
    }
    for hosts in found.values():
        for target in hosts:
            assert target.split(":")[0] in compose["services"], target
    (placement,) = (j for j in config["scrape_configs"] if j["job_name"] == "llmgw-placement")
    assert placement["authorization"]["credentials_file"] == f"/auth/{API_READ_TOKEN}"
