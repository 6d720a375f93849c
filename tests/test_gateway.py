"""The gateway as a client sees it: the official `openai` client pointed at one base URL,
in front of real placement, launcher and sim engine processes on the session's NATS."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from llmgw_core import failures
from llmgw_core.bus import Bus
from llmgw_core.config import loads
from llmgw_core.errors import ConfigError
from llmgw_core.events import DeploymentStatus, ReplicaRecord, ShardStatus
from llmgw_core.lifecycle import connect_service
from llmgw_gateway import Gateway, GatewayConfig, Proxy, Table
from llmgw_gateway.config import load_api_keys
from llmgw_gateway.web import bind
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.control_support import replicas
from tests.gateway_support import serve_proxy
from tests.test_sim_engine import free_port
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

CHAT = [{"role": "user", "content": "hello"}]


@contextlib.asynccontextmanager
async def running_gateway(
    c: Cluster,
    *,
    tracer_provider: TracerProvider | None = None,
    more: dict[str, Any] | None = None,
    **http: Any,
) -> AsyncIterator[tuple[str, Gateway]]:
    """A gateway in this process, connected as the `gateway` identity, on a free port; open
    (no key required) unless `http` says otherwise; `more` is more of gateway.yaml."""
    http = {"port": 0, "require_api_key": False, **http}
    config = msgspec.convert({"nats": c.nats("gateway"), "http": http, **(more or {})}, GatewayConfig)
    bus = await connect_service(config.nats, "gateway", ensure=False)
    tracer = tracer_provider.get_tracer("test") if tracer_provider else None
    async with bus, anyio.create_task_group() as tg:
        gateway = Gateway(config, bus, tracer=tracer)
        port = await tg.start(gateway.run)
        try:
            yield f"http://127.0.0.1:{port}", gateway
        finally:
            tg.cancel_scope.cancel()


async def replica(bus: Bus, key: str) -> ReplicaRecord:
    found = await replicas(bus)
    assert key in found, sorted(found)
    return found[key]


async def ready(bus: Bus, key: str) -> ReplicaRecord:
    async def check() -> ReplicaRecord:
        r = await replica(bus, key)
        assert r.state == "ready", r
        return r

    return await eventually(check, timeout=60, interval=0.2)


def metric(text: str, line: str, absent: float | None = None) -> float:
    """The value of a scraped sample; `absent` where a counter not yet counted may be missing."""
    m = re.search(rf"^{re.escape(line)} (\S+)$", text, re.MULTILINE)
    if m is None and absent is not None:
        return absent
    assert m, f"{line} not in:\n{text}"
    return float(m.group(1))


async def test_openai_client_through_the_gateway_survives_an_engine_restart(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement(
            "p1",
            [sim_catalog(), sim_catalog("--load-time", "600", name="slow-profile")],
            [
                {"name": "chat", "profile": "tiny", "replicas": 1, "aliases": ["tiny-chat", "gpt-4o"]},
                {"name": "slow", "profile": "slow-profile", "replicas": 1},
            ],
        )
        c.start_node("n1", gpus=2)
        async with (
            contextlib.AsyncExitStack() as stack,
            # Held requests wait half a second for a ready replica, then get the 503.
            running_gateway(c, tracer_provider=provider, more={"hold_timeout_s": 0.5}) as (url, _),
        ):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            await stack.enter_async_context(client)
            await ready(bus, "chat.r0")

            # Non-streamed, by the deployment's name; the engine's answer comes back as it gave it.
            done = await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=5)  # type: ignore[arg-type]
            text = done.choices[0].message.content
            assert text is not None
            assert len(text.split()) == 5
            assert done.model == "tiny"
            # Streamed, by an alias: the same words, chunk by chunk.
            stream = await client.chat.completions.create(
                model="tiny-chat",
                messages=CHAT,  # type: ignore[arg-type]
                max_tokens=5,
                stream=True,
            )
            pieces = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
            assert len(pieces) >= 5
            assert "".join(pieces) == text
            legacy = await client.completions.create(model="gpt-4o", prompt="once upon", max_tokens=3)
            assert len(legacy.choices[0].text.split()) == 3

            # Server-sent events pass through as the engine wrote them.
            async with httpx.AsyncClient(timeout=30) as raw:
                body = {"model": "chat", "messages": CHAT, "max_tokens": 3, "stream": True}
                async with raw.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    assert r.headers["content-type"].startswith("text/event-stream")
                    sse = b"".join([chunk async for chunk in r.aiter_raw()])
            events = sse.split(b"\n\n")
            assert events[-2:] == [b"data: [DONE]", b""]
            assert all(e.startswith(b"data: {") for e in events[:-2])

            models = await client.models.list()
            listed = {m.id: m.model_extra for m in models.data}
            assert sorted(listed) == ["chat", "slow"]
            assert listed["chat"] is not None
            assert listed["chat"]["aliases"] == ["tiny-chat", "gpt-4o"]

            # An unknown model: 404, naming the known ones.
            with pytest.raises(openai.NotFoundError) as missing:
                await client.chat.completions.create(model="nope", messages=CHAT)  # type: ignore[arg-type]
            assert missing.value.body == {
                "message": "model 'nope' is not served here; "
                "known models: chat (aliases: tiny-chat, gpt-4o), slow",
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }

            # No ready replica: 503, in the replica's own words.
            async def unavailable() -> bool:
                slow = await replica(bus, "slow.r0")
                assert slow.state != "ready"
                with pytest.raises(openai.InternalServerError) as none_ready:
                    await client.chat.completions.create(model="slow", messages=CHAT)  # type: ignore[arg-type]
                assert none_ready.value.status_code == 503
                why = failures.one_line(slow.reason) or failures.summary(failures.failure_of(slow))
                expected = (
                    rf"deployment slow has 0 ready replicas: r0 {slow.state}( for \d+s)?"
                    + (re.escape(f" ({why})") if why else "")
                    + r"; the request was held 0\.\ds \(the gateway's hold_timeout_s: 0\.5s\) "
                    r"and no replica became ready"
                )
                assert isinstance(none_ready.value.body, dict)
                assert re.fullmatch(expected, none_ready.value.body["message"]), none_ready.value.body
                return True

            await eventually(unavailable, timeout=30, interval=0.3)

            # The engine dies (killed by the pid its launcher recorded); once the replica is ready
            # again, on whatever port, the same base URL answers.
            statuses = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
            ((engine_key, engine),) = [
                (k, s.value) for k, s in statuses.items() if s.value and s.value.deployment == "chat"
            ]
            assert engine.pids
            os.kill(engine.pids[-1], signal.SIGKILL)

            async def restarted() -> ReplicaRecord:
                found = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
                shard = found[engine_key].value
                assert shard is not None
                assert shard.restarts > engine.restarts, shard
                assert shard.state == "ready", shard
                r = await replica(bus, "chat.r0")
                assert r.state == "ready", r
                assert r.url == shard.url, (r, shard)
                return r

            await eventually(restarted, timeout=60, interval=0.2)

            async def answers() -> bool:
                again = await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=5)  # type: ignore[arg-type]
                assert again.choices[0].message.content == text
                return True

            await eventually(answers, timeout=15, interval=0.2)

            async with httpx.AsyncClient(timeout=10) as raw:
                health = await raw.get(f"{url}/healthz")
                scrape = (await raw.get(f"{url}/metrics")).text
            assert health.json() == {"status": "ok", "deployments": ["chat", "slow"]}
            assert metric(scrape, 'llmgw_gateway_requests_total{deployment="chat"}') >= 5
            assert (
                metric(scrape, 'llmgw_gateway_errors_total{deployment="(unknown)",reason="unknown_model"}')
                == 1
            )
            assert (
                metric(scrape, 'llmgw_gateway_errors_total{deployment="slow",reason="no_ready_replica"}') >= 1
            )
            assert metric(scrape, 'llmgw_gateway_time_to_first_byte_seconds_count{deployment="chat"}') >= 5

    proxied = [s for s in spans.get_finished_spans() if s.attributes and s.attributes.get("llmgw.replica")]
    assert {s.name for s in proxied} == {"POST /v1/chat/completions", "POST /v1/completions"}
    assert {
        (s.attributes["llmgw.deployment"], s.attributes["llmgw.replica"]) for s in proxied if s.attributes
    } == {("chat", "r0")}
    refused = [
        s
        for s in spans.get_finished_spans()
        if s.attributes and s.attributes.get("llmgw.deployment") == "slow"
    ]
    assert refused
    assert all(s.status.status_code == StatusCode.ERROR for s in refused)


async def test_two_replicas_share_the_load_least_outstanding_first(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        # Slow tokens: each stream stays open for about a second.
        c.start_placement(
            "p1",
            [sim_catalog("--tokens-per-second", "10")],
            [{"name": "chat", "profile": "tiny", "replicas": 2}],
        )
        c.start_node("n1", gpus=2)
        async with contextlib.AsyncExitStack() as stack, running_gateway(c) as (url, _):
            urls = [(await ready(bus, key)).url for key in ("chat.r0", "chat.r1")]
            assert len(set(urls)) == 2
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            await stack.enter_async_context(client)

            async def one(i: int) -> None:
                stream = await client.chat.completions.create(
                    model="chat",
                    messages=[{"role": "user", "content": f"request {i}"}],
                    max_tokens=8,
                    stream=True,
                )
                async for _ in stream:
                    pass

            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(one, i)

            async with httpx.AsyncClient(timeout=10) as raw:
                served = [
                    metric((await raw.get(f"{u}/metrics")).text, "llmgw_sim_requests_total") for u in urls
                ]
            assert served == [3, 3]


async def test_a_replica_that_refuses_the_connection_costs_nothing_but_a_retry(tmp_path: Path) -> None:
    """Placement has not noticed yet that r0's engine is gone: the request goes to r1."""
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, "-m", "llmgw_core.sim", "--port", str(port), "--model", "tiny"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        table = Table()
        for name, url in (("r0", f"http://127.0.0.1:{free_port()}"), ("r1", f"http://127.0.0.1:{port}")):
            table.set_replica(
                f"chat.{name}",
                ReplicaRecord(
                    deployment="chat", replica=name, profile="tiny", profile_fp="x", state="ready", url=url
                ),
            )
        async with httpx.AsyncClient() as client, Proxy(table, client) as proxy:
            proxy.loaded.set()
            async with anyio.create_task_group() as tg:
                gw = await tg.start(serve_proxy, proxy)
                base = f"http://127.0.0.1:{gw}"

                async def up() -> bool:
                    try:
                        return (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200
                    except httpx.ConnectError:
                        return False

                await eventually(up, timeout=20, interval=0.1)
                # r0 is chosen first (nothing in flight anywhere, neither chosen before).
                r = await client.post(
                    f"{base}/v1/completions", json={"model": "chat", "prompt": "hi"}, timeout=10
                )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == "tiny"
                scrape = (await client.get(f"{base}/metrics")).text
                assert metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="connect"}') == 1

                # With r1 gone too, the 503 says which replicas were tried and how they failed.
                table.set_replica("chat.r1", None)
                r = await client.post(
                    f"{base}/v1/completions", json={"model": "chat", "prompt": "hi"}, timeout=10
                )
                assert r.status_code == 503
                message = r.json()["error"]["message"]
                dead = table.replicas["chat.r0"].url
                assert message.startswith(
                    f"deployment chat has 1 ready replica but none accepted the request: r0 at {dead}: "
                ), message
                tg.cancel_scope.cancel()
    finally:
        engine.kill()
        engine.wait()


async def test_client_keys_when_asked_for(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# clients\nsecret-1\n")
    table = Table()
    async with (
        httpx.AsyncClient() as client,
        Proxy(table, client, api_keys=load_api_keys(str(keys))) as proxy,
    ):
        proxy.loaded.set()
        async with anyio.create_task_group() as tg:
            base = f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}"
            r = await client.get(f"{base}/v1/models")
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
            r = await client.get(f"{base}/v1/models", headers={"Authorization": "Bearer secret-1"})
            assert r.status_code == 200
            assert (await client.get(f"{base}/healthz")).status_code == 200
            tg.cancel_scope.cancel()
    # Keys are required by default, from the keys bucket where no file names any.
    assert loads("http: {port: 0}\n", GatewayConfig, source="gateway.yaml").http.require_api_key
    with pytest.raises(ConfigError) as err:
        loads(
            f"http: {{require_api_key: false, api_keys_file: {keys}}}\n", GatewayConfig, source="gateway.yaml"
        )
    assert str(err.value).startswith(
        "gateway.yaml: http: api_keys_file is set but http: require_api_key is false; "
        "set require_api_key: true to check client keys, or drop api_keys_file"
    )


def test_the_listening_socket_says_tcp_so_answers_are_not_held_back_by_nagle() -> None:
    """Regression: with proto 0 asyncio left TCP_NODELAY off on accepted connections, and
    every answer waited about 40 ms for the client's delayed ACK."""
    sock = bind("127.0.0.1", 0)
    with sock:
        assert sock.proto == socket.IPPROTO_TCP


def test_llmgw_gateway_says_what_is_wrong_with_its_config(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("http:\n  prot: 8000\n")
    for argv in (
        ["-m", "llmgw_gateway"],
        ["-c", "import sys; from llmgw.cli import main; sys.exit(main())", "gateway"],
    ):
        done = subprocess.run(
            [sys.executable, *argv, "--config", str(config)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2
        assert done.stderr == f"llmgw-gateway: {config}: Object contains unknown field `prot` - at `$.http`\n"


async def test_a_deployment_placement_cannot_place_is_refused_in_placements_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """A deployment placement can place on no node, none of its replicas placed, is answered
    at once (422) with placement's reasons, every node's included, even by a gateway started
    after placement said it."""
    big = {**sim_catalog(name="big"), "tp": 4}
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("p1", [big], [{"name": "big", "profile": "big", "replicas": 1}])
        c.start_node("n1", gpus=2)

        async def said() -> DeploymentStatus:
            found = await bus.history(bus.names.deployment_event("big"), DeploymentStatus, idle_s=0.3)
            assert found, "no DeploymentStatus yet"
            assert found[-1].unplaceable == 1, found
            assert "n1" in found[-1].summary, found[-1]  # every node's reason, once n1 is known
            return found[-1]

        await eventually(said, timeout=60, interval=0.5)
        async with (
            running_gateway(c, more={"hold_timeout_s": 0.5}) as (url, _),
            httpx.AsyncClient(timeout=30) as client,
        ):

            async def refused() -> str:
                r = await client.post(f"{url}/v1/chat/completions", json={"model": "big", "messages": CHAT})
                assert r.status_code == 422, r.text
                assert r.json()["error"]["code"] == "deployment_unplaceable", r.text
                message: str = r.json()["error"]["message"]
                return message

            message = await eventually(refused, timeout=30, interval=0.2)
            assert message.startswith(
                "deployment big cannot be placed on any node, so no replica will serve it until the "
                "cluster changes: "
            ), message
            assert " on n1" in message, message
