"""A request's token ids from its deployment's engine, to route on what the engines hold.

Only for a deployment with a ready replica whose engine says what it holds (`Table.viewed`:
its launcher relays the engine's KV events, `source: engine`); for any other nothing is
asked and nothing waits. Before its replica is picked, the request's prompt goes to one such
replica's `POST /tokenize` (vLLM's: `{"model", "messages"}` rendered by the engine's own chat
template with the generation prompt, special tokens as the template puts them, as its chat
endpoint renders them; `{"model", "prompt"}` with the tokenizer's special tokens, as its
completions endpoint does), so the ids are those the engine caches. Their whole blocks are
hashed as the launcher hashes what the engine stored (`engine_view.engine_prompt`).

Bounded: the ask and its answer within `timeout_s` (TOKENIZE_TIMEOUT_S), the answer read up
to `engine_view.most_answer_bytes` of the request's size and decoded as outside bytes
(`engine_view.decode_tokens`). Any failure (slow, refused, an error status, a bad answer)
costs the request its engine match only: it is routed by the text index, and its span says
why (`llmgw.tokenize`).
"""

from __future__ import annotations

from typing import Any

import anyio
import httpx
from opentelemetry import trace

from .engine_view import EnginePrompt, TokenizeError, decode_tokens, engine_prompt, most_answer_bytes
from .names import ServedNames
from .routed import Routed
from .routing import Table, prompt_text_bytes

# How long a request waits for its tokens before it is routed by the text index: a tokenize
# is a few milliseconds on an engine that answers; one that does not costs every request of
# its deployment this much.
TOKENIZE_TIMEOUT_S = 0.5
# The span's attribute saying how the request's tokens were had, or why they were not.
TOKENIZE_ATTRIBUTE = "llmgw.tokenize"
# The chat request's fields that change what the engine's chat template renders, as vLLM's
# `/tokenize` takes them (`TokenizeChatRequest`).
CHAT_FIELDS = (
    "messages",
    "tools",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def tokenize_request(payload: dict[str, Any], path: str, served: str | None) -> dict[str, Any] | None:
    """The `/tokenize` body for a request to `path` (None: a prompt not tokenized, such as a
    list of prompts, token ids, or a path other than chat and completions)."""
    body: dict[str, Any]
    if path == CHAT:
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        body = {k: payload[k] for k in CHAT_FIELDS if k in payload}
        if body.get("continue_final_message") is True:
            # vLLM refuses both at once; its chat endpoint renders no generation prompt then.
            body["add_generation_prompt"] = False
    elif path == COMPLETIONS:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            return None
        body = {"prompt": prompt}
        if "add_special_tokens" in payload:
            body["add_special_tokens"] = payload["add_special_tokens"]
    else:
        return None
    if served:
        body["model"] = served
    return body


def said(span: trace.Span, words: str) -> None:
    if span.is_recording():
        span.set_attribute(TOKENIZE_ATTRIBUTE, words)


class EngineTokens:
    """Asks a deployment's engine for a request's tokens, bounded in time and size."""

    __slots__ = ("client", "names", "table", "timeout_s")

    def __init__(
        self,
        client: httpx.AsyncClient,
        table: Table,
        names: ServedNames,
        timeout_s: float = TOKENIZE_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.table = table
        self.names = names
        self.timeout_s = timeout_s

    async def prompt(self, routed: Routed, path: str) -> EnginePrompt | None:
        """The request's prompt cut in its engines' blocks; None where its deployment has no
        engine view (nothing asked), or its tokens could not be had (its span says why)."""
        viewed = self.table.viewed(routed.deployment)
        if not viewed or path not in (CHAT, COMPLETIONS):
            return None
        outstanding = self.table.outstanding
        key, record = min(viewed, key=lambda kr: (outstanding[kr[0]], kr[0]))
        block_tokens = self.table.engine[key].block_tokens
        if block_tokens < 1:
            # The engine stored nothing yet: no block size, and nothing to match.
            said(routed.span, f"not tokenized: {key}'s engine holds no blocks yet")
            return None
        try:
            with anyio.fail_after(self.timeout_s):
                served = await self.names.of(record)
                body = tokenize_request(routed.payload, path, served)
                if body is None:
                    said(routed.span, "not tokenized: the prompt is not one text or chat")
                    return None
                ids = await self._ask(record.url, body, len(routed.body))
        except TimeoutError:
            said(
                routed.span,
                f"{key}'s /tokenize did not answer within {self.timeout_s:g}s: routed by the text index",
            )
            return None
        except (httpx.HTTPError, TokenizeError) as exc:
            said(
                routed.span,
                f"{key}'s /tokenize failed ({exc or type(exc).__name__}): routed by the text index",
            )
            return None
        said(routed.span, f"{len(ids)} tokens from {key}")
        # Seeded by the adapter as the launcher seeds the blocks an engine stored under it.
        # Weighed at this prompt's own bytes a token (engine_view.measured_bytes_per_token).
        return engine_prompt(
            routed.deployment,
            ids,
            block_tokens,
            self.table.routing.max_blocks,
            routed.adapter,
            prompt_bytes=prompt_text_bytes(routed.payload, len(routed.body)),
        )

    async def _ask(self, url: str, body: dict[str, Any], request_bytes: int) -> list[int]:
        limit = most_answer_bytes(request_bytes)
        parts: list[bytes] = []
        size = 0
        async with self.client.stream("POST", f"{url}/tokenize", json=body) as answer:
            if answer.status_code != 200:
                raise TokenizeError(f"answered {answer.status_code}")
            async for chunk in answer.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise TokenizeError(f"the answer is over {limit} bytes")
                parts.append(chunk)
        return decode_tokens(b"".join(parts), request_bytes)
