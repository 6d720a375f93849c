"""Continuation, finished: only to a replica of the same profile fingerprint (mid-rollout a
deployment has two), counted by cause, timed at its seam and traced as a span of the request;
and a draining replica's long streams handed over at once instead of run to their end (real
gateway, real sim engine processes; the sim's words are a function of the prompt and their
place in the answer, so a continued answer equals an unbroken one word for word)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from llmgw_core.events import ReplicaRecord
from llmgw_core.sim._words import _tokens
from llmgw_gateway import Proxy, Table
from tests.gateway_support import Served, answers_health, proxy_over, serve_proxy
from tests.test_gateway import metric
from tests.test_gateway_api import CHAT, sim_engines
from tests.test_gateway_continuation import stream, text_of
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

BODY = {"model": "chat", "messages": CHAT, "max_tokens": 12}


def unbroken(messages: Any, n: int) -> str:
    """What an unbroken sim replica answers to `messages` in `n` tokens."""
    return " ".join(_tokens(json.dumps(messages, sort_keys=True), n))


def record(i: int, url: str, fingerprint: str = "x", state: str = "ready") -> ReplicaRecord:
    return ReplicaRecord(
        deployment="chat",
        replica=f"r{i}",
        profile="tiny" if fingerprint == "x" else "tiny-v2",
        profile_fp=fingerprint,
        state=state,  # type: ignore[arg-type]
        url=url,
        engine="sim",
    )


@asynccontextmanager
async def traced_proxy(urls: list[str], spans: InMemorySpanExporter) -> AsyncIterator[Served]:
    """`proxy_over`, its spans kept in `spans`."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    table = Table()
    for i, url in enumerate(urls):
        table.set_replica(f"chat.r{i}", record(i, url))
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            await eventually(lambda url=url: answers_health(client, url), timeout=30, interval=0.1)
        async with (
            Proxy(table, client, tracer=provider.get_tracer("test")) as proxy,
            anyio.create_task_group() as tg,
        ):
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            yield Served(f"http://127.0.0.1:{port}", proxy, table, client)
            tg.cancel_scope.cancel()


async def requests_of(client: httpx.AsyncClient, url: str) -> float:
    return metric((await client.get(f"{url}/metrics")).text, "llmgw_sim_requests_total")


async def test_a_continuation_goes_only_to_a_replica_of_the_same_profile_fingerprint() -> None:
    """Mid-rollout: r0 (fingerprint x) dies after 3 tokens; r1 is of another profile (y) and
    idle, r2 of x: the rest comes from r2, never r1, and the text is the unbroken answer."""
    with sim_engines(["--die-after-chunks", "3"], [], []) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            gw.table.set_replica("chat.r1", record(1, urls[1], fingerprint="y"))
            got = await stream(raw, gw.url, "/v1/chat/completions", BODY)
            assert not any("error" in e for e in got if isinstance(e, dict)), got
            assert text_of(got, chat=True) == unbroken(CHAT, 12)
            assert await requests_of(raw, urls[1]) == 0
            assert await requests_of(raw, urls[2]) == 1


async def test_with_no_replica_of_the_same_fingerprint_the_stream_ends_saying_so() -> None:
    with sim_engines(["--die-after-chunks", "3"], []) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            gw.table.set_replica("chat.r1", record(1, urls[1], fingerprint="y"))
            got = await stream(raw, gw.url, "/v1/chat/completions", BODY)
            assert got[-1] == "[DONE]"
            assert text_of(got[:-2], chat=True) == unbroken(CHAT, 3)
            assert got[-2]["error"]["message"].endswith(
                "continuing it on another replica was tried and could not be: deployment chat has no "
                "other ready replica of the same model and weights (profile fingerprint x): r1 of "
                "another profile cannot continue it"
            ), got[-2]
            assert await requests_of(raw, urls[1]) == 0
            scrape = (await raw.get(f"{gw.url}/metrics")).text
            continued = 'llmgw_gateway_continued_total{cause="connection_lost",deployment="chat"}'
            assert metric(scrape, continued, 0) == 0


@pytest.mark.parametrize(
    ("args", "cause"),
    [(["--die-after-chunks", "4"], "connection_lost"), (["--error-after-chunks", "4"], "error_event")],
)
async def test_a_continuation_is_counted_by_cause_timed_at_its_seam_and_a_span_of_the_request(
    args: list[str], cause: str
) -> None:
    spans = InMemorySpanExporter()
    with sim_engines(args, []) as urls:
        async with traced_proxy(urls, spans) as gw, httpx.AsyncClient(timeout=30) as raw:
            got = await stream(raw, gw.url, "/v1/chat/completions", BODY)
            assert text_of(got, chat=True) == unbroken(CHAT, 12)
            scrape = (await raw.get(f"{gw.url}/metrics")).text
    labels = f'{{cause="{cause}",deployment="chat"}}'
    assert metric(scrape, f"llmgw_gateway_continued_total{labels}") == 1
    assert metric(scrape, 'llmgw_gateway_continuation_seam_seconds_count{deployment="chat"}') == 1
    seam = metric(scrape, 'llmgw_gateway_continuation_seam_seconds_sum{deployment="chat"}')
    assert 0 < seam < 5
    finished = spans.get_finished_spans()
    [server] = [s for s in finished if s.kind == SpanKind.SERVER]
    [continuation] = [s for s in finished if s.name == "continuation"]
    assert continuation.parent is not None
    assert continuation.parent.span_id == server.context.span_id
    assert continuation.context.trace_id == server.context.trace_id
    assert continuation.attributes is not None
    assert dict(continuation.attributes) == {
        "llmgw.deployment": "chat",
        "llmgw.continuation.cause": cause,
        "llmgw.replica": "chat.r0",
        "llmgw.continuation.replica": "chat.r1",
        "llmgw.continuation.tokens_before": 4,
        "llmgw.continuation.seam_s": pytest.approx(seam),
    }
    assert continuation.status.status_code != StatusCode.ERROR


async def test_a_continuation_none_takes_is_a_span_in_error_saying_why() -> None:
    spans = InMemorySpanExporter()
    with sim_engines(["--die-after-chunks", "3"]) as urls:
        async with traced_proxy(urls, spans) as gw, httpx.AsyncClient(timeout=30) as raw:
            got = await stream(raw, gw.url, "/v1/chat/completions", BODY)
            assert "error" in got[-2]
            scrape = (await raw.get(f"{gw.url}/metrics")).text
    [continuation] = [s for s in spans.get_finished_spans() if s.name == "continuation"]
    assert continuation.status.status_code == StatusCode.ERROR
    assert continuation.status.description == "deployment chat has no other ready replica"
    assert metric(scrape, 'llmgw_gateway_continuation_seam_seconds_count{deployment="chat"}', 0) == 0


async def test_a_draining_replica_hands_its_streams_over_at_once() -> None:
    """Two replicas at 5 tokens a second, four 30-token streams (6 s each) in flight; r0 turns
    `draining` (as the gateway reads it from the replicas bucket) once each has a few tokens:
    r0's streams go on on r1 within a token's time, so nothing is in flight on r0 (what the
    gateway reports to placement, which then stops it) long before the answers end; every
    client gets its whole answer, word for word, with no error."""
    tps = ["--tokens-per-second", "5"]
    prompts = [[{"role": "user", "content": f"tell story {i}"}] for i in range(4)]
    with sim_engines(tps, tps) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=60) as raw:
            results: dict[int, list[Any]] = {}

            async def one(i: int) -> None:
                body = {"model": "chat", "messages": prompts[i], "max_tokens": 30}
                results[i] = await stream(raw, gw.url, "/v1/chat/completions", body)

            async with anyio.create_task_group() as tg:
                for i in range(4):
                    tg.start_soon(one, i)
                await eventually(lambda: gw.table.outstanding["chat.r0"] == 2, timeout=10, interval=0.05)
                await anyio.sleep(1.0)  # a few tokens each
                on_r0 = gw.table.outstanding["chat.r0"]
                gw.table.set_replica("chat.r0", record(0, urls[0], state="draining"))
                drained_at = time.monotonic()
                await eventually(lambda: gw.table.outstanding["chat.r0"] == 0, timeout=10, interval=0.02)
                handover = time.monotonic() - drained_at
                answers_left = not results
            scrape = (await raw.get(f"{gw.url}/metrics")).text
    assert handover < 1.5, handover
    assert answers_left, "the answers ran to their end before the drain was done"
    for i, got in results.items():
        assert got[-1] == "[DONE]"
        assert not any("error" in e for e in got if isinstance(e, dict)), got
        assert text_of(got, chat=True) == unbroken(prompts[i], 30)
        assert len({e["id"] for e in got[:-1]}) == 1
    assert metric(scrape, 'llmgw_gateway_continued_total{cause="drained",deployment="chat"}') == on_r0
    assert metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="upstream_stream"}', 0) == 0
