"""One trace follows a deployment from `ctl deploy` through placement to the launcher's shard."""

from __future__ import annotations

from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from llmgw.ctl import deploy
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment
from llmgw_core.telemetry import links, resource_attributes
from llmgw_placement import PlacementService, ServerConfig
from tests.cluster_support import sim_catalog
from tests.launcher_support import agent_config, running_launcher, shard_events
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="session")
def spans() -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter


async def test_one_trace_from_ctl_deploy_to_the_shard(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, spans: InMemorySpanExporter
) -> None:
    spans.clear()
    config = msgspec.convert(
        {
            "nats": {"url": nats_url, "prefix": prefix},
            "engines": [],
            "catalog": [sim_catalog()],
            "heartbeat_interval_s": 0.3,
            "node_timeout_s": 2.0,
        },
        ServerConfig,
    )
    placement_bus = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="placement")
    headers: list[str] = []

    async def on_event(msg: Msg) -> None:
        headers.append((msg.headers or {}).get("traceparent", ""))

    sub = await bus.nc.subscribe(f"{prefix}.events.shard.>", cb=on_event)
    try:
        async with anyio.create_task_group() as tg, shard_events(bus) as events:
            service = PlacementService(config, placement_bus)
            await tg.start(service.run)
            async with running_launcher(agent_config(nats_url, prefix, tmp_path / "agent")):
                # The node must be known to placement: report it like an installer would.
                from llmgw_installer import Installer

                node = agent_config(nats_url, prefix, tmp_path / "agent", simulate={"gpu_count": 2})
                installer = Installer(node, bus, packages=None)
                await installer.converge_once()
                await deploy(bus, Deployment(name="chat", profile="tiny", replicas=1))
                await eventually(lambda: events.states("chat-r0-0")[-1:] == ["ready"], timeout=30)
                assert service.controller is not None
            tg.cancel_scope.cancel()
    finally:
        await sub.unsubscribe()
        await placement_bus.close()
    by_name = {s.name: s for s in spans.get_finished_spans()}
    deploy_span = by_name["ctl deploy chat"]
    place_span = by_name["place chat/r0"]
    start_span = by_name["start shard node-a.chat-r0-0"]
    trace_id = deploy_span.context.trace_id
    assert place_span.context.trace_id == trace_id
    assert start_span.context.trace_id == trace_id
    assert place_span.parent is not None
    assert place_span.parent.span_id == deploy_span.context.span_id
    assert start_span.parent is not None
    assert start_span.parent.span_id == place_span.context.span_id
    # The commit that wrote the replica's shard and record (a span of no trace of its own, as
    # it writes many deployments' placements) is linked from the deployment's trace.
    commit = [
        s for s in spans.get_finished_spans() if s.name.startswith("commit ") and "placements" in s.name
    ]
    assert commit, "no span for the commit of the placement"
    assert any(link.context.trace_id == trace_id for s in commit for link in s.links), commit
    # The replica's `ready` continues the same trace rather than starting one of its own.
    ready_span = by_name["replica chat/r0 ready"]
    assert ready_span.context.trace_id == trace_id
    assert dict(ready_span.attributes or {})["llmgw.replica"] == "r0"
    # Messages carry OpenTelemetry's messaging attributes, so Jaeger can search by subject:
    # one event on its own, and the shard's statuses sent as one commit.
    finished = spans.get_finished_spans()
    single = [s for s in finished if s.name == f"publish {prefix}.events.deployment.chat"]
    assert single, "no span for the deployment's status"
    attrs = dict(single[0].attributes or {})
    assert attrs["messaging.system"] == "nats"
    assert attrs["messaging.destination.name"] == f"{prefix}.events.deployment.chat"
    assert attrs["messaging.operation.type"] == "publish"
    assert int(attrs["messaging.message.body.size"]) > 0
    shard_subject = f"{prefix}.events.shard.node-a.chat-r0-0"
    batched = [
        s for s in finished if dict(s.attributes or {}).get("messaging.destination.name") == shard_subject
    ]
    assert batched, "no span for the shard's events"
    assert int(dict(batched[0].attributes or {})["messaging.batch.message_count"]) >= 1
    # Other systems see it too: the shard events carry the same trace.
    assert any(h.split("-")[1] == format(trace_id, "032x") for h in headers if h)


def test_every_node_is_an_instance_of_one_service() -> None:
    """Regression: `service.name` carried the node id, so Jaeger listed one service per node."""
    attrs = resource_attributes("llmgw-launcher", "gpu-07")
    assert attrs["service.name"] == "llmgw-launcher"
    assert attrs["service.instance.id"] == "gpu-07"
    assert resource_attributes("llmgw-placement")["service.name"] == "llmgw-placement"


def test_one_commit_of_many_deployments_links_each_deployments_trace() -> None:
    """Placement commits many deployments' placements in one batch, under one span of no
    deployment's trace: linked to each, every deployment's trace leads to the writes."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    a = "00-" + "a" * 32 + "-" + "1" * 16 + "-01"
    b = "00-" + "b" * 32 + "-" + "2" * 16 + "-01"
    with provider.get_tracer("test").start_as_current_span(
        "commit 3 placements", links=links([a, "", b, a, "junk"])
    ):
        pass
    (span,) = exporter.get_finished_spans()
    assert [(f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") for link in span.links] == [
        ("a" * 32, "1" * 16),
        ("b" * 32, "2" * 16),
    ]
    assert f"{span.context.trace_id:032x}" not in ("a" * 32, "b" * 32)
