"""Outlier detection in the gateway: replicas judged by their answers (outliers.py), pure with a
hand-turned clock, then through a real proxy in front of sim engines, one of them answering
every completion 500 while its /health says 200 (a GPU in a bad state)."""

from __future__ import annotations

import json
import time

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.events import JUDGEMENT_WORDS_MAX, ReplicaRecord
from llmgw_gateway import Table
from llmgw_gateway.config import OutliersConfig
from llmgw_gateway.outliers import Outliers, words_of
from tests.gateway_support import proxy_over
from tests.test_gateway_api import sim_engines

CUDA = "CUDA error: an illegal memory access was encountered"
CUDA_BODY = json.dumps({"error": {"message": CUDA, "type": "InternalServerError", "code": 500}}).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def outliers(**config: object) -> tuple[Outliers, Clock]:
    clock = Clock()
    return Outliers(OutliersConfig(**config), clock), clock  # type: ignore[arg-type]


def fail(o: Outliers, key: str = "chat.r0", n: int = 1, size: int = 2, status: int = 500) -> list[bool]:
    deployment, _, replica = key.partition(".")
    return [o.record(key, deployment, replica, status, CUDA, size) for _ in range(n)]


def test_five_5xx_in_a_row_take_a_replica_out_for_longer_each_time() -> None:
    o, clock = outliers(base_ejection_s=30, max_ejection_s=70)
    assert fail(o, n=5) == [False, False, False, False, True]
    assert o.ejected(["chat.r0", "chat.r1"]) == {"chat.r0"}
    clock.now += 29.9
    assert o.ejected(["chat.r0"]) == {"chat.r0"}
    clock.now += 0.2
    assert o.ejected(["chat.r0"]) == frozenset()
    # Back in routing it gets five tries again; the second ejection is twice as long.
    assert fail(o, n=5)[-1] is True
    clock.now += 59.9
    assert o.ejected(["chat.r0"]) == {"chat.r0"}
    clock.now += 0.2
    assert o.ejected(["chat.r0"]) == frozenset()
    # The third would be 90 s: capped at max_ejection_s.
    assert fail(o, n=5)[-1] is True
    clock.now += 70.1
    assert o.ejected(["chat.r0"]) == frozenset()


def test_a_4xx_is_the_clients_and_a_success_breaks_the_run() -> None:
    o, _ = outliers()
    for _ in range(20):
        fail(o, n=4)
        assert fail(o, status=200) == [False]
        assert fail(o, n=10, status=400) == [False] * 10
    assert o.ejected(["chat.r0"]) == frozenset()


def test_no_answer_counts_as_a_failure() -> None:
    o, _ = outliers()
    assert fail(o, n=5, status=0)[-1] is True


def test_a_low_success_rate_over_the_window_takes_it_out() -> None:
    o, clock = outliers(consecutive_failures=0, min_requests=10, min_success_rate=0.5, window_s=10)
    said = []
    for i in range(10):
        clock.now += 0.5
        said += fail(o, status=200 if i % 3 == 1 else 500)  # 7 of 10 fail
    assert said == [False] * 9 + [True]
    # The same share over a window that saw fewer than min_requests: not judged.
    o2, clock2 = outliers(consecutive_failures=0, min_requests=10, min_success_rate=0.5, window_s=10)
    for i in range(9):
        clock2.now += 2
        fail(o2, status=500 if i % 3 else 200)
    assert o2.ejected(["chat.r0"]) == frozenset()


def test_never_the_last_replica_and_at_most_the_share_allowed() -> None:
    o, _ = outliers(max_ejection_percent=50)
    assert fail(o, n=50, size=1) == [False] * 50
    # Not out, but failing all the same: placement is told.
    (row,) = o.judgements()
    assert (row.failing, row.ejected, row.failed, row.status, row.words) == (True, False, 50, 500, CUDA)
    o, _ = outliers(max_ejection_percent=50)
    for i in range(4):
        fail(o, f"chat.r{i}", n=5, size=4)
    assert o.out("chat") == 2
    assert o.ejected([f"chat.r{i}" for i in range(4)]) == {"chat.r0", "chat.r1"}
    assert [o.limit(n) for n in (1, 2, 10)] == [0, 1, 5]
    assert outliers(max_ejection_percent=0)[0].limit(3) == 1
    assert outliers(max_ejection_percent=100)[0].limit(3) == 2


def test_judgements_say_the_counts_and_words_then_once_more_with_zeros() -> None:
    o, clock = outliers(window_s=10)
    fail(o, status=200)
    clock.now += 1
    fail(o, n=3)
    clock.now += 7
    fail(o, n=2)
    (row,) = o.judgements()
    assert (row.deployment, row.replica, row.requests, row.failed, row.consecutive) == ("chat", "r0", 6, 5, 5)
    assert (row.failing, row.ejected) == (True, True)
    assert row.failing_for_s == pytest.approx(7)
    clock.now += 10.5
    (row,) = o.judgements()
    assert (row.requests, row.failed, row.failing) == (0, 0, False)
    assert o.judgements() == ()
    o.forget("chat.r0")
    assert (o._replicas, o._of) == ({}, {})


def test_words_are_the_engines_own_one_line_cut_short() -> None:
    assert words_of(500, CUDA_BODY) == CUDA
    assert words_of(503, b'{"detail": "model is\\nloading"}') == "model is loading"
    assert words_of(502, b"Bad Gateway\r\n<html>") == "Bad Gateway <html>"
    assert words_of(500, b"") == "HTTP 500"
    assert words_of(0, b"") == "no answer"
    long = words_of(500, json.dumps({"error": {"message": "x" * 10_000}}).encode())
    assert len(long) == JUDGEMENT_WORDS_MAX
    assert long.endswith("…")


@settings(max_examples=300, deadline=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=40_000), st.integers(min_value=0, max_value=999))
def test_words_of_any_body_are_one_bounded_line(body: bytes, status: int) -> None:
    started = time.perf_counter()
    line = words_of(status, body)
    assert 0 < len(line) <= JUDGEMENT_WORDS_MAX
    assert line.isprintable(), "one line of printable characters"
    assert time.perf_counter() - started < 0.1


@settings(max_examples=200, deadline=500)
@given(
    st.lists(
        st.tuples(
            st.integers(min_value=0, max_value=5),  # replica
            st.sampled_from([0, 200, 404, 500, 503]),
            st.floats(min_value=0, max_value=20),  # seconds since the last
        ),
        max_size=300,
    ),
    st.integers(min_value=1, max_value=6),
    st.integers(min_value=0, max_value=100),
)
def test_outcomes_in_any_order_never_take_every_replica_out(
    events: list[tuple[int, int, float]], size: int, percent: int
) -> None:
    o, clock = outliers(max_ejection_percent=percent, base_ejection_s=5, max_ejection_s=15)
    keys = [f"chat.r{i}" for i in range(size)]
    for i, status, later in events:
        clock.now += later
        fail(o, keys[i % size], status=status, size=size)
        assert len(o.ejected(keys)) <= o.limit(size) < max(size, 1)
    for row in o.judgements():
        assert 0 <= row.failed <= row.requests
        assert len(row.words) <= JUDGEMENT_WORDS_MAX
    assert len(o._replicas) <= size
    for b in o._replicas.values():
        assert len(b.buckets) <= 10


def record(i: int, url: str = "http://127.0.0.1:9") -> ReplicaRecord:
    return ReplicaRecord(
        deployment="chat", replica=f"r{i}", profile="p", profile_fp="x", state="ready", url=url
    )


def test_the_table_skips_a_replica_out_unless_it_is_the_only_one_left() -> None:
    clock = Clock()
    table = Table(outliers=Outliers(OutliersConfig(), clock))
    for i in range(2):
        table.set_replica(f"chat.r{i}", record(i))
    for _ in range(5):
        table.outcome("chat.r0", 500, CUDA)
    assert {table.pick("chat")[0] for _ in range(6)} == {"chat.r1"}  # type: ignore[index]
    # r1 tried already (a retry): r0, though out, rather than nothing.
    assert table.pick("chat", frozenset({"chat.r1"}))[0] == "chat.r0"  # type: ignore[index]
    clock.now += 31
    assert {table.pick("chat")[0] for _ in range(6)} == {"chat.r0", "chat.r1"}  # type: ignore[index]
    table.set_replica("chat.r0", None)
    assert (table.outliers._replicas, table.outliers._of) == ({}, {})


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_replica_answering_500_is_taken_out_and_the_requests_go_to_the_other() -> None:
    with sim_engines([], ["--fail-completions-after", "0"]) as urls:
        async with proxy_over(urls) as gw:
            gw.table.outliers = Outliers(OutliersConfig(base_ejection_s=60))
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                statuses = []
                body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                for _ in range(20):
                    r = await client.post("/v1/chat/completions", json=body)
                    statuses.append(r.status_code)
                    if r.status_code == 500:
                        assert r.json()["error"]["message"] == CUDA
                # Five failures reached the client (the engine's own 500); then r1 alone answers.
                assert statuses.count(500) == 5
                assert statuses[-10:] == [200] * 10
            assert gw.table.outliers.ejected(["chat.r0", "chat.r1"]) == {"chat.r1"}
            (row,) = gw.table.outliers.judgements()
            assert (row.replica, row.failed, row.failing, row.ejected, row.status, row.words) == (
                "r1",
                5,
                True,
                True,
                500,
                CUDA,
            )


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_the_sim_engine_fails_every_completion_after_the_time_and_stays_healthy() -> None:
    with sim_engines(["--fail-completions-after", "1"]) as (url,):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            started = time.monotonic()
            first = await client.post("/v1/chat/completions", json=chat)
            if time.monotonic() - started < 0.9:  # a loaded machine may be past the second already
                assert first.status_code == 200, first.text
            await anyio.sleep(max(0.0, 1.1 - (time.monotonic() - started)))
            for path, body in (
                ("/v1/chat/completions", chat),
                ("/v1/chat/completions", {**chat, "stream": True}),
                ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
                ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True}),
            ):
                r = await client.post(path, json=body)
                assert (r.status_code, r.json()["error"]["message"]) == (500, CUDA), (path, body)
            assert (await client.get("/health")).status_code == 200
