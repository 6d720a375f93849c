"""docs/asyncapi.yaml against what the bus really carries: a small cluster (placement, one
node, a gateway answering one request) runs with tracing off and on, and every message its
events and usage streams stored has every header the document promises for its channel."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
import yaml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from llmgw_core.bus import Bus
from llmgw_gateway.web import serve_app
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.test_gateway import ready
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

DOC = Path(__file__).parent.parent / "docs" / "asyncapi.yaml"


def channel_patterns(doc: dict[str, Any], prefix: str) -> list[tuple[str, re.Pattern[str]]]:
    """Each channel with an address, as a pattern over the subjects of `prefix`."""
    found = []
    for cid, channel in doc["channels"].items():
        address = channel.get("address")
        if not address:
            continue
        pattern = re.escape(address).replace(re.escape("{prefix}"), re.escape(prefix))
        pattern = re.sub(r"\\\{[a-z]+\\\}", r"[^.]+", pattern)
        found.append((cid, re.compile(f"{pattern}$")))
    return found


def promised(doc: dict[str, Any], cid: str) -> dict[str, Any]:
    """The headers schema of the one message the channel names (empty: none promised)."""
    (ref,) = doc["channels"][cid]["messages"].values()
    name = ref["$ref"].rsplit("/", 1)[1]
    headers: dict[str, Any] = doc["components"]["messages"][name].get("headers", {})
    return headers


async def stored(bus: Bus, stream: str) -> list[tuple[str, dict[str, str]]]:
    """Every message `stream` holds: its subject and headers."""
    state = (await bus.js.stream_info(stream)).state
    messages: list[tuple[str, dict[str, str]]] = []
    if not state.messages:
        return messages
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(stream, seq=seq, direct=False)
        messages.append((msg.subject, dict(msg.headers or {})))
    return messages


def start_gateway(c: Cluster) -> str:
    config = {"nats": c.nats("gateway"), "http": {"host": "127.0.0.1", "port": 0, "require_api_key": False}}
    path = c.root / "gateway.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    c._spawn("gateway", [sys.executable, "-m", "llmgw_gateway", "--config", str(path)])
    return "gateway"


async def otlp_sink(task_status: Any) -> None:
    """An OTLP/HTTP collector that takes every export and keeps nothing."""

    async def take(request: Request) -> Response:
        await request.body()
        return Response(b"", media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", take, methods=["POST"])])
    await serve_app(app, "127.0.0.1", 0, task_status=task_status)


@pytest.mark.parametrize("tracing", [False, True], ids=["tracing-off", "tracing-on"])
async def test_every_stored_event_has_the_headers_the_document_promises(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tracing: bool
) -> None:
    doc = yaml.safe_load(DOC.read_text())
    patterns = channel_patterns(doc, prefix)
    async with anyio.create_task_group() as tg:
        if tracing:
            port = await tg.start(otlp_sink)
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
            monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
        else:
            monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
            c.start_node("n1", gpus=1)
            start_gateway(c)
            await ready(bus, "chat.r0")

            async def gateway_url() -> str:
                found = re.findall(r"OpenAI endpoint on (http://\S+)", c.log("gateway"))
                assert found, c.log("gateway")
                return found[-1]

            url = await eventually(gateway_url, timeout=60, interval=0.2)

            async def answered() -> bool:
                async with httpx.AsyncClient(timeout=30) as client:
                    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                    r = await client.post(f"{url}/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return True

            await eventually(answered, timeout=60, interval=0.3)

            async def usage_written() -> list[tuple[str, dict[str, str]]]:
                found = await stored(bus, bus.names.usage_stream)
                assert found
                return found

            usage = await eventually(usage_written, timeout=30, interval=0.3)
            events = await stored(bus, bus.names.events_stream)
        tg.cancel_scope.cancel()

    seen: dict[str, int] = {}
    for subject, headers in [*events, *usage]:
        matches = [cid for cid, p in patterns if p.match(subject)]
        assert len(matches) == 1, f"{subject}: channels {matches} in docs/asyncapi.yaml"
        (cid,) = matches
        seen[cid] = seen.get(cid, 0) + 1
        schema = promised(doc, cid)
        required = set(schema.get("required", []))
        if tracing:
            required |= set(schema.get("x-llmgw-required-with-tracing", []))
        missing = required - set(headers)
        assert not missing, f"{subject} ({cid}) lacks {sorted(missing)}: {headers}"
        for name, spec in schema.get("properties", {}).items():
            if name in headers and "pattern" in spec:
                assert re.match(spec["pattern"], headers[name]), (subject, name, headers[name])
        if not tracing:
            assert "traceparent" not in headers, (subject, headers)
    # The run covered what the document speaks of: node, shard, replica, placement and
    # deployment events (placement's in atomic batches) and usage.
    assert {"nodeFacts", "shardEvent", "replicaEvent", "placementEvent", "deploymentEvent", "usage"} <= set(
        seen
    ), seen
    ids = [h["Nats-Msg-Id"] for _, h in [*events, *usage]]
    assert len(ids) == len(set(ids)), "a message id used twice"
