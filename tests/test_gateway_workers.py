"""`http: workers: 2`: one `llmgw-gateway` process supervising two workers on one port, on the
session's NATS (the `gateway` identity, keys required), in front of a real sim engine. What
an operator sees: both workers answer (their demand reports, `llmgw_gateway_info` in their
scrapes), a key's limit holds across them, a killed worker is started again, and SIGTERM to
the supervisor ends them all."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import loads
from llmgw_core.errors import ConfigError
from llmgw_core.events import Demand
from llmgw_core.keys import WINDOW_S
from llmgw_gateway import GatewayConfig
from llmgw_gateway.config import worker_count
from llmgw_gateway.workers import STABLE_S, next_delay
from tests.cluster_support import Cluster, cluster
from tests.gateway_support import gateway_process
from tests.test_gateway_api import sim_engines
from tests.test_gateway_hold import demand_reports, of
from tests.test_gateway_keys import chat, early_in_a_minute, new_key, serve_chat_and_other
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

STARTED = re.compile(r"worker (\d+) started \(pid (\d+)\)")


@dataclass
class Workers:
    c: Cluster
    url: str
    supervisor: subprocess.Popen[bytes]
    log: Path
    secret: str
    heard: list[tuple[str, Demand]]

    def pids(self) -> dict[int, int]:
        """Each worker's pid, as the supervisor's log last said it started."""
        return {int(k): int(pid) for k, pid in STARTED.findall(self.log.read_text())}


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, its exit not yet collected, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


async def answered(url: str, secret: str, n: int) -> list[int]:
    """The status of `n` requests, each on a connection of its own."""
    statuses = []
    for _ in range(n):
        async with httpx.AsyncClient(timeout=30) as fresh:
            r = await fresh.post(
                f"{url}/v1/chat/completions",
                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                headers={"Authorization": f"Bearer {secret}"},
            )
            statuses.append(r.status_code)
    return statuses


INFO = re.compile(r'^llmgw_gateway_info\{id="([^"]+)",worker="(\d+)"\} 1\.0$', re.MULTILINE)


async def scrape(url: str, secret: str) -> str:
    """One scrape of /metrics, on a fresh connection (the kernel gives it to either worker)."""
    async with httpx.AsyncClient(timeout=10) as fresh:
        r = await fresh.get(f"{url}/metrics", headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 200, r.text
    return r.text


def workers_in(text: str) -> dict[str, str]:
    """The workers a scrape holds series of: worker index -> its demand id."""
    return {k: gateway for gateway, k in INFO.findall(text)}


def summed(text: str, series: str) -> float:
    """`series` (a name and its labels but `worker`) summed over the workers."""
    name, _, labels = series.partition("{")
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and re.search(r'worker="\d+"', line):
            own = re.sub(r',?worker="\d+"', "", line.partition("{")[2].partition("}")[0])
            if own == labels.rstrip("}"):
                total += float(line.rpartition(" ")[2])
    return total


@pytest.fixture(scope="module")
async def workers(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Workers]:
    root = tmp_path_factory.mktemp("workers")
    prefix = "t" + uuid.uuid4().hex[:10]
    bus = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test")
    await bus.ensure()
    try:
        with (
            cluster(root, nats_url, prefix) as c,
            sim_engines([]) as (engine,),
            gateway_process(c, root / "gateway", http={"workers": 2}) as gateway,
        ):
            url, supervisor = await gateway.endpoint(), gateway.proc
            await serve_chat_and_other(bus, engine)
            secret = new_key(c, "probe")
            async with demand_reports(c) as heard:
                yield Workers(c, url, supervisor, root / "gateway" / "gateway.log", secret, heard)
    finally:
        await bus.close()


async def known_to_every_worker(url: str, secret: str) -> None:
    """Wait until 10 requests in a row on fresh connections find `secret` known (its
    `/v1/models`, which spends nothing of its limits): each worker heard of the key."""

    async def known() -> bool:
        for _ in range(10):
            async with httpx.AsyncClient(timeout=10) as fresh:
                r = await fresh.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
            assert r.status_code == 200, r.text
        return True

    await eventually(known, timeout=30, interval=0.1)


async def test_both_workers_answer_on_one_port_each_reporting_its_own_demand(workers: Workers) -> None:
    log = workers.log.read_text()
    assert re.search(r"OpenAI endpoint on http://127\.0\.0\.1:\d+/v1 \(2 workers\)", log), log
    assert log.count("OpenAI endpoint on") == 1, log
    pids = workers.pids()
    assert sorted(pids) == [0, 1], log
    assert workers.supervisor.pid not in pids.values(), log

    await known_to_every_worker(workers.url, workers.secret)
    assert await answered(workers.url, workers.secret, 40) == [200] * 40

    # The kernel spread the connections: both workers report arrivals, each as `<id>-w<K>`.
    def arrivals_from_both() -> set[str]:
        ids = {r.gateway for _, r in workers.heard if (d := of(r)) is not None and d.arrived > 0}
        assert len(ids) == 2, ids
        return ids

    ids = await eventually(arrivals_from_both, timeout=10)
    bases = {i.rpartition("-w")[0] for i in ids}
    assert len(bases) == 1, ids
    assert sorted(i.rpartition("-")[2] for i in ids) == ["w0", "w1"], ids
    assert {f"{workers.c.prefix}.demand.{i}" for i in ids} <= {s for s, _ in workers.heard}
    # Whichever worker a scrape reaches, it holds both workers' series, each labelled.
    for _ in range(6):
        text = await scrape(workers.url, workers.secret)
        assert set(workers_in(text).values()) == ids, text
        assert "llmgw_gateway_workers_unscraped 0.0" in text
        assert summed(text, 'llmgw_gateway_requests_total{deployment="chat"}') >= 40, text


async def test_every_scrape_counts_every_workers_requests(workers: Workers) -> None:
    before = await scrape(workers.url, workers.secret)
    series = 'llmgw_gateway_requests_total{deployment="chat"}'
    assert await answered(workers.url, workers.secret, 30) == [200] * 30
    # Scrapes landing on either worker read the same total, 30 more than before.
    totals = {summed(await scrape(workers.url, workers.secret), series) for _ in range(8)}
    assert totals == {summed(before, series) + 30}, totals


async def test_a_keys_rpm_limit_holds_across_the_workers(workers: Workers) -> None:
    limit = 6
    secret = new_key(workers.c, "rpm6", "--rpm", str(limit))
    await known_to_every_worker(workers.url, secret)
    await early_in_a_minute(15)
    # Each request on a connection of its own: the kernel spreads them over the workers.
    statuses = await answered(workers.url, secret, limit + 12)
    served = statuses.count(200)
    # Never past the limit; one short at most: a worker may hold one claimed request unserved
    # when the minute's last is spent (budgets.py: (gateways - 1) x chunk, chunk 1 here).
    assert limit - 1 <= served <= limit, statuses
    assert statuses.count(429) == len(statuses) - served, statuses
    with pytest.raises(openai.RateLimitError) as over:
        await chat(workers.url, secret)
    assert 1 <= int(over.value.response.headers["retry-after"]) <= WINDOW_S
    assert over.value.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    # What the workers counted adds up to what was served.
    text = await scrape(workers.url, workers.secret)
    assert summed(text, 'llmgw_gateway_key_requests_total{deployment="chat",key="rpm6"}') == served, text


async def test_a_killed_worker_is_started_again_and_the_port_keeps_answering(workers: Workers) -> None:
    before = workers.pids()
    os.kill(before[1], signal.SIGKILL)
    killed = f"worker 1 (pid {before[1]}) was killed by signal SIGKILL"
    await eventually(lambda: killed in workers.log.read_text(), timeout=10)
    # The other worker answers meanwhile; the new one joins.
    assert await answered(workers.url, workers.secret, 10) == [200] * 10
    after = await eventually(lambda: (p := workers.pids())[1] != before[1] and p, timeout=10)
    assert after[0] == before[0]
    assert alive(after[1])
    await eventually(
        lambda: f"worker 1 (pid {after[1]}) serves" in workers.log.read_text(), timeout=30, interval=0.1
    )
    await known_to_every_worker(workers.url, workers.secret)
    assert await answered(workers.url, workers.secret, 20) == [200] * 20
    assert sorted(workers_in(await scrape(workers.url, workers.secret))) == ["0", "1"]


async def test_sigterm_to_the_supervisor_ends_every_worker(workers: Workers) -> None:
    # Last in this file: it stops the module's gateway.
    pids = workers.pids()
    assert all(alive(p) for p in pids.values())
    workers.supervisor.send_signal(signal.SIGTERM)
    assert workers.supervisor.wait(30) == 0, workers.log.read_text()
    assert not [p for p in pids.values() if alive(p)]
    assert "SIGTERM: stopping 2 workers" in workers.log.read_text()


async def test_workers_stop_when_their_supervisor_is_killed(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # One worker by its config, two by the command line.
    with (
        cluster(tmp_path, nats_url, prefix) as c,
        gateway_process(c, tmp_path, args=("--workers", "2")) as gateway,
    ):
        await gateway.endpoint()
        sup = gateway.proc
        log = tmp_path / "gateway.log"
        assert "(2 workers)" in log.read_text()
        sup.kill()
        sup.wait()
        pids = [int(pid) for _, pid in STARTED.findall(log.read_text())]
        assert len(pids) == 2
        try:
            await eventually(lambda: not [p for p in pids if alive(p)], timeout=10)
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        assert log.read_text().count(f"the workers' supervisor (pid {sup.pid}) is gone: stopping") == 2


def test_workers_below_zero_are_refused_naming_the_key_and_zero_is_one_per_cpu() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.yaml.*http: workers is -1; give the number"):
        loads("http: {workers: -1}\n", GatewayConfig, source="gateway.yaml")
    assert worker_count(0) == len(os.sched_getaffinity(0))
    assert worker_count(1) == 1
    refused = subprocess.run(
        [sys.executable, "-m", "llmgw_gateway", "--config", "gateway.yaml", "--workers", "-2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "--workers -2: give the number of gateway processes (0: one per CPU)" in refused.stderr


def test_a_worker_that_keeps_dying_waits_longer_each_time_and_one_that_lived_starts_at_once() -> None:
    delays = [0.0]
    for _ in range(7):
        # Each died 1 s after its start.
        delays.append(next_delay(delays[-1], 1.0))
    assert delays[1:] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    # Up for STABLE_S: well again, the first pause.
    assert next_delay(10.0, STABLE_S) == 0.5
