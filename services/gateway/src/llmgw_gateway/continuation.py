"""Continuing an answer a replica broke off, on another replica of its deployment (pure).

The gateway passes every event of a streamed answer on, so it knows what the client already
has. Where the replica's stream ends early (or says it gave up: `error_cut`), what was passed
on (`Held`) is read back (`partial_of`: its id, its creation time, its text and how many
tokens carried it), the rest of the request is asked of another replica (`continuation_body`:
the conversation with the partial answer as its last assistant message, continued; or the
prompt with the text so far; `max_tokens` less what was sent), and that replica's events are
rewritten (`Splice`) so that the client sees one stream: one `id`, one `created`, no second
role chunk, one usage chunk that counts the original prompt once and every token generated on
every replica.

Everything read here came from a replica or a client: `ContinuationError` (a `ValueError`)
says why an answer cannot be continued, and is the only exception these functions raise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

# The paths whose answers can be continued, and whether each is a chat.
CONTINUED_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
# The bytes of one stream held to continue it from; a longer stream is not continued (its
# partial answer would be a prompt too long to send again anyway).
MAX_HELD_BYTES = 4 << 20
# The engines that continue a final assistant message without being asked (llama.cpp's server
# prefills a last assistant message); the others are asked with `continue_final_message`.
# llama-server streams the prefilled text back as the start of its first content (its first
# `delta.content` is the last assistant message's text and the first new token): the splice
# drops it, else the client would get its text so far twice.
PREFILLS = frozenset({"llamacpp"})
# The largest token count read or written: as `usage.MAX_TOKENS`.
MAX_TOKENS = 1 << 32

_EVENT_END = re.compile(rb"\r?\n\r?\n")


class ContinuationError(ValueError):
    """An answer that cannot be continued on another replica: the reason, in words."""


@dataclass
class Partial:
    """What the client has of an answer: its id, creation time and model as the first replica
    sent them, its text so far, the events that carried text (one token each, as the engines
    stream them), and whether it had already finished."""

    id: str | None = None
    created: int | None = None
    model: str | None = None
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    finished: bool = False

    @property
    def text(self) -> str:
        return "".join(self.pieces)


class Held:
    """The events of a stream passed on to its client, held (at most MAX_HELD_BYTES) in case
    the stream must be continued; past the bound, `over` and nothing more is held."""

    __slots__ = ("chunks", "over", "size")

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0
        self.over = False

    def add(self, chunk: bytes) -> None:
        if self.over:
            return
        self.size += len(chunk)
        if self.size > MAX_HELD_BYTES:
            self.over, self.chunks = True, []
            return
        self.chunks.append(chunk)

    def data(self) -> bytes:
        return b"".join(self.chunks)


def _events(data: bytes) -> list[bytes]:
    return [e for e in _EVENT_END.split(data) if e.strip()]


def _data(event: bytes) -> bytes:
    return b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def partial_of(data: bytes, *, chat: bool) -> Partial:
    """What the client has of an answer, from the events passed on to it (`Held.data`)."""
    if len(data) > MAX_HELD_BYTES:
        raise ContinuationError(f"the answer passed on is over {MAX_HELD_BYTES} bytes")
    partial = Partial()
    for event in _events(data):
        raw = _data(event)
        if not raw or raw == b"[DONE]":
            continue
        obj = _json(raw)
        if not isinstance(obj, dict):
            raise ContinuationError("an event of the answer passed on is not a JSON object")
        if "error" in obj:
            raise ContinuationError("the answer passed on holds an error event")
        if partial.id is None and isinstance(obj.get("id"), str):
            partial.id = obj["id"]
        created = obj.get("created")
        if partial.created is None and type(created) is int and 0 <= created <= MAX_TOKENS:
            partial.created = created
        if partial.model is None and isinstance(obj.get("model"), str):
            partial.model = obj["model"]
        choices = obj.get("choices")
        if choices is None or choices == []:
            continue
        if not isinstance(choices, list) or len(choices) > 1:
            raise ContinuationError("the answer has more than one choice (n > 1)")
        choice = choices[0]
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            raise ContinuationError("the answer has more than one choice (n > 1)")
        piece = _piece(choice, chat=chat)
        if piece:
            partial.pieces.append(piece)
            partial.tokens += 1
        if choice.get("finish_reason") is not None:
            partial.finished = True
    return partial


def _piece(choice: dict[str, Any], *, chat: bool) -> str:
    """The text one chunk's choice carries."""
    if not chat:
        text = choice.get("text")
        return text if isinstance(text, str) else ""
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return ""
    if delta.get("tool_calls") or delta.get("function_call"):
        raise ContinuationError("the answer is a tool call, which cannot be continued as text")
    content = delta.get("content")
    return content if isinstance(content, str) else ""


def continuation_body(payload: Any, partial: Partial, *, chat: bool, engine: str) -> dict[str, Any]:
    """The request that asks another replica for the rest of the answer: the client's own
    (sampling parameters and `seed` kept), continued from `partial`, its token limits less
    what was sent."""
    if not isinstance(payload, dict):
        raise ContinuationError("the request body is not a JSON object")
    if payload.get("n", 1) != 1:
        raise ContinuationError("the request asks for more than one choice (n > 1)")
    if partial.finished:
        raise ContinuationError("the answer had finished; only its end was lost")
    body = dict(payload)
    for limit in ("max_tokens", "max_completion_tokens"):
        value = body.get(limit)
        if value is None:
            continue
        if type(value) is not int or not 0 < value <= MAX_TOKENS:
            raise ContinuationError(f"the request's {limit} is not a positive integer")
        left = value - partial.tokens
        if left < 1:
            raise ContinuationError(f"the answer had its {limit} ({value}) already")
        body[limit] = left
    text = partial.text
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise ContinuationError("the request has no list of messages")
        body["messages"] = [*messages, {"role": "assistant", "content": text}]
        if engine not in PREFILLS:
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        return body
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ContinuationError("the request's prompt is not one text (token ids, or several prompts)")
    if body.get("echo") is True:
        raise ContinuationError("the request asks for its prompt echoed")
    body["prompt"] = prompt + text
    return body


def error_cut(data: bytes) -> tuple[bytes, str] | None:
    """Where whole events of a stream hold an error event (vLLM's and SGLang's
    `data: {"error": {...}}` mid-stream: the engine gave up on the answer), the events before
    it and the error's message; else None."""
    events = _events(data)
    for i, event in enumerate(events):
        if b'"error"' not in event:
            continue
        obj = _json(_data(event))
        if not isinstance(obj, dict) or "error" not in obj or obj.get("choices"):
            continue
        error = obj["error"]
        message = error.get("message") if isinstance(error, dict) else error
        words = message if isinstance(message, str) else "(no message)"
        return b"".join(e + b"\n\n" for e in events[:i]), words[:500]
    return None


class Splice:
    """A continuing replica's events, rewritten as the rest of the first replica's answer: its
    `id`, `created` and `model`, no second role, and a usage that counts the first replica's
    tokens once (`before`, the tokens the client had): the continuing engine counts them in
    its prompt, where they were generated, not asked. `echoed`: the engine streams the text
    it continued from back first (a prefilling engine's chat: `PREFILLS`), which is dropped;
    where its first content does not begin with that text, it passes as it came."""

    __slots__ = ("before", "echo", "partial")

    def __init__(self, partial: Partial, *, echoed: bool = False) -> None:
        self.partial = partial
        self.before = partial.tokens
        # What of the echoed text is still to be dropped.
        self.echo = partial.text if echoed else ""

    def rewrite(self, data: bytes) -> bytes:
        """Whole events of the continuing replica, as the client gets them. Never raises: an
        event that is not JSON passes as it came."""
        out = []
        for event in _events(data):
            raw = _data(event)
            obj = _json(raw) if raw and raw != b"[DONE]" else None
            if not isinstance(obj, dict):
                out.append(event + b"\n\n")
                continue
            if not self._rewrite(obj):
                continue
            out.append(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")
        return b"".join(out)

    def _rewrite(self, obj: dict[str, Any]) -> bool:
        """`obj` rewritten in place; whether it still says anything."""
        partial = self.partial
        if "choices" in obj:
            if partial.id is not None:
                obj["id"] = partial.id
            if partial.created is not None:
                obj["created"] = partial.created
            if partial.model is not None:
                obj["model"] = partial.model
        choices = obj.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                if isinstance(delta, dict):
                    delta.pop("role", None)
                    if self.echo:
                        self._unecho(delta)
            if not any(_says(choice) for choice in choices) and "usage" not in obj and choices:
                return False
        usage = obj.get("usage")
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if type(prompt) is int and type(completion) is int:
                prompt = min(max(0, prompt - self.before), MAX_TOKENS)
                completion = min(max(0, completion) + self.before, MAX_TOKENS)
                usage["prompt_tokens"], usage["completion_tokens"] = prompt, completion
                usage["total_tokens"] = prompt + completion
        return True

    def _unecho(self, delta: dict[str, Any]) -> None:
        """The echoed text dropped from the start of the continuing replica's content, across
        as many events as it takes."""
        content = delta.get("content")
        if not isinstance(content, str) or not content:
            return
        echo = self.echo
        if content.startswith(echo):
            delta["content"], self.echo = content[len(echo) :], ""
        elif echo.startswith(content):
            delta["content"], self.echo = "", echo[len(content) :]
        else:
            self.echo = ""  # not an echo: the engine did not send the text back


def _says(choice: Any) -> bool:
    """Whether a chunk's choice carries anything once its role is dropped."""
    if not isinstance(choice, dict):
        return True
    if choice.get("finish_reason") is not None or choice.get("logprobs"):
        return True
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return any(v not in (None, "", []) for v in delta.values())
    return "text" in choice
