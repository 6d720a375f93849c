"""Replicas judged by their answers, placement's side (judged.py): the gateways' judgements
summed, a replica marked unhealthy in their words, written `degraded`, and restarted after
unhealthy_restart_s by the path that places again a replica its node cannot run; and every
byte of a judgement read as a hostile gateway identity could write it."""

from __future__ import annotations

import time

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.events import JUDGEMENT_WORDS_MAX, Judgement, ReplicaJudgement, ShardStatus
from llmgw_placement.judged import GATEWAYS_MAX, JudgedBook, Marked, bounded, hear, judged, restart_words
from llmgw_placement.plan import Plan
from llmgw_placement.reconcile import Snapshot, reconcile
from tests.test_reconcile import NOW, TP1, World, placed_on, removed
from tests.waiting import eventually

CUDA = "CUDA error: an illegal memory access was encountered"


def row(replica: str = "r0", **fields: object) -> ReplicaJudgement:
    said: dict[str, object] = {
        "requests": 6,
        "failed": 6,
        "consecutive": 6,
        "failing_for_s": 8.0,
        "failing": True,
        "status": 500,
        "words": CUDA,
    }
    return msgspec.convert({"deployment": "chat", "replica": replica, **said, **fields}, ReplicaJudgement)


def report(gateway: str, *rows: ReplicaJudgement, at: float = 0.0) -> Judgement:
    return Judgement(gateway=gateway, replicas=rows, interval_s=1.0, at=at)


def test_two_gateways_judgements_are_summed_into_the_engines_words() -> None:
    book = JudgedBook()
    book.heard(report("gw-a", row(failing_for_s=7.6)), NOW)
    book.heard(report("gw-b", row(), at=1.0), NOW)
    (verdict,) = book.verdicts(NOW + 0.5).values()
    assert verdict.text() == f"unhealthy: 12 of 12 requests failed in 8 s: 500 {CUDA}"
    # A gateway's report replaces its own last one; one silent for 3 intervals is forgotten.
    book.heard(report("gw-a", row(requests=2, failed=2)), NOW + 2)
    assert book.verdicts(NOW + 2)["chat.r0"].failed == 8
    assert book.verdicts(NOW + 4.5)["chat.r0"].failed == 2
    assert book.verdicts(NOW + 6) == {}
    assert row(status=0, words="connection refused").words  # no answer reads so:
    book.heard(report("gw-c", row(status=0, words="connection refused")), NOW + 10)
    assert book.verdicts(NOW + 10)["chat.r0"].text().endswith("in 8 s: no answer: connection refused")


def test_a_mark_holds_until_the_replica_goes_or_answers_again() -> None:
    w = World({"n0": 1})
    held = {"chat.r0": w.holds("r0", "n0", state="ready")}
    book = JudgedBook()
    book.heard(report("gw-a", row(failing=False, failed=2, requests=9)), NOW)
    assert book.mark(NOW, held) == {}, "a few failures judged not failing: no mark"
    book.heard(report("gw-a", row()), NOW + 1)
    marked = book.mark(NOW + 1, held)
    assert marked == {"chat.r0": Marked(NOW + 1, f"unhealthy: 6 of 6 requests failed in 8 s: 500 {CUDA}")}
    # No report (no gateway sends it requests now): the mark holds, its words as first said.
    book.heard(report("gw-a", row(requests=60, failed=60)), NOW + 2)
    assert book.mark(NOW + 30, held) == marked
    # A gateway sees it answer without a failure: no longer unhealthy.
    book.heard(report("gw-a", row(requests=3, failed=0, failing=False)), NOW + 31)
    assert book.mark(NOW + 31, held) == {}
    book.heard(report("gw-a", row()), NOW + 32)
    assert book.mark(NOW + 32, held) != {}
    assert book.mark(NOW + 32, {}) == {}, "the replica gone, its mark goes"


def test_a_marked_record_is_degraded_in_its_words_and_restarted_after_the_time() -> None:
    w = World({"n0": 1})
    record = w.holds("r0", "n0", state="ready")
    words = f"unhealthy: 12 of 12 requests failed in 8 s: 500 {CUDA}"
    mark = Marked(NOW, words)
    assert judged(record, None, None, 5.0) is None
    degraded = judged(record, None, mark, 5.0)
    assert degraded is not None
    assert (degraded.state, degraded.reason, degraded.since) == ("degraded", words, 5.0)
    assert judged(degraded, None, mark, 6.0) is None, "as held: nothing to write"
    assert judged(degraded, record, mark, 6.0) is None, "its shards still say ready: as held"
    assert restart_words(degraded, mark, 60, NOW + 59.9) == ""
    assert restart_words(degraded, mark, 60, NOW + 60) == (
        f"restarted: unhealthy for 60 s: 12 of 12 requests failed in 8 s: 500 {CUDA}"
    )
    assert restart_words(record, mark, 60, NOW + 60) == "", "only a replica marked degraded"


def step(w: World, at: float, unhealthy: dict[str, Marked]) -> Plan:
    w.state.last_seen["n0"] = at  # its launcher beats on
    alive = w.index.refresh(at)
    snap = Snapshot(
        deployments=dict(w.deployments),
        catalog=dict(w.catalog),
        shard_status=dict(w.shard_status),
        nodes=dict(w.state.nodes),
        alive=alive,
        liveness=w.liveness,
        config=w.config,
        unhealthy=unhealthy,
        wall=at,
    )
    plan = reconcile(snap, w.held, w.index, at)
    w.landed(plan)
    return plan


def test_reconcile_writes_the_replica_degraded_then_replaces_it() -> None:
    w = World({"n0": 1}, unhealthy_restart_s=60)
    w.holds("r0", "n0", state="ready")
    w.shard_status["n0.chat-r0-0"] = msgspec.convert(
        {
            "node": "n0",
            "shard": "chat-r0-0",
            "replica": "r0",
            "profile_fp": TP1.fingerprint(),
            "state": "ready",
            "url": "http://n0:1",
        },
        ShardStatus,
    )
    w.deploy(replicas=1)
    assert step(w, NOW, {}).saves[0].after.state == "ready"
    words = f"unhealthy: 12 of 12 requests failed in 8 s: 500 {CUDA}"
    unhealthy = {"chat.r0": Marked(NOW + 1, words)}
    [save] = step(w, NOW + 1, unhealthy).saves
    assert (save.after.state, save.after.reason) == ("degraded", words)
    assert step(w, NOW + 30, unhealthy).saves == [], "the mark as held: nothing written again"
    plan = step(w, NOW + 61, unhealthy)
    assert removed(plan) == [
        ("r0", "failed", f"restarted: unhealthy for 60 s: 12 of 12 requests failed in 8 s: 500 {CUDA}")
    ]
    assert placed_on(plan) == [("n0",)]


def test_a_hostile_judgement_is_bounded() -> None:
    bad = Judgement(
        gateway="gw",
        replicas=(
            row(words="line one\nline\x00two\x1b[31m"),
            row(),  # named twice: dropped
            row("r1"),
        ),
        interval_s=float("inf"),
    )
    b = bounded(bad)
    assert b.interval_s == 60.0
    assert [(r.replica, r.words) for r in b.replicas] == [("r0", "line one line two [31m"), ("r1", CUDA)]
    assert bounded(Judgement(gateway="gw", interval_s=-5)).interval_s > 0
    book = JudgedBook()
    for i in range(GATEWAYS_MAX):
        book.reports[f"g{i}"] = (Judgement(gateway=f"g{i}"), NOW)
    assert book.heard(report("one-too-many", row()), NOW) is False
    assert book.heard(report("g1", row()), NOW) is True
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(
            msgspec.json.encode(report("gw", row(words="x" * (JUDGEMENT_WORDS_MAX + 1)))), type=Judgement
        )


_DECODE = msgspec.json.Decoder(Judgement)
_FIELDS = st.fixed_dictionaries(
    {
        "deployment": st.text(max_size=70),
        "replica": st.text(max_size=10),
        "requests": st.integers(min_value=-1, max_value=2**40),
        "failed": st.integers(min_value=-1, max_value=2**40),
        "failing_for_s": st.floats(allow_nan=True),
        "failing": st.booleans(),
        "status": st.integers(min_value=-1, max_value=1000),
        "words": st.text(max_size=400),
    }
)


@settings(max_examples=300, deadline=500, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=2000),
        st.builds(
            lambda rows, interval: msgspec.json.encode(
                {"kind": "Judgement", "gateway": "gw", "replicas": rows, "interval_s": interval}
            ),
            st.lists(_FIELDS, max_size=20),
            st.floats(allow_nan=True, allow_infinity=True),
        ),
    )
)
def test_any_bytes_on_the_subject_are_a_judgement_bounded_or_msgspecs_error(raw: bytes) -> None:
    started = time.perf_counter()
    try:
        judgement = _DECODE.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return
    book = JudgedBook()
    assert book.heard(judgement, NOW)
    for verdict in book.verdicts(NOW).values():
        assert 0 <= verdict.failed <= 20 * 1_000_000_000
        assert len(verdict.text()) < 2 * JUDGEMENT_WORDS_MAX
        assert "\n" not in verdict.text()
    assert 0 < book.reports["gw"][0].interval_s <= 60
    assert time.perf_counter() - started < 0.2


@pytest.mark.anyio
async def test_two_gateways_on_the_bus_are_summed_and_bytes_that_are_no_judgement_cost_only_themselves(
    bus: Bus,
) -> None:
    book = JudgedBook()
    async with anyio.create_task_group() as tg:
        await tg.start(hear, bus, book)
        await bus.nc.publish(bus.names.judgement("gw-x"), b"\xff not a judgement")
        for gateway in ("gw-a", "gw-b"):
            # The payload names another gateway: the subject's is the one kept.
            await bus.publish_core(bus.names.judgement(gateway), report("gw-liar", row(), at=1.0))

        def summed() -> str:
            assert sorted(book.reports) == ["gw-a", "gw-b"]
            return book.verdicts(time.monotonic())["chat.r0"].text()

        said = await eventually(summed, timeout=10, interval=0.05)
        assert said == f"unhealthy: 12 of 12 requests failed in 8 s: 500 {CUDA}"
        tg.cancel_scope.cancel()
