"""Which LoRA adapter a full engine gives back for a new one (`victim`: the least recently used of
those with no request running or waiting), and the engine's word on which are in use, read from
its metrics as hostile bytes (`lora_in_use`: vLLM's `vllm:lora_requests_info`, which the
simulator copies): only the shard's own adapters come out of it, whatever a label holds, and
only the latest series counts."""

from __future__ import annotations

import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from llmgw_core.adapters import ServedAdapter
from llmgw_core.events import ShardStatus
from llmgw_gateway.adapter_loads import AdapterLoads
from llmgw_gateway.adapters import AdapterIndex
from llmgw_gateway.routing import Table
from llmgw_launcher.adapter_loads import all_in_use, passed_over, victim
from llmgw_launcher.load import LOAD_METRICS, lora_in_use

VLLM = "vllm:lora_requests_info"
NAMES = frozenset({"legal", "finance", "tax"})


@pytest.mark.parametrize(
    ("loaded", "recent", "room", "in_use", "expected"),
    [
        # Room left: nothing goes.
        (("a",), (), 2, frozenset(), None),
        # Never used goes before any used; among those, the first loaded.
        (("a", "b", "c"), ("b",), 3, frozenset(), "a"),
        # The least recently used (last in `recent`).
        (("a", "b"), ("a", "b"), 2, frozenset(), "b"),
        # ... unless it is in use: the next least recent goes.
        (("a", "b"), ("a", "b"), 2, frozenset({"b"}), "a"),
        (("a", "b", "c"), ("c",), 3, frozenset({"a"}), "b"),
        # Every one in use: none may go.
        (("a", "b"), ("a", "b"), 2, frozenset({"a", "b"}), None),
        # Over max_loras (every one was in use at the last load): one goes, not in use.
        (("a", "b", "c"), ("c", "b", "a"), 2, frozenset({"a"}), "b"),
    ],
)
def test_the_victim_is_the_least_recently_used_not_in_use(
    loaded: tuple[str, ...], recent: tuple[str, ...], room: int, in_use: frozenset[str], expected: str | None
) -> None:
    assert victim(loaded, recent, room, in_use) == expected


def test_every_adapter_in_use_is_said_by_name_and_those_passed_over_too() -> None:
    assert all_in_use(("tax", "legal")) == (
        "every one of its 2 adapters has requests running or waiting: legal, tax"
    )
    # Only those in use that would have gone before the one chosen are said passed over.
    loaded, recent = ("a", "b", "c"), ("c", "b")
    assert victim(loaded, recent, 3, frozenset({"a", "c"})) == "b"
    assert passed_over(loaded, recent, frozenset({"a", "c"}), "b") == ["a"]
    assert passed_over(loaded, recent, frozenset({"c"}), "a") == []


def test_a_gateway_names_in_flight_the_adapters_it_sent_a_request_a_moment_ago() -> None:
    index = AdapterIndex()
    status = ShardStatus(
        node="n1",
        shard="chat-r0-0",
        replica="r0",
        deployment="chat",
        state="ready",
        adapters=(ServedAdapter(name="legal"), ServedAdapter(name="tax")),
        adapters_loadable=("finance", "legal", "tax"),
    )
    index.observe("n1.chat-r0-0", status)
    index.used("chat.r0", "legal", now=100.0)
    index.used("chat.r0", "tax", now=101.5)
    index.used("chat.r0", "finance", now=101.9)  # not held: a load request names only those held
    assert index.recent("chat.r0") == ("tax", "legal")
    assert index.sent_within("chat.r0", 2.0, now=102.0) == ("tax", "legal")
    assert index.sent_within("chat.r0", 2.0, now=103.0) == ("tax",)
    assert index.sent_within("chat.r0", 2.0, now=104.0) == ()
    assert index.sent_within("chat.r9", 2.0, now=104.0) == ()

    # What a load request names: those, only while the gateway has requests at the replica.
    table = Table()
    table.set_shard_status("n1.chat-r0-0", status)
    loads = AdapterLoads(None, table, in_flight_s=2.0)
    table.adapters.used("chat.r0", "legal")
    assert loads.in_flight("chat.r0") == ()
    table.outstanding["chat.r0"] += 1
    assert loads.in_flight("chat.r0") == ("legal",)


def _vllm_text(steps: list[tuple[str, str]]) -> str:
    """The exposition vLLM writes after these steps (running, waiting adapters each): the gauge as
    vLLM declares and sets it, one series per set of labels, each set to the time."""
    registry = CollectorRegistry()
    gauge = Gauge(
        VLLM,
        "Running stats on lora requests.",
        labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        registry=registry,
    )
    for running, waiting in steps:
        gauge.labels(max_lora="2", waiting_lora_adapters=waiting, running_lora_adapters=running).set(
            time.time()
        )
        time.sleep(0.002)  # each step a later time, as vLLM's steps are
    return generate_latest(registry).decode()


def test_the_latest_series_of_vllm_s_gauge_says_the_adapters_in_use() -> None:
    # Older series stay in the text (vLLM never removes one): only the latest counts.
    text = _vllm_text([("legal", ""), ("legal,finance", "tax"), ("finance", "tax")])
    assert lora_in_use(text, VLLM, NAMES) == {"finance", "tax"}
    # The last step had none: none in use, whatever older series say.
    assert lora_in_use(_vllm_text([("legal", "tax"), ("", "")]), VLLM, NAMES) == frozenset()
    # Names the shard does not have are not kept.
    assert lora_in_use(_vllm_text([("legal,other", "../../x")]), VLLM, NAMES) == {"legal"}
    # An engine without LoRA (or too old) has no gauge: unknown, not "none in use".
    assert lora_in_use("vllm:num_requests_running 1.0\n", VLLM, NAMES) is None


def test_the_simulator_reports_its_adapters_in_use_as_vllm_does() -> None:
    from llmgw_core.sim._app import SimEngine, SimOptions

    engine = SimEngine(SimOptions(max_loras=2))
    engine.loras.loaded.update({"legal": "/a", "tax": "/b"})
    registry = engine._new_registry()
    gauge = LOAD_METRICS["sim"].lora
    assert lora_in_use(generate_latest(registry).decode(), gauge, NAMES) == frozenset()
    engine.loras.began("tax")
    engine.loras.began("tax")
    engine.loras.began("")  # a base request names no adapter
    engine.loras.ended("tax")
    assert lora_in_use(generate_latest(registry).decode(), gauge, NAMES) == {"tax"}
    engine.loras.ended("tax")
    assert lora_in_use(generate_latest(registry).decode(), gauge, NAMES) == frozenset()
    # Without LoRA the simulator has no such gauge, as vLLM has none.
    plain = SimEngine(SimOptions())
    assert lora_in_use(generate_latest(plain._new_registry()).decode(), gauge, NAMES) is None


def test_a_label_of_many_names_and_broken_lines_are_read_in_bounds() -> None:
    many = ",".join(f"adapter{i}" for i in range(200_000)) + ",tax"
    text = "\n".join(
        [
            f'{VLLM}{{running_lora_adapters="{many}",waiting_lora_adapters=""}} 5',
            f'{VLLM}{{running_lora_adapters="legal"}} not-a-number',
            f'{VLLM}{{running_lora_adapters="legal"}} NaN',
            f'{VLLM}{{running_lora_adapters="legal" 9',
            f'{VLLM}{{running_lora_adapters="finance\\",legal"}} 4',
        ]
    )
    began = time.monotonic()
    tracemalloc.start()
    try:
        assert lora_in_use(text, VLLM, NAMES) == {"tax"}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - began < 2
    # The line and its label copied once each: not a string per name, nor the regex's stack.
    assert peak < 3 * len(text)
    # A label never closed, a run of name characters, millions of short lines: linear, flat.
    for hostile in (
        f'{VLLM}{{running_lora_adapters="' + "legal" * 400_000 + "} 5",
        f"{VLLM}{{" + "a" * 2_000_000 + "} 5",
        "ab\n" * 1_000_000 + f'{VLLM}{{running_lora_adapters="tax"}} 1',
    ):
        began = time.monotonic()
        tracemalloc.start()
        try:
            found = lora_in_use(hostile, VLLM, NAMES)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert found in (frozenset(), {"tax"})
        assert time.monotonic() - began < 2
        assert peak < 3 * len(hostile)
    # Two series set at one time are both the engine's word.
    tie = f'{VLLM}{{running_lora_adapters="legal"}} 7\n{VLLM}{{waiting_lora_adapters="tax"}} 7\n'
    assert lora_in_use(tie, VLLM, NAMES) == {"legal", "tax"}


_PIECES = st.sampled_from(
    [
        VLLM,
        "{",
        "}",
        '"',
        "\\",
        ",",
        "=",
        " ",
        "\n",
        "running_lora_adapters",
        "waiting_lora_adapters",
        'max_lora="2"',
        "legal",
        "tax",
        "1.7e9",
        "NaN",
        "-inf",
        "# TYPE ",
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(_PIECES, st.text(max_size=20)), max_size=60))
def test_any_exposition_text_yields_the_shard_s_adapters_or_none(pieces: list[str]) -> None:
    text = "".join(pieces)
    began = time.monotonic()
    found = lora_in_use(text, VLLM, NAMES)
    assert found is None or found <= NAMES
    assert time.monotonic() - began < 1
