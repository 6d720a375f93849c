"""A scale down while long streams run, on a real cluster (NATS, placement, launcher, sim
engines at a few tokens a second, a real gateway): the replica drained hands its streams over
to the other, so placement stops it within seconds, not when its longest answer ends (or at
`drain_timeout_s`), and every client gets its whole answer, word for word, with no error."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from llmgw_core.sim._words import _tokens
from tests.cluster_support import cluster, sim_catalog
from tests.test_ctl import ok
from tests.test_gateway import metric
from tests.test_gateway_continuation import events_of, text_of
from tests.test_gateway_hold import gateway
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

# 2.5 tokens a second, 50 tokens: 20 s answers.
TPS, TOKENS = "2.5", 50


async def records(bus: Bus) -> dict[str, ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return {k: c.value for k, c in found.items() if c.value is not None and c.value.deployment == "chat"}


async def test_a_scale_down_hands_the_drained_replicas_streams_over_and_is_done_in_seconds(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    prompts = [[{"role": "user", "content": f"tell story {i}"}] for i in range(6)]
    results: dict[int, bytes] = {}
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement(
            "p1",
            [sim_catalog("--tokens-per-second", TPS)],
            [{"name": "chat", "profile": "tiny", "replicas": 2}],
        )

        async def two_ready() -> bool:
            assert [r.state for r in (await records(bus)).values()] == ["ready", "ready"]
            return True

        await eventually(two_ready, timeout=60, interval=0.3)
        async with gateway(c, demand_interval_s=0.3) as (url, gw), httpx.AsyncClient(timeout=90) as client:
            await eventually(lambda: len(gw.table.ready("chat")) == 2, timeout=20)

            async def one(i: int) -> None:
                body = {"model": "chat", "messages": prompts[i], "max_tokens": TOKENS, "stream": True}
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                    assert r.status_code == 200
                    results[i] = b"".join([chunk async for chunk in r.aiter_raw()])

            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
                await eventually(lambda: sum(gw.table.outstanding.values()) == len(prompts), timeout=10)
                await anyio.sleep(1.0)  # a few tokens each
                before = dict(gw.table.outstanding)
                began = time.monotonic()
                ok(c, "scale", "chat", "--replicas", "1")

                async def one_left() -> str:
                    now = await records(bus)
                    assert len(now) == 1, now
                    return next(iter(now))

                kept = await eventually(one_left, timeout=30, interval=0.1)
                drained_in = time.monotonic() - began
                left_running = len(results) == 0
            scrape = (await client.get(f"{url}/metrics")).text
    gone = [k for k in before if k != kept]
    assert len(gone) == 1, (before, kept)
    assert before[gone[0]] > 0, (before, kept)
    # The drain was done while every answer still had seconds to run: no stream was waited out.
    assert left_running, f"the answers ended before the drain ({drained_in:.1f} s): nothing was handed over"
    for i, raw in results.items():
        got = events_of(raw)
        assert got[-1] == "[DONE]"
        assert not any("error" in e for e in got if isinstance(e, dict)), got
        assert text_of(got, chat=True) == " ".join(_tokens(json.dumps(prompts[i], sort_keys=True), TOKENS))
    # Each stream of the drained replica was continued once: handed over at an event boundary
    # (`drained`), or, where the replica stopped before the gateway's next event from it (a
    # loaded machine), continued as a lost connection; either way the client saw one answer.
    handed = metric(scrape, 'llmgw_gateway_continued_total{cause="drained",deployment="chat"}', 0)
    lost = metric(scrape, 'llmgw_gateway_continued_total{cause="connection_lost",deployment="chat"}', 0)
    assert handed + lost == before[gone[0]], (handed, lost, before)
    # A stream that broke off is counted as the replica's failure, continued or not: here only
    # the ones the replica stopped before their handover, each continued.
    broke = metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="upstream_stream"}', 0)
    assert broke == lost, (broke, handed, lost)
