"""A prefilling engine's continuation (llama.cpp's server) streams the text it continued from
back before the rest: the splice drops it, so the client has its text once (pure parts)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_gateway.continuation import Splice, partial_of
from tests.test_gateway_continuation_pure import chat_chunk, decoded

HAD = chat_chunk("I<o", role=True) + chat_chunk("W")


def contents(data: bytes) -> list[str]:
    return [e["choices"][0]["delta"].get("content") for e in decoded(data) if isinstance(e, dict)]


def test_the_echoed_text_is_dropped_from_the_first_content_and_the_rest_passes() -> None:
    """As llama-server sends it: the prefilled text and the first new token in one delta."""
    splice = Splice(partial_of(HAD, chat=True), echoed=True)
    out = splice.rewrite(chat_chunk(None, role=True, rid="b") + chat_chunk("I<oWC", rid="b"))
    assert contents(out) == ["C"]
    assert contents(splice.rewrite(chat_chunk("I<oW", rid="b"))) == ["I<oW"]


def test_an_echo_split_over_events_is_dropped_across_them() -> None:
    splice = Splice(partial_of(HAD, chat=True), echoed=True)
    out = splice.rewrite(chat_chunk("I<", rid="b") + chat_chunk("oW", rid="b") + chat_chunk("Cc", rid="b"))
    assert contents(out) == ["Cc"]


def test_content_that_is_no_echo_passes_as_it_came() -> None:
    splice = Splice(partial_of(HAD, chat=True), echoed=True)
    assert contents(splice.rewrite(chat_chunk("zz", rid="b") + chat_chunk("I<oW", rid="b"))) == ["zz", "I<oW"]
    # Not asked to drop an echo (vLLM, SGLang: `continue_final_message`): nothing is dropped.
    plain = Splice(partial_of(HAD, chat=True))
    assert contents(plain.rewrite(chat_chunk("I<oWC", rid="b"))) == ["I<oWC"]


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=12), st.lists(st.one_of(st.none(), st.text(max_size=8), st.integers()), max_size=8))
def test_hostile_contents_after_an_echo_raise_nothing_and_never_grow(had: str, pieces: list[Any]) -> None:
    """Contents of any type and split: the splice raises nothing, and drops at most the echo."""
    splice = Splice(partial_of(chat_chunk(had), chat=True), echoed=True)
    data = b"".join(
        chat_chunk(p, rid="b") if isinstance(p, str) or p is None else b"data: 1\n\n" for p in pieces
    )
    out = splice.rewrite(data)
    sent = "".join(p for p in pieces if isinstance(p, str))
    got = "".join(c for c in contents(out.replace(b"data: 1\n\n", b"")) if isinstance(c, str))
    assert len(sent) - len(had) <= len(got) <= len(sent)
    assert sent.endswith(got)
