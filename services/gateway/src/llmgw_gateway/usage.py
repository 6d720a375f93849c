"""Tokens spent by each answer, for the keys' token limits.

Reading an answer's usage: a JSON answer's `usage` object at its end; a streamed one's
events that carry a `usage` (OpenAI's last chunk with `stream_options.include_usage`,
Anthropic's `message_start` and `message_delta`, the Responses API's `response.completed`).
Prompt tokens are `prompt_tokens` or `input_tokens`, completion tokens `completion_tokens`
or `output_tokens`; where one answer says them more than once, the largest counts.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

# A JSON answer is read for its usage up to this size (a copy, as it passes through).
MAX_READ_BYTES = 4 << 20


@dataclass
class Meter:
    """What one answer spent, as read so far."""

    prompt: int = 0
    completion: int = 0

    def take(self, obj: Any) -> bool:
        """Read the usage in one parsed answer or event; whether it held one."""
        if not isinstance(obj, dict):
            return False
        found = False
        for holder in (obj, obj.get("message"), obj.get("response")):
            usage = holder.get("usage") if isinstance(holder, dict) else None
            if not isinstance(usage, dict):
                continue
            found = True
            for names, attr in (
                (("prompt_tokens", "input_tokens"), "prompt"),
                (("completion_tokens", "output_tokens"), "completion"),
            ):
                for name in names:
                    value = usage.get(name)
                    if isinstance(value, int) and value > getattr(self, attr):
                        setattr(self, attr, value)
        return found


def read_json_answer(body: bytes, encoding: str, meter: Meter) -> None:
    """Read the usage of a whole JSON answer (gzip- or deflate-encoded as the engine sent it)."""
    try:
        if encoding in ("gzip", "deflate"):
            body = zlib.decompressobj(zlib.MAX_WBITS | 32).decompress(body, MAX_READ_BYTES)
        meter.take(json.loads(body))
    except (ValueError, zlib.error):
        return


def read_events(chunk: bytes, meter: Meter, *, strip: bool) -> bytes:
    """Read the usage in whole SSE events; with `strip`, drop the events that are only usage
    (OpenAI's last chunk, `choices: []`), which a client that did not ask for them never sees."""
    if b'"usage"' not in chunk:
        return chunk
    kept = []
    for event in chunk.split(b"\n\n"):
        if b'"usage"' in event:
            data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
            if meter.take(obj) and strip and isinstance(obj, dict) and obj.get("choices") == []:
                continue
        kept.append(event)
    return b"\n\n".join(kept)
