"""A replica that dies mid-answer: the gateway continues the answer on another replica, and the
client sees one answer, whole, as an unbroken replica gives it (real gateway, real sim engine
processes; the sim's words are a function of the prompt and their place in the answer)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from llmgw_core.keys import ANONYMOUS
from llmgw_core.sim._words import _tokens
from llmgw_gateway.config import RoutingConfig
from tests.gateway_support import proxy_over
from tests.test_gateway import metric
from tests.test_gateway_api import CHAT, sim_engines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
TOKENS = "llmgw_gateway_{}_tokens_total" + f'{{{{deployment="chat",key="{ANONYMOUS}"}}}}'


def events_of(sse: bytes) -> list[Any]:
    """A stream's events, `[DONE]` as the string."""
    out: list[Any] = []
    for event in sse.split(b"\n\n"):
        if event:
            raw = event.removeprefix(b"data: ")
            out.append(raw.decode() if raw == b"[DONE]" else json.loads(raw))
    return out


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any]) -> list[Any]:
    async with client.stream("POST", f"{url}{path}", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        return events_of(b"".join([chunk async for chunk in r.aiter_raw()]))


def text_of(events: list[Any], *, chat: bool) -> str:
    chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
    if chat:
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return "".join(c["choices"][0]["text"] for c in chunks)


async def tokens_charged(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    scrape = (await client.get(f"{url}/metrics")).text
    return metric(scrape, TOKENS.format("prompt"), 0), metric(scrape, TOKENS.format("completion"), 0)


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        ("/v1/chat/completions", {"model": "chat", "messages": CHAT}),
        ("/v1/completions", {"model": "chat", "prompt": "Say something"}),
    ],
)
async def test_a_stream_broken_off_is_continued_on_another_replica_as_one_unbroken_stream(
    path: str, request_body: dict[str, Any]
) -> None:
    """r0 dies after 4 tokens of a 12-token answer: the client still gets one stream, equal to
    what an unbroken replica answers, with one id and one usage, and is charged once."""
    chat = path == "/v1/chat/completions"
    body = {**request_body, "max_tokens": 12, "seed": 3, "stream_options": {"include_usage": True}}
    with sim_engines(["--die-after-chunks", "4"], []) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            got = await stream(raw, gw.url, path, body)
            unbroken = await stream(raw, urls[1], path, {**body, "model": "tiny"})
            assert got[-1] == "[DONE]"
            assert not any("error" in e for e in got if isinstance(e, dict)), got
            assert text_of(got, chat=chat) == text_of(unbroken, chat=chat)
            assert len(text_of(got, chat=chat).split()) == 12
            assert len({e["id"] for e in got[:-1]}) == 1
            assert len({e["created"] for e in got[:-1]}) == 1
            if chat:
                roles = [e for e in got[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]]
                assert len(roles) == 1
            usage = [e["usage"] for e in got[:-1] if e.get("usage")]
            assert usage == [unbroken[-2]["usage"]], (usage, unbroken[-2])
            assert usage[0]["completion_tokens"] == 12
            # Charged once: the original prompt, and each token generated on either replica.
            assert await tokens_charged(raw, gw.url) == (usage[0]["prompt_tokens"], 12)
            scrape = (await raw.get(f"{gw.url}/metrics")).text
            assert (
                metric(scrape, 'llmgw_gateway_errors_total{deployment="chat",reason="upstream_stream"}') == 1
            )
            assert metric((await raw.get(f"{urls[1]}/metrics")).text, "llmgw_sim_requests_total") == 2


async def test_the_openai_client_reads_a_continued_stream_as_one_answer() -> None:
    with sim_engines(["--die-after-chunks", "2"], []) as urls:
        async with (
            proxy_over(urls) as gw,
            openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            broken = await client.chat.completions.create(
                model="chat",
                messages=MESSAGES,
                max_tokens=9,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in broken]
            whole = await client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=9)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == whole.choices[0].message.content
            assert len({c.id for c in chunks}) == 1
            assert chunks[-1].usage is not None
            assert whole.usage is not None
            assert chunks[-1].usage.completion_tokens == 9
            assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


async def test_an_answer_not_streamed_broken_off_is_asked_of_another_replica_whole() -> None:
    """r0 sends its answer's head and first pieces, then dies: nothing of it went to the
    client, which gets r1's answer, whole, once."""
    body = {"model": "chat", "messages": CHAT, "max_tokens": 6}
    with sim_engines(["--die-after-chunks", "2"], []) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            r = await raw.post(f"{gw.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            unbroken = (
                await raw.post(f"{urls[1]}/v1/chat/completions", json={**body, "model": "tiny"})
            ).json()
            got = r.json()
            assert got["choices"] == unbroken["choices"]
            assert got["usage"] == unbroken["usage"]
            assert await tokens_charged(raw, gw.url) == (got["usage"]["prompt_tokens"], 6)


async def test_with_no_other_replica_the_stream_ends_saying_the_continuation_was_tried() -> None:
    with sim_engines(["--die-after-chunks", "3"]) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            got = await stream(raw, gw.url, "/v1/chat/completions", {"model": "chat", "messages": CHAT})
            assert got[-1] == "[DONE]"
            assert len(text_of(got[:-2], chat=True).split()) == 3
            error = got[-2]["error"]
            assert error["code"] == "replica_failed"
            assert error["message"].startswith(
                f"replica r0 at {urls[0]} of deployment chat broke off its answer: "
            )
            assert error["message"].endswith(
                "; the answer is incomplete: continuing it on another replica was tried and could not be: "
                "deployment chat has no other ready replica"
            ), error


async def test_continuations_0_ends_a_broken_stream_as_before() -> None:
    with sim_engines(["--die-after-chunks", "3"], []) as urls:
        async with (
            proxy_over(urls, routing=RoutingConfig(continuations=0)) as gw,
            httpx.AsyncClient(timeout=30) as raw,
        ):
            got = await stream(raw, gw.url, "/v1/chat/completions", {"model": "chat", "messages": CHAT})
            assert got[-2]["error"]["message"].endswith("the answer is incomplete and was not retried")
            assert metric((await raw.get(f"{urls[1]}/metrics")).text, "llmgw_sim_requests_total") == 0


async def test_an_answer_not_streamed_broken_off_with_no_other_replica_is_answered_503_saying_why() -> None:
    """Nothing of it went to the client: it gets the gateway's own error, not a body cut off."""
    with sim_engines(["--die-after-chunks", "2"]) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            body = {"model": "chat", "messages": CHAT, "max_tokens": 6}
            r = await raw.post(f"{gw.url}/v1/chat/completions", json=body)
            assert r.status_code == 503, r.text
            error = r.json()["error"]
            assert error["code"] == "no_ready_replica"
            assert error["message"].startswith(
                "deployment chat has 1 ready replica but none accepted the request: "
                f"r0 at {urls[0]} broke off its answer: "
            ), error


async def test_a_continuation_broken_off_in_turn_counts_against_the_limit() -> None:
    """r0 dies after 3 tokens, and r1, continuing, after 3 more: with `continuations: 1` the
    client has the 6 tokens in order, in one stream, then the error event saying why not more."""
    body = {"model": "chat", "messages": CHAT, "max_tokens": 12}
    with sim_engines(["--die-after-chunks", "3"], ["--die-after-chunks", "3"]) as urls:
        async with (
            proxy_over(urls, routing=RoutingConfig(continuations=1)) as gw,
            httpx.AsyncClient(timeout=30) as raw,
        ):
            got = await stream(raw, gw.url, "/v1/chat/completions", body)
            assert got[-1] == "[DONE]"
            error = got[-2]["error"]
            assert error["message"].startswith(
                f"replica r1 at {urls[1]} of deployment chat broke off its answer"
            )
            assert error["message"].endswith(
                "continuing it on another replica was tried and could not be: it was continued 1 time "
                "already (the gateway's routing: continuations)"
            ), error
            text = text_of(got[:-2], chat=True)
            assert len({e["id"] for e in got[:-2]}) == 1
            # The sim's words are a function of the prompt and their place: the first 6 of the
            # unbroken answer.
            assert text == " ".join(_tokens(json.dumps(CHAT, sort_keys=True), 6))


async def test_an_error_event_mid_stream_is_a_break_continued_on_another_replica() -> None:
    """r0 gives up on the answer after 3 tokens with an error event, as vLLM does: the client
    never sees it, and gets the whole answer from r1's continuation."""
    body = {"model": "chat", "messages": CHAT, "max_tokens": 8}
    with sim_engines(["--error-after-chunks", "3"], []) as urls:
        async with proxy_over(urls) as gw, httpx.AsyncClient(timeout=30) as raw:
            got = await stream(raw, gw.url, "/v1/chat/completions", body)
            unbroken = await stream(raw, urls[1], "/v1/chat/completions", {**body, "model": "tiny"})
            assert not any("error" in e for e in got if isinstance(e, dict)), got
            assert text_of(got, chat=True) == text_of(unbroken, chat=True)
            assert len(text_of(got, chat=True).split()) == 8
            assert metric((await raw.get(f"{urls[1]}/metrics")).text, "llmgw_sim_requests_total") == 2
