"""Continuing a broken-off answer, the pure parts (`continuation.py`): what the client has read
back from the events passed on, the request that asks another replica for the rest, and the
continuing replica's events rewritten as the rest of one stream."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.sim._words import _continued, _text, _tokens
from llmgw_gateway.continuation import (
    MAX_HELD_BYTES,
    ContinuationError,
    Held,
    Partial,
    Splice,
    continuation_body,
    error_cut,
    partial_of,
)

CHAT = [{"role": "user", "content": "hello"}]


def event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def chat_chunk(
    content: str | None, *, role: bool = False, finish: str | None = None, rid: str = "a"
) -> bytes:
    delta: dict[str, Any] = {} if content is None else {"content": content}
    if role:
        delta["role"] = "assistant"
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return event(
        {"id": rid, "object": "chat.completion.chunk", "created": 7, "model": "m", "choices": [choice]}
    )


def decoded(data: bytes) -> list[Any]:
    out = []
    for e in data.split(b"\n\n"):
        if e:
            raw = e.removeprefix(b"data: ")
            out.append(raw.decode() if raw == b"[DONE]" else json.loads(raw))
    return out


def test_what_the_client_has_of_a_chat_stream_is_read_back_from_its_events() -> None:
    data = chat_chunk("the", role=True) + chat_chunk(" quick") + chat_chunk("") + chat_chunk(" fox")
    had = partial_of(data, chat=True)
    assert (had.id, had.created, had.model) == ("a", 7, "m")
    assert had.text == "the quick fox"
    assert had.tokens == 3
    assert not had.finished


def test_a_completion_stream_and_a_finished_one() -> None:
    chunk = {"id": "c", "object": "text_completion", "created": 3, "choices": [{"index": 0, "text": "a b"}]}
    end = {**chunk, "choices": [{"index": 0, "text": "", "finish_reason": "length"}]}
    had = partial_of(event(chunk) + event(end), chat=False)
    assert (had.text, had.tokens, had.finished) == ("a b", 1, True)
    with pytest.raises(ContinuationError, match="the answer had finished; only its end was lost"):
        continuation_body({"prompt": "p"}, had, chat=False, engine="vllm")


def test_answers_that_cannot_be_continued_say_why() -> None:
    two = event({"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}]})
    with pytest.raises(ContinuationError, match=r"more than one choice \(n > 1\)"):
        partial_of(two, chat=False)
    tool = event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]})
    with pytest.raises(ContinuationError, match="tool call"):
        partial_of(tool, chat=True)
    with pytest.raises(ContinuationError, match="error event"):
        partial_of(event({"error": {"message": "x"}}), chat=True)
    with pytest.raises(ContinuationError, match="not a JSON object"):
        partial_of(b"data: [1]\n\n", chat=True)


def test_a_chat_continuation_is_the_conversation_with_the_partial_answer_continued() -> None:
    had = Partial(pieces=["the", " quick"], tokens=2)
    payload = {
        "model": "m",
        "messages": CHAT,
        "max_tokens": 10,
        "seed": 4,
        "temperature": 0.5,
        "stream": True,
    }
    body = continuation_body(payload, had, chat=True, engine="vllm")
    assert body == {
        **payload,
        "messages": [*CHAT, {"role": "assistant", "content": "the quick"}],
        "max_tokens": 8,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert payload["max_tokens"] == 10  # the client's own request is left as it was
    # llama.cpp's server continues a last assistant message as it is (its prefill).
    llama = continuation_body({**payload, "max_completion_tokens": 5}, had, chat=True, engine="llamacpp")
    assert "continue_final_message" not in llama
    assert (llama["max_tokens"], llama["max_completion_tokens"]) == (8, 3)


def test_a_completion_continuation_is_the_prompt_and_the_text_so_far() -> None:
    had = Partial(pieces=[" over", " a"], tokens=2)
    body = continuation_body({"prompt": ["Say"], "max_tokens": 3}, had, chat=False, engine="sglang")
    assert body == {"prompt": "Say over a", "max_tokens": 1}
    with pytest.raises(ContinuationError, match="the answer had its max_tokens \\(2\\) already"):
        continuation_body({"prompt": "Say", "max_tokens": 2}, had, chat=False, engine="vllm")
    with pytest.raises(ContinuationError, match="token ids, or several prompts"):
        continuation_body({"prompt": [1, 2, 3]}, had, chat=False, engine="vllm")
    with pytest.raises(ContinuationError, match=r"more than one choice \(n > 1\)"):
        continuation_body({"prompt": "p", "n": 2}, had, chat=False, engine="vllm")
    with pytest.raises(ContinuationError, match="max_tokens is not a positive integer"):
        continuation_body({"prompt": "p", "max_tokens": "9"}, had, chat=False, engine="vllm")


def test_the_continuing_replicas_events_are_rewritten_as_the_rest_of_one_stream() -> None:
    had = partial_of(chat_chunk("the", role=True) + chat_chunk(" quick"), chat=True)
    splice = Splice(had)
    usage = {
        "id": "b",
        "created": 9,
        "model": "m2",
        "choices": [],
        "usage": {"prompt_tokens": 12, "completion_tokens": 3},
    }
    out = splice.rewrite(
        chat_chunk("", role=True, rid="b")  # vLLM's role-only first chunk: dropped
        + chat_chunk(" brown", role=True, rid="b")  # the sim's: its role dropped
        + chat_chunk(None, finish="length", rid="b")
        + event(usage)
        + b"data: [DONE]\n\n"
    )
    events = decoded(out)
    assert events[-1] == "[DONE]"
    assert [e["id"] for e in events[:-1]] == ["a", "a", "a"]
    assert {e["created"] for e in events[:-1]} == {7}
    assert events[0]["choices"][0]["delta"] == {"content": " brown"}
    assert events[1]["choices"][0]["finish_reason"] == "length"
    # The first replica's 2 tokens: generated, not asked (the continuing engine counts them in
    # its prompt).
    assert events[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_what_is_held_to_continue_from_is_bounded() -> None:
    held = Held()
    held.add(b"x" * MAX_HELD_BYTES)
    assert not held.over
    held.add(b"y")
    assert held.over
    assert held.data() == b""
    with pytest.raises(ContinuationError, match="over"):
        partial_of(b"x" * (MAX_HELD_BYTES + 1), chat=True)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=16,
)
chunk_objects = st.dictionaries(
    st.sampled_from(["id", "created", "model", "choices", "usage", "error", "x"]), json_values, max_size=5
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(st.binary(max_size=64), chunk_objects.map(event), st.just(b"data: [DONE]\n\n")), max_size=8
    ),
    st.booleans(),
    json_values,
    st.sampled_from(["vllm", "llamacpp"]),
)
def test_hostile_streams_and_bodies_raise_only_continuation_error(
    parts: list[bytes], chat: bool, payload: Any, engine: str
) -> None:
    """Events and request bodies are outside bytes: anything wrong is a ContinuationError, and
    the splice passes what it cannot read as it came, raising nothing."""
    data = b"".join(parts)
    try:
        had = partial_of(data, chat=chat)
    except ContinuationError:
        had = Partial(pieces=["x"], tokens=1)
    assert len(had.text) <= len(data) + 1
    try:
        body = continuation_body(payload, had, chat=chat, engine=engine)
    except ContinuationError:
        pass
    else:
        assert isinstance(body, dict)
        json.dumps(body)
    cut = error_cut(data)
    assert cut is None or len(cut[0]) <= len(data) + 2 * data.count(b"\n")
    out = Splice(had).rewrite(data)
    assert len(out) <= 4 * len(data) + 64 * (data.count(b"\n\n") + 1)


@pytest.mark.parametrize("prompt", ["Say hi", "", "hello the", "x y z\n"])
def test_the_sims_answer_continued_from_any_point_is_the_unbroken_answer(prompt: str) -> None:
    """The sim engine's words are a function of the prompt and their place: a completion prompt
    ending with its first k words is found to be one, and goes on with word k."""
    whole = _text(_tokens(prompt, 12), 0)
    for k in range(13):
        given = _text(_tokens(prompt, k), 0)
        base, start = _continued(prompt + given)
        assert base + _text(_tokens(base, start), 0) == prompt + given
        assert given + _text(_tokens(base, 12 - k, start), start) == whole
    assert _continued("a prompt of other words") == ("a prompt of other words", 0)


def test_an_error_event_mid_stream_is_found_with_what_came_before_it() -> None:
    before = chat_chunk("the", role=True) + chat_chunk(" quick")
    error = event({"error": {"message": "generation failed", "code": 500}})
    assert error_cut(before + error + b"data: [DONE]\n\n") == (before, "generation failed")
    assert error_cut(before) is None
    # A chunk whose text says "error" is no error event.
    assert error_cut(chat_chunk('say "error"')) is None
