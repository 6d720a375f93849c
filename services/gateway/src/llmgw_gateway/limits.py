"""Bounds on what a client sends that the gateway checks or quotes back: how deep a request
body's JSON nests, and how much of a client's string an error repeats.

Pure: bytes and strings in, answers out.
"""

from __future__ import annotations

import re

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
