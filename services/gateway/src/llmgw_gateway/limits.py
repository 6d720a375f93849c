"""Bounds on what a client sends that the gateway checks or quotes back: how deep a request
body's JSON nests, the types of the body's fields the gateway reads as the engines do
(`body_problem`), and how much of a client's string an error repeats.

Pure: bytes and strings in, answers out.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

# A JSON string, escapes included: brackets inside one do not nest anything.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Every byte but the four brackets, for `bytes.translate(None, delete=…)`.
_NOT_BRACKETS = bytes(range(256)).translate(None, b"[]{}")
_OPENERS = frozenset(b"[{")
# How much of a client's string an error message quotes.
SHOWN_CHARS = 64


def json_nests_deeper(body: bytes, limit: int) -> bool:
    """Whether the JSON in `body` opens more than `limit` arrays or objects inside each other.

    Checked before parsing: Python's parser (and msgspec's) recurse once per level, and
    100,000 nested `[` end in a RecursionError. Strings are skipped first, so only the
    brackets are walked one by one (an 8 MiB body of brackets takes about 0.15 s, a quarter
    of what parsing it would); invalid JSON is left for the parser to refuse.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # fewer openers than the limit, strings' included: none nests past it
    depth = 0
    for byte in _STRING.sub(b"", body).translate(None, _NOT_BRACKETS):
        if byte in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def shown(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` quoted for an error message, cut to its first `limit` characters when longer
    (a 100 KB model name is not sent back to its sender, nor into logs and traces)."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


class BodyProblem(NamedTuple):
    """Why a body's field is refused, in OpenAI's words: the message, the field (`param`) and
    the error code."""

    message: str
    param: str
    code: str


# What the engines read these fields as. Their servers (pydantic, in lax mode) take "true",
# 1 and "yes" for true and "50" for 50: a field of another type would be read one way by the
# gateway and another by the engine (`"stream": "true"` streamed, and counted as not streamed).
_BOOLEANS = ("stream",)
_INTEGERS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of")
_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def _json_type(value: object) -> str:
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return "null"


def _invalid(param: str, wanted: str, value: object) -> BodyProblem:
    return BodyProblem(
        f"Invalid type for '{param}': expected {wanted}, but got {_json_type(value)} instead.",
        param,
        "invalid_type",
    )


def body_problem(payload: dict[str, Any]) -> BodyProblem | None:
    """What is wrong with the type of a field of `payload` that the gateway reads to stream, count
    and reserve the answer (`stream`, `stream_options.include_usage`, `max_tokens` and the
    other caps, `n`, `best_of`); None where each is absent, null or of its type."""
    for name in _BOOLEANS:
        value = payload.get(name)
        if value is not None and not isinstance(value, bool):
            return _invalid(name, "a boolean", value)
    for name in _INTEGERS:
        value = payload.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return _invalid(name, "an integer", value)
    options = payload.get("stream_options")
    if options is None:
        return None
    if not isinstance(options, dict):
        return _invalid("stream_options", "an object", options)
    usage = options.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        return _invalid("stream_options.include_usage", "a boolean", usage)
    return None
