"""The vLLM routing benchmark's plain parts: vLLM's prefix cache counters read from its /metrics,
each request's route put in its class, and the report's tables (bench/routing_vllm.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bench._vllm import prefix_counters
from bench.routing_vllm import Asked, SideRun, render, route_class

# vLLM 0.32.0's exposition of the two counters (with their `_created` siblings), as one
# replica's /metrics answers.
METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 22297.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.7653e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 12064.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7653e+09
vllm:prefix_cache_hits_total{engine="1",model_name="tiny"} 10.0
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


def test_the_prefix_cache_counters_are_read_from_vllms_metrics_summed_over_engines() -> None:
    assert prefix_counters(METRICS) == (12074, 22297)
    assert prefix_counters("") == (0, 0)


def _read(text: str) -> tuple[int, int] | str:
    try:
        return prefix_counters(text)
    except ValueError as exc:
        return str(exc)


LINES = st.one_of(
    st.text(max_size=200),
    st.builds(
        lambda name, labels, value: f"{name}{labels} {value}",
        st.sampled_from(["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]),
        st.sampled_from(["", '{engine="0"}', "{", "{}"]),
        st.one_of(st.text(max_size=30), st.floats().map(repr), st.integers().map(str)),
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(LINES, max_size=20))
def test_metrics_text_of_any_shape_reads_as_counters_or_a_named_error(lines: list[str]) -> None:
    """vLLM's answer is read as outside text: counts each within 2**53 summed, or ValueError
    naming the series; nothing else escapes."""
    read = _read(METRICS + "\n".join(lines))
    if isinstance(read, str):
        assert read.startswith("vllm:prefix_cache_"), read
        assert "is not a count of tokens" in read
        return
    hits, queries = read
    assert 12074 <= hits < 2**53 * 21
    assert 22297 <= queries < 2**53 * 21


def test_each_route_is_put_in_its_class() -> None:
    assert route_class("prefix 37 blocks (engine)") == "engine match"
    assert route_class("prefix 5 blocks") == "text match"
    assert route_class("new prefix") == "new prefix"
    assert route_class("least outstanding") == "least outstanding"


def test_the_report_gives_each_side_its_figures_and_each_route_what_its_replica_held() -> None:
    precise = SideRun(
        "precise",
        asked=[
            Asked(1, repeat=False, ttft=0.8, prompt_tokens=1200, cached_tokens=0, route="new prefix"),
            Asked(2, repeat=True, ttft=0.1, prompt_tokens=1200, cached_tokens=1184, route="engine match"),
        ],
        hits=1184,
        queries=2400,
    )
    approximate = SideRun(
        "approximate",
        asked=[
            Asked(3, repeat=False, ttft=0.9, prompt_tokens=1200, cached_tokens=0, route="least outstanding"),
            Asked(4, repeat=True, ttft=0.7, prompt_tokens=1200, cached_tokens=500, route="text match"),
        ],
        hits=500,
        queries=2400,
    )
    text = render([precise, approximate], customers=1, questions=2, rounds=1, quick=True)
    lines = text.splitlines()
    assert lines[0].startswith("## Prefix routing on vLLM's KV events")
    assert "| precise (engine views) | 2 | 450 ms | 730 ms | 49% (49%) | 1 | 0 | 1 | 0 | 0 |" in lines
    assert "| approximate (text index) | 2 | 800 ms | 880 ms | 21% (21%) | 0 | 1 | 0 | 1 | - |" in lines
    assert "| precise (engine views) | engine match | 1 | 1 | 1 | 99% | 100 ms |" in lines
    # Under half its prompt from cache: a repeat, not a hit.
    assert "| approximate (text index) | text match | 1 | 1 | 0 | 42% | 700 ms |" in lines
