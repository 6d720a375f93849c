"""Requests held by the gateway for a deployment with no ready replica, the demand reports it
publishes for the autoscaler, and draining replicas: a real gateway (as the `gateway` identity)
on the session's NATS, replica records written as placement writes them, real sim engines."""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.config import NatsConfig
from llmgw_core.events import (
    Autoscale,
    Demand,
    Deployment,
    DeploymentDemand,
    DeploymentStatus,
    NodeReason,
    ReplicaInFlight,
    ReplicaRecord,
)
from llmgw_core.lifecycle import connect_service
from llmgw_gateway import Gateway, GatewayConfig, Table
from llmgw_gateway.demand import DemandCounts
from llmgw_gateway.holds import Held, Holds
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.gateway_support import gateway_process
from tests.test_auth import core_refused, subscribe_refused
from tests.test_gateway import metric
from tests.test_gateway_api import sim_engines
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

CHAT = [{"role": "user", "content": "hello"}]
BODY = {"model": "chat", "messages": CHAT, "max_tokens": 3}
# A gateway of its own process that asks no key.
OPEN = {"require_api_key": False}
AT_ZERO = Deployment(
    name="chat", profile="tiny", replicas=0, autoscale=Autoscale(min_replicas=0, max_replicas=2)
)


@contextlib.asynccontextmanager
async def gateway(c: Cluster, **config: Any) -> AsyncIterator[tuple[str, Gateway]]:
    """A gateway in this process as the `gateway` identity, open, on a free port; `config` is
    more of gateway.yaml."""
    full = {"nats": c.nats("gateway"), "http": {"port": 0, "require_api_key": False}, **config}
    gw_config = msgspec.convert(full, GatewayConfig)
    bus = await connect_service(gw_config.nats, "gateway", ensure=False)
    async with bus, anyio.create_task_group() as tg:
        gw = Gateway(gw_config, bus)
        port = await tg.start(gw.run)
        try:
            yield f"http://127.0.0.1:{port}", gw
        finally:
            tg.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def demand_reports(c: Cluster) -> AsyncIterator[list[tuple[str, Demand]]]:
    """Every Demand published, with its subject, heard as placement hears them (its identity)."""
    heard: list[tuple[str, Demand]] = []

    async def on_report(report: Demand, subject: str) -> None:
        # Decoded from the bytes on the bus by `decoder(Demand)`, as the autoscaler's are.
        heard.append((subject, report))

    bus = await connect_service(msgspec.convert(c.nats("placement"), NatsConfig), "placement", ensure=False)
    async with bus, anyio.create_task_group() as tg:
        await tg.start(bus.subscribe_core, bus.names.demand("*"), Demand, on_report)
        try:
            yield heard
        finally:
            tg.cancel_scope.cancel()


def of(report: Demand, deployment: str = "chat") -> DeploymentDemand | None:
    found = [d for d in report.deployments if d.deployment == deployment]
    return found[0] if found else None


def record(replica: str, url: str = "", state: str = "ready", **more: Any) -> ReplicaRecord:
    return msgspec.convert(
        {
            "deployment": "chat",
            "replica": replica,
            "profile": "tiny",
            "profile_fp": "x",
            "state": state,
            "url": url,
            "engine": "sim",
            **more,
        },
        ReplicaRecord,
    )


async def engines_up(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=5) as client:

        async def up() -> bool:
            for url in urls:
                try:
                    assert (await client.get(f"{url}/health")).status_code == 200, url
                except httpx.TransportError as exc:
                    raise AssertionError(f"{url}: {exc}") from exc
            return True

        await eventually(up, timeout=30, interval=0.1)


async def held(url: str, n: int, deployment: str = "chat") -> None:
    """Wait until the gateway at `url` holds `n` requests for `deployment` (its /metrics)."""
    async with httpx.AsyncClient(timeout=10) as client:

        async def check() -> bool:
            scrape = (await client.get(f"{url}/metrics")).text
            assert metric(scrape, f'llmgw_gateway_held_requests{{deployment="{deployment}"}}') == n
            return True

        await eventually(check, timeout=30, interval=0.05)


async def test_a_request_at_zero_replicas_is_held_told_at_once_and_sent_when_a_replica_is_ready(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([]) as (engine,):
        await engines_up([engine])
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        # Reports every 30 s: a report of the held request within the test's deadline is the one
        # sent at once.
        async with (
            demand_reports(c) as heard,
            gateway(c, id="gw-a", demand_interval_s=30) as (url, _),
            httpx.AsyncClient(timeout=60) as client,
            anyio.create_task_group() as tg,
        ):
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

            tg.start_soon(ask)

            async def told() -> Demand:
                found = [d for s, d in heard if (row := of(d)) is not None and row.queued == 1]
                assert found, heard
                return found[0]

            report = await eventually(told, timeout=20)
            assert report.gateway == "gw-a"
            assert report.interval_s == 30
            assert of(report) == DeploymentDemand(deployment="chat", queued=1, arrived=1)
            assert {s for s, _ in heard} == {f"{prefix}.demand.gw-a"}
            await held(url, 1)
            assert not answers

            # Placement's record of the first replica, ready: the held request goes there.
            await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine))
            await eventually(lambda: answers, timeout=30)
            (answer,) = answers
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["choices"][0]["message"]["content"].split()) == 3
            scrape = (await client.get(f"{url}/metrics")).text
            assert metric(scrape, 'llmgw_gateway_held_requests{deployment="chat"}') == 0
            assert (
                metric(scrape, 'llmgw_gateway_hold_wait_seconds_count{deployment="chat",outcome="sent"}') == 1
            )


async def test_reports_every_interval_count_in_flight_per_replica_then_say_zero_once(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines(["--tokens-per-second", "4"]) as (engine,):
        await engines_up([engine])
        await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
        await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine))
        async with (
            demand_reports(c) as heard,
            gateway(c, id="gw-a", demand_interval_s=0.3) as (url, _),
            httpx.AsyncClient(timeout=60) as client,
        ):
            # Two streams of 12 tokens at 4 a second: 3 s in flight each.
            body = {**BODY, "max_tokens": 12, "stream": True}
            async with (
                client.stream("POST", f"{url}/v1/chat/completions", json=body) as one,
                client.stream("POST", f"{url}/v1/chat/completions", json=body) as two,
            ):
                assert (one.status_code, two.status_code) == (200, 200)

                async def in_flight() -> DeploymentDemand:
                    rows = [row for _, d in heard if (row := of(d)) is not None and row.in_flight == 2]
                    assert rows, heard
                    return rows[-1]

                row = await eventually(in_flight, timeout=20)
                assert row.queued == 0
                assert row.replicas == (ReplicaInFlight(replica="r0", in_flight=2),)
                # The two arrivals are counted once, in the report after they came.
                assert sum(r.arrived for _, d in heard if (r := of(d)) is not None) == 2
                chunks = [await one.aread(), await two.aread()]
            assert all(c.endswith(b"data: [DONE]\n\n") for c in chunks)

            async def settled() -> int:
                # The last report with chat says 0; the ones after leave it out.
                said = [i for i, (_, d) in enumerate(heard) if of(d) is not None]
                last = heard[said[-1]][1]
                assert of(last) == DeploymentDemand(deployment="chat"), last
                after = heard[said[-1] + 1 :]
                assert len(after) >= 2, "fewer than two reports after the zero"
                return len(after)

            await eventually(settled, timeout=20)
            # Every interval: the reports' times are about 0.3 s apart.
            times = [d.at for _, d in heard]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            assert len(times) >= 5, times
            assert all(g > 0.1 for g in gaps), gaps


async def test_a_full_queue_is_429_and_a_wait_over_is_503_in_the_replicas_and_placements_words(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        since = time.time() - 12
        starting = record("r0", state="starting", reason="loading weights: 38%", since=since)
        await bus.put(bus.names.replicas_bucket, "chat.r0", starting)
        async with (
            gateway(c, hold_queue=1, hold_timeout_s=3) as (url, _),
            httpx.AsyncClient(timeout=60) as client,
            anyio.create_task_group() as tg,
        ):
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

            tg.start_soon(ask)
            await held(url, 1)
            full = await client.post(f"{url}/v1/chat/completions", json=BODY)
            assert full.status_code == 429
            assert full.headers["retry-after"] == "5"
            assert full.json() == {
                "error": {
                    "message": "deployment chat has no ready replica and 1 requests are already held "
                    "for one (the gateway's hold_queue); retry in 5s",
                    "type": "requests",
                    "param": None,
                    "code": "hold_queue_full",
                }
            }
            await eventually(lambda: answers, timeout=30)
            (over,) = answers
            assert over.status_code == 503
            assert over.headers["retry-after"] == "10"
            error = over.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "no_ready_replica")
            assert re.fullmatch(
                r"deployment chat has 0 ready replicas: r0 starting for 1\ds \(loading weights: 38%\); "
                r"the request was held 3\.\ds \(the gateway's hold_timeout_s: 3s\) "
                r"and no replica became ready",
                error["message"],
            ), error

            # No replica record, placement's refusal: nothing can serve it, so its words at once
            # (422, which the SDKs do not retry), not after the wait.
            await bus.delete(bus.names.replicas_bucket, "chat.r0")
            summary = "chat: 0 of 1 ready; 1 cannot be placed: n1 no GPU of class H100-80G"
            refusal = DeploymentStatus(
                deployment="chat",
                desired=1,
                unplaceable=1,
                summary=summary,
                reasons=(NodeReason(node="n1", reason="no GPU of class H100-80G"),),
            )
            await bus.publish(bus.names.deployment_event("chat"), refusal)

            async def refused() -> str:
                started = time.monotonic()
                r = await client.post(f"{url}/v1/chat/completions", json=BODY)
                assert r.status_code == 422, r.text
                assert "retry-after" not in r.headers
                message: str = r.json()["error"]["message"]
                assert message == (
                    "deployment chat cannot be placed on any node, so no replica will serve it until the "
                    "cluster changes: no GPU of class H100-80G on n1. `llmgw ctl explain chat` shows every "
                    "node's reason"
                ), message
                assert time.monotonic() - started < 2.5
                return message

            await eventually(refused, timeout=40, interval=0.1)

            # Scaled to 0 by hand, no autoscale: nothing will start it, answered at once.
            await bus.put(
                bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny", replicas=0)
            )

            async def at_once() -> bool:
                started = time.monotonic()
                r = await client.post(f"{url}/v1/chat/completions", json=BODY)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["message"] == (
                    "deployment chat has 0 ready replicas: it is scaled to 0, with no autoscale "
                    "(`llmgw ctl scale chat --replicas N` starts it)"
                )
                assert time.monotonic() - started < 2.5
                return True

            await eventually(at_once, timeout=30, interval=0.1)


async def test_two_gateways_each_report_their_own_demand(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        async with (
            demand_reports(c) as heard,
            gateway(c, id="gw-a", demand_interval_s=0.3) as (a, _),
            gateway(c, demand_interval_s=0.3) as (b, gw_b),
            httpx.AsyncClient(timeout=60) as client,
            anyio.create_task_group() as tg,
        ):
            assert re.fullmatch(r"[A-Za-z0-9_-]+-\d+-[0-9a-f]{6}", gw_b.id), gw_b.id

            async def ask(url: str, n: int) -> None:
                for _ in range(n):
                    tg.start_soon(partial(client.post, f"{url}/v1/chat/completions", json=BODY))

            await ask(a, 1)
            await ask(b, 2)
            await held(a, 1)
            await held(b, 2)

            async def both() -> dict[str, int]:
                latest = {d.gateway: (s, of(d)) for s, d in heard}
                assert set(latest) == {"gw-a", gw_b.id}, latest
                assert latest["gw-a"][0] == f"{prefix}.demand.gw-a"
                assert latest[gw_b.id][0] == f"{prefix}.demand.{gw_b.id}"
                queued = {g: row.queued if row else 0 for g, (_, row) in latest.items()}
                assert queued == {"gw-a": 1, gw_b.id: 2}, queued
                return queued

            await eventually(both, timeout=20)
            tg.cancel_scope.cancel()


async def test_a_draining_replica_gets_nothing_new_while_its_stream_finishes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    slow = ["--tokens-per-second", "4"]
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines(slow, slow) as (e0, e1):
        await engines_up([e0, e1])
        await bus.put(
            bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny", replicas=2)
        )
        await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", e0))
        await bus.put(bus.names.replicas_bucket, "chat.r1", record("r1", e1))
        async with (
            demand_reports(c) as heard,
            gateway(c, demand_interval_s=0.3, hold_timeout_s=2) as (url, gw),
            httpx.AsyncClient(timeout=60) as client,
        ):
            await eventually(lambda: len(gw.table.ready("chat")) == 2, timeout=20)
            body = {**BODY, "max_tokens": 12, "stream": True}
            # Nothing in flight, neither chosen before: r0 takes the first.
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as first:
                assert first.status_code == 200
                await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", e0, state="draining"))
                await eventually(lambda: gw.table.replicas["chat.r0"].state == "draining", timeout=20)
                # r1 has fewer in flight anyway: two at once there make it the busier one, and
                # the next still goes there.
                for _ in range(3):
                    r = await client.post(f"{url}/v1/chat/completions", json={**BODY, "max_tokens": 1})
                    assert r.status_code == 200, r.text

                # Its stream is handed over to r1 (continued there): the reports say nothing
                # is in flight on r0 long before the answer ends, and placement may stop it.
                async def reported() -> DeploymentDemand:
                    rows = [row for _, d in heard if (row := of(d)) is not None]
                    assert rows, heard
                    handed = [r for r in rows if r.replicas == (ReplicaInFlight(replica="r1", in_flight=1),)]
                    assert handed, rows
                    return handed[-1]

                await eventually(reported, timeout=20)
                streamed = await first.aread()
            assert streamed.endswith(b"data: [DONE]\n\n")
            assert b'"error"' not in streamed
            assert streamed.count(b'"content"') >= 12
            async with httpx.AsyncClient(timeout=10) as raw:
                served = [
                    metric((await raw.get(f"{u}/metrics")).text, "llmgw_sim_requests_total") for u in (e0, e1)
                ]
            assert served == [1, 4]

            # r1 gone, r0 draining: never a fallback; the request is held, then refused.
            await bus.delete(bus.names.replicas_bucket, "chat.r1")
            await eventually(lambda: "chat.r1" not in gw.table.replicas, timeout=20)
            r = await client.post(f"{url}/v1/chat/completions", json=BODY)
            assert r.status_code == 503
            assert r.json()["error"]["message"].startswith(
                "deployment chat has 0 ready replicas: r0 draining"
            )
            async with httpx.AsyncClient(timeout=10) as raw:
                assert metric((await raw.get(f"{e0}/metrics")).text, "llmgw_sim_requests_total") == 1


async def test_a_gateway_stopped_while_holding_answers_503_and_a_restarted_one_serves(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([]) as (engine,):
        await engines_up([engine])
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        async with httpx.AsyncClient(timeout=60) as client, demand_reports(c) as heard:
            with gateway_process(c, tmp_path, "gw-1", id="gw-1", http=OPEN) as gateway:
                url, proc = await gateway.endpoint(), gateway.proc
                answers: list[httpx.Response] = []
                async with anyio.create_task_group() as tg:

                    async def ask() -> None:
                        answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

                    tg.start_soon(ask)
                    tg.start_soon(ask)
                    await held(url, 2)
                    proc.send_signal(signal.SIGTERM)
                    await eventually(lambda: len(answers) == 2, timeout=30)
                for answer in answers:
                    assert answer.status_code == 503
                    assert answer.headers["retry-after"] == "1"
                    error = answer.json()["error"]
                    assert error["code"] == "gateway_restarting"
                    assert re.fullmatch(
                        r"gateway restarting: the request was held \d+\.\ds for a ready replica of "
                        r"deployment chat and was not sent; retry in 1s",
                        error["message"],
                    ), error
                assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
            # Its last report, sent as it stopped, holds nothing: the autoscaler does not count
            # the two answered requests until it forgets the gateway.
            rows = [row for _, d in heard if (row := of(d)) is not None]
            assert any(row.queued for row in rows), heard
            assert sum(row.arrived for row in rows) == 2, heard
            assert (rows[-1].queued, rows[-1].in_flight) == (0, 0), heard

            with gateway_process(c, tmp_path, "gw-1", id="gw-1", http=OPEN) as gateway:
                url = await gateway.endpoint()
                answers = []
                async with anyio.create_task_group() as tg:

                    async def ask_again() -> None:
                        answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

                    tg.start_soon(ask_again)
                    await held(url, 1)
                    await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine))
                (answer,) = answers
                assert answer.status_code == 200, answer.text


async def test_a_client_that_leaves_while_held_leaves_the_queue(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        async with (
            gateway(c, hold_queue=1) as (url, _),
            httpx.AsyncClient(timeout=60) as client,
        ):
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(client.post, f"{url}/v1/chat/completions", json=BODY))
                await held(url, 1)
                # The client gives up: its connection closes.
                tg.cancel_scope.cancel()
            await held(url, 0)
            scrape = (await client.get(f"{url}/metrics")).text
            assert (
                metric(scrape, 'llmgw_gateway_hold_wait_seconds_count{deployment="chat",outcome="left"}') == 1
            )
            # Its place is free: the next request is held, not refused as over the queue.
            async with anyio.create_task_group() as tg:
                tg.start_soon(partial(client.post, f"{url}/v1/chat/completions", json=BODY))
                await held(url, 1)
                tg.cancel_scope.cancel()


async def test_only_gateways_publish_demand_and_only_placement_hears_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        if c.auth is None:
            pytest.skip("the NATS server has no identities (LLMGW_TEST_NATS_URL or Docker)")
        assert c.session is not None
        c.session.add_node(prefix, "gpu-1")
        subject = bus.names.demand("gw-x")
        async with contextlib.AsyncExitStack() as stack:

            async def connect(identity: str) -> Bus:
                options = msgspec.convert(c.nats(identity), NatsConfig)
                return await stack.enter_async_context(await connect_service(options, identity, ensure=False))

            observer = await connect("observer")
            await core_refused(observer, subject)
            node = await connect("node-gpu-1")
            await subscribe_refused(node, bus.names.demand("*"))
            gateway_bus = await connect("gateway")
            heard = await stack.enter_async_context(demand_reports(c))

            async def reported() -> bool:
                # A report is plain NATS, at most once, and sent again every interval: so here.
                await gateway_bus.publish_core(subject, Demand(gateway="gw-x"))
                return bool(heard)

            await eventually(reported, timeout=20, interval=0.5)
            assert all(h == (subject, Demand(gateway="gw-x")) for h in heard), heard
            assert list(gateway_bus.nc.refusals) == []


# --- the pure parts -------------------------------------------------------------------


def test_a_report_says_a_deployment_while_it_has_demand_then_zero_once() -> None:
    counts = DemandCounts()
    counts.arrive("chat")
    counts.arrive("chat")
    counts.arrive("embed")
    first = counts.report("gw", {"chat.r0": 1, "chat.r1": 0}, {"embed": 1}, interval_s=1.0, at=5.0)
    assert first == Demand(
        gateway="gw",
        deployments=(
            DeploymentDemand(
                deployment="chat",
                in_flight=1,
                arrived=2,
                replicas=(ReplicaInFlight(replica="r0", in_flight=1),),
            ),
            DeploymentDemand(deployment="embed", queued=1, arrived=1),
        ),
        interval_s=1.0,
        at=5.0,
    )
    # Arrivals are counted once; chat still in flight, embed's request gone: its zero, once.
    second = counts.report("gw", {"chat.r0": 1}, {}, interval_s=1.0, at=6.0)
    assert [(d.deployment, d.in_flight, d.queued, d.arrived) for d in second.deployments] == [
        ("chat", 1, 0, 0),
        ("embed", 0, 0, 0),
    ]
    assert counts.report("gw", {"chat.r0": 1}, {}, interval_s=1.0, at=7.0).deployments[0].deployment == "chat"
    assert len(counts.report("gw", {"chat.r0": 1}, {}, interval_s=1.0, at=7.0).deployments) == 1
    assert counts.report("gw", {}, {}, interval_s=1.0, at=8.0).deployments == (
        DeploymentDemand(deployment="chat"),
    )
    assert counts.report("gw", {}, {}, interval_s=1.0, at=9.0).deployments == ()


async def test_held_requests_are_woken_first_come_first_served_and_bounded() -> None:
    holds = Holds(limit=2, timeout_s=1.0)
    a, b = holds.add("chat"), holds.add("chat")
    assert a is not None
    assert b is not None
    assert holds.add("chat") is None  # full
    assert holds.counts() == {"chat": 2}
    order: list[str] = []

    async def wait(name: str, held: Held) -> None:
        await held.woken.wait()
        order.append(name)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait, "b", b)
        tg.start_soon(wait, "a", a)
        # Both waiting, b first; release wakes them in the order they were held.
        await anyio.lowlevel.checkpoint()
        assert holds.release("chat") == 2
    assert order == ["a", "b"]
    assert holds.counts() == {}
    c = holds.add("chat")
    assert c is not None
    holds.close()
    assert c.closing
    assert c.woken.is_set()
    assert holds.closing
    assert not Holds(limit=0).enabled
    assert not Holds(timeout_s=0).enabled


def test_a_deployment_at_zero_is_said_so_with_or_without_autoscale() -> None:
    table = Table()
    table.set_deployment("chat", AT_ZERO)
    assert table.unavailable("chat") == (
        "deployment chat has 0 ready replicas: it is scaled to 0 (autoscale, min_replicas 0) "
        "and no replica was placed"
    )
    table.set_deployment("chat", Deployment(name="chat", profile="tiny", replicas=0))
    assert table.unavailable("chat") == (
        "deployment chat has 0 ready replicas: it is scaled to 0, with no autoscale "
        "(`llmgw ctl scale chat --replicas N` starts it)"
    )


async def test_a_request_for_a_replica_placement_is_starting_is_held_until_it_is_ready(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Through real placement, launcher and sim engine: the record placement writes when the
    engine is ready releases the held request."""
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement(
            "p1", [sim_catalog("--load-time", "5")], [{"name": "chat", "profile": "tiny", "replicas": 1}]
        )
        c.start_node("n1", gpus=1)
        async with gateway(c) as (url, gw), httpx.AsyncClient(timeout=120) as client:
            await eventually(lambda: "chat" in gw.table.deployments, timeout=60, interval=0.1)
            # Not ready for at least the engine's 5 s of loading.
            assert not gw.table.ready("chat")
            r = await client.post(f"{url}/v1/chat/completions", json=BODY)
            assert r.status_code == 200, r.text
            assert gw.table.replicas["chat.r0"].state == "ready"
            scrape = (await client.get(f"{url}/metrics")).text
            assert (
                metric(scrape, 'llmgw_gateway_hold_wait_seconds_count{deployment="chat",outcome="sent"}') == 1
            )
