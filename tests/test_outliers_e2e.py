"""A replica whose engine answers `/health` 200 and every completion 500 (a GPU in a bad state:
"CUDA error: an illegal memory access was encountered"), through the real path: NATS,
placement, a node's installer and launcher running the sim engine with
`--fail-completions-after 1`, and a gateway process. The gateway judges the replica by its
answers and tells placement; placement marks it `degraded` in the engine's own words on
every surface (the summary, `ctl get`, `ctl explain`, the page's JSON, the gateway's 503),
then restarts it after `unhealthy_restart_s`."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord, ReplicaStatus, decoder
from tests.cluster_support import cluster, sim_catalog
from tests.gateway_support import gateway_process
from tests.test_ctl import ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CUDA = "CUDA error: an illegal memory access was encountered"
UNHEALTHY = re.compile(r"unhealthy: (\d+) of (\d+) requests failed in \d+ s: 500 " + re.escape(CUDA))
# Long enough for the surfaces to be read while it is marked (each `ctl` is a process).
RESTART_S = 10


async def record(bus: Bus) -> ReplicaRecord | None:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    mine = sorted((c.value for c in found.values() if c.value and c.value.deployment == "chat"), key=str)
    return mine[0] if len(mine) == 1 else None


async def test_a_replica_failing_every_answer_is_marked_unhealthy_everywhere_and_restarted(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    events: list[ReplicaStatus] = []

    async def on_replica(msg: object) -> None:
        events.append(decoder(ReplicaStatus).decode(msg.data))  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(bus.names.replica_event("chat", "*"), cb=on_replica)
    try:
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_node("node-1", gpus=1)
            c.start_placement(
                "p1",
                [sim_catalog("--fail-completions-after", "1")],
                [{"name": "chat", "profile": "tiny", "replicas": 1}],
                {"unhealthy_restart_s": RESTART_S},
            )
            with gateway_process(
                c,
                tmp_path / "gw",
                http={"require_api_key": False},
                demand_interval_s=0.3,
                hold_timeout_s=0.5,
            ) as gw:
                base = await gw.endpoint()

                async def ready() -> ReplicaRecord:
                    r = await record(bus)
                    assert r is not None
                    assert r.state == "ready", r
                    return r

                first = await eventually(ready, timeout=60, interval=0.3)
                body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                async with httpx.AsyncClient(base_url=base, timeout=30) as client:

                    async def broken() -> bool:
                        # Once its engine has run a second, every answer is its own 500; the
                        # last replica is never taken out of routing, so each gets there.
                        r = await client.post("/v1/chat/completions", json=body)
                        assert r.status_code == 500, r.text
                        return True

                    await eventually(broken, timeout=30, interval=0.2)
                    for _ in range(5):
                        r = await client.post("/v1/chat/completions", json=body)
                        assert (r.status_code, r.json()["error"]["message"]) == (500, CUDA)

                    async def marked() -> ReplicaRecord:
                        r = await record(bus)
                        assert r is not None
                        assert (r.replica, r.state) == (first.replica, "degraded"), r
                        return r

                    degraded = await eventually(marked, timeout=15, interval=0.2)
                    words = UNHEALTHY.fullmatch(degraded.reason)
                    assert words is not None, degraded.reason
                    # Those it answered before its GPU "faulted" count among the requests.
                    assert 6 <= int(words[1]) <= int(words[2])

                    # The gateway: no ready replica, and why, in the engine's words.
                    refused = await client.post("/v1/chat/completions", json=body)
                    assert refused.status_code == 503, refused.text
                    message = refused.json()["error"]["message"]
                    assert f"{first.replica} degraded for " in message, message
                    assert degraded.reason in message, message

                # Placement's summary and `explain`; `ctl get`; the page's JSON.
                explained = ok(c, "explain", "chat")
                assert explained.startswith("chat: 0 of 1 ready; 1 degraded; "), explained
                assert f"{first.replica}: {degraded.reason}" in explained, explained
                got = ok(c, "get", "replicas")
                assert re.search(rf"{first.replica}\s+degraded\s.*unhealthy: ", got), got
                api = re.findall(r"API on (http://\S+)", c.log("placement-p1"))[-1]
                async with httpx.AsyncClient(base_url=api, headers=c.api_headers, timeout=10) as client:
                    page = (await client.get("/api/replicas")).json()
                    (mine,) = [v for v in page.values() if v["deployment"] == "chat"]
                    assert (mine["state"], mine["reason"]) == ("degraded", degraded.reason)

                # Restarted after unhealthy_restart_s, and said so.
                async def restarted() -> ReplicaRecord:
                    r = await record(bus)
                    assert r is not None
                    assert r.replica != first.replica, r
                    return r

                again = await eventually(restarted, timeout=RESTART_S + 20, interval=0.3)
                assert again.state in ("starting", "ready", "degraded"), again
                said = [e for e in events if e.replica == first.replica and e.state == "failed"]
                assert [e.reason for e in said] == [
                    f"restarted: unhealthy for {RESTART_S} s: {degraded.reason.removeprefix('unhealthy: ')}"
                ], events
                assert "restarted: unhealthy" in ok(c, "describe", "deployment", "chat")
    finally:
        await sub.unsubscribe()
