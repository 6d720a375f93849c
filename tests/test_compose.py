"""compose.yaml as Docker Compose reads it (no engine here: the file itself): every
service that runs llmgw builds its image and never pulls it, and the trace collector is
Jaeger v2 on its own config, reachable where the services send their traces."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parent.parent


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def entry_points() -> set[str]:
    """The commands llmgw's packages install (`llmgw`, `llmgw-placement`, …)."""
    found: set[str] = set()
    for path in [ROOT / "pyproject.toml", *sorted((ROOT / "services").glob("*/pyproject.toml"))]:
        found |= set(tomllib.loads(path.read_text())["project"].get("scripts", {}))
    return found


def test_every_llmgw_service_builds_its_image_and_never_pulls_it() -> None:
    """Regression: only `auth` had `build:`; `docker compose pull` or `up --build` could try
    to pull `llmgw:latest` from a registry for the others."""
    services = compose()["services"]
    commands = entry_points()
    ours = {
        name
        for name, service in services.items()
        if "LLMGW_IMAGE" in str(service.get("image", "")) or service.get("command", [""])[0] in commands
    }
    assert ours == {"auth", "placement", "launcher", "installer", "gateway"}
    for name in sorted(ours):
        service = services[name]
        assert service.get("pull_policy") == "build", f"{name}: pull_policy {service.get('pull_policy')!r}"
        build = service.get("build")
        assert isinstance(build, dict), f"{name} has no build:"
        assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).is_file(), name
        assert "BASE_IMAGE" in build.get("args", {}), name
        assert service["image"] == services["auth"]["image"], name
    # Images llmgw does not build are pulled, as they should be: no build, no pull_policy.
    for name in sorted(set(services) - ours):
        assert "build" not in services[name], name
        assert services[name].get("pull_policy") != "build", name


def test_jaeger_is_v2_on_its_config_where_the_services_send_traces() -> None:
    services = compose()["services"]
    jaeger = services["jaeger"]
    m = re.fullmatch(r"\$\{JAEGER_IMAGE:-([^:}]+):(\d+)\.(\d+)\.(\d+)\}", jaeger["image"])
    assert m, jaeger["image"]
    assert m.group(1) == "jaegertracing/jaeger"
    assert int(m.group(2)) == 2
    assert "environment" not in jaeger  # v1's COLLECTOR_OTLP_ENABLED is gone
    # The config given on the command line is the file mounted there.
    [flag, path] = jaeger["command"]
    assert flag == "--config"
    [mount] = [v for v in jaeger["volumes"] if v.split(":")[1] == path]
    source = ROOT / mount.split(":")[0]
    config = yaml.safe_load(source.read_text())

    pipeline = config["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"]
    assert set(pipeline["exporters"]) <= set(config["exporters"])
    storage = config["exporters"]["jaeger_storage_exporter"]["trace_storage"]
    assert storage in config["extensions"]["jaeger_storage"]["backends"]
    assert config["extensions"]["jaeger_query"]["storage"]["traces"] == storage
    assert set(config["service"]["extensions"]) == {"jaeger_storage", "jaeger_query"}

    # OTLP/HTTP where every llmgw service sends it, on all interfaces (Jaeger's own default
    # is localhost, out of the other containers' reach); the UI on the port compose publishes.
    http = config["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    endpoint = compose()["x-llmgw"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == f"http://jaeger:{http.rsplit(':', 1)[1]}"
    assert http.startswith("0.0.0.0:")
    ui = config["extensions"]["jaeger_query"]["http"]["endpoint"]
    assert ui.startswith("0.0.0.0:")
    published = {p.rsplit(":", 1)[1] for p in jaeger["ports"]}
    assert published == {http.rsplit(":", 1)[1], ui.rsplit(":", 1)[1]}
