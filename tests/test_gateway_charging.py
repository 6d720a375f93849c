"""What the gateway charges a key for the answers it passes on: a stream the client cuts is
charged for what was sent (usage records and the key's tpm window both), `stream` and the other
body fields the gateway reads are refused (400, in OpenAI's words) where they are not of their
type, and a key's tpm holds under many requests at once (each reserves what it may spend before
it is sent). Through the gateway's HTTP server and sim engine processes; the parsers (request
bodies, server-sent events) fuzzed."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from llmgw_core.keys import WINDOW_S, ApiKey, KeyWindow, secret_hash
from llmgw_gateway import Proxy, Table
from llmgw_gateway.budgets import UNCAPPED_TOKENS, Budgets, Estimate, Limited, estimate
from llmgw_gateway.config import RoutingConfig
from llmgw_gateway.keyring import Keyring
from llmgw_gateway.limits import body_problem
from llmgw_gateway.proxy import ROUTED, BadBody, error_body, parsed_body
from llmgw_gateway.usage import MAX_EVENT_BYTES, MAX_TOKENS, Events, Meter, read_events
from tests.cluster_support import cluster
from tests.gateway_support import answers_health, proxy_over, serve_proxy
from tests.test_gateway import metric, running_gateway
from tests.test_gateway_api import sim_engines
from tests.test_gateway_keys import CHAT, ctl_json, serve_chat_and_other
from tests.waiting import eventually

CHAT_PATH = "/v1/chat/completions"


# --- the request body's fields --------------------------------------------------------------


def test_a_field_of_another_type_is_refused_in_openais_words() -> None:
    def refused(payload: dict[str, Any]) -> tuple[str, str, str] | None:
        problem = body_problem(payload)
        return None if problem is None else (problem.message, problem.param, problem.code)

    # pydantic, in the engines, streams `"true"` and `1`: the gateway would have counted neither.
    assert refused({"stream": "true"}) == (
        "Invalid type for 'stream': expected a boolean, but got a string instead.",
        "stream",
        "invalid_type",
    )
    assert refused({"stream": 1}) == (
        "Invalid type for 'stream': expected a boolean, but got an integer instead.",
        "stream",
        "invalid_type",
    )
    assert refused({"stream": True, "stream_options": "usage"}) == (
        "Invalid type for 'stream_options': expected an object, but got a string instead.",
        "stream_options",
        "invalid_type",
    )
    assert refused({"stream": True, "stream_options": {"include_usage": 1.0}}) == (
        "Invalid type for 'stream_options.include_usage': expected a boolean, but got a decimal instead.",
        "stream_options.include_usage",
        "invalid_type",
    )
    assert refused({"max_tokens": "5000"}) == (
        "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
        "max_tokens",
        "invalid_type",
    )
    assert refused({"n": True}) == (
        "Invalid type for 'n': expected an integer, but got a boolean instead.",
        "n",
        "invalid_type",
    )
    # Absent, null or of its type: the engine's to judge.
    assert refused({}) is None
    assert refused({"stream": None, "stream_options": None, "max_tokens": None}) is None
    assert refused({"stream": False, "stream_options": {"include_usage": None}, "n": 2, "best_of": 3}) is None
    assert refused({"max_tokens": -1}) is None


def test_a_request_reserves_its_prompt_and_the_most_it_may_generate() -> None:
    # The prompt: the body's bytes / 4, rounded up.
    assert estimate({"max_tokens": 50}, 90, CHAT_PATH) == Estimate(23, 73)
    assert estimate({}, 90, CHAT_PATH) == Estimate(23, 23 + UNCAPPED_TOKENS)
    # As vLLM reads them: max_completion_tokens before max_tokens; n answers of that each.
    assert estimate({"max_completion_tokens": 10, "max_tokens": 500}, 4, CHAT_PATH) == Estimate(1, 11)
    assert estimate({"max_tokens": 10, "n": 3, "best_of": 5}, 4, "/v1/completions") == Estimate(1, 51)
    assert estimate({"max_output_tokens": 7}, 8, "/v1/responses") == Estimate(2, 9)
    assert estimate({"max_tokens": -5}, 8, "/v1/messages") == Estimate(2, 2)
    # Embeddings generate nothing.
    assert estimate({"max_tokens": 50}, 90, "/v1/embeddings") == Estimate(23, 23, generates=False)


_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
_JSON = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
_FIELDS = st.sampled_from(
    [
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "max_output_tokens",
        "n",
        "best_of",
        "messages",
        "prompt",
        "model",
    ]
)
_OPTIONS = st.dictionaries(st.sampled_from(["include_usage", "continuous_usage_stats"]), _JSON, max_size=2)
_BODIES = st.tuples(
    st.dictionaries(_FIELDS | st.text(max_size=6), _JSON | _OPTIONS, max_size=8),
    st.none() | st.text(min_size=1, max_size=8),
).map(lambda pair: pair[0] if pair[1] is None else {**pair[0], "model": pair[1]})


def _judged(body: bytes) -> None:
    """What the gateway makes of `body`: accepted with the fields it reads of their type, and
    an estimate within bounds; else a 400 in OpenAI's shape."""
    parsed = parsed_body(body, 128)
    if isinstance(parsed, BadBody):
        assert parsed.status == 400
        error = error_body(parsed.message, "invalid_request_error", parsed.code, parsed.param)
        assert list(error["error"]) == ["message", "type", "param", "code"]
        assert parsed.message
        json.dumps(error)
        return
    payload, model = parsed
    assert payload["model"] == model
    assert payload.get("stream") in (None, True, False)
    options = payload.get("stream_options")
    assert options is None or (
        isinstance(options, dict) and options.get("include_usage") in (None, True, False)
    )
    for path in ROUTED:
        guess = estimate(payload, len(body), path)
        assert 0 <= guess.prompt <= guess.tokens <= guess.prompt + 2**64


@settings(max_examples=120, deadline=500, suppress_health_check=[HealthCheck.too_slow])
@given(payload=_BODIES | _JSON)
def test_any_json_body_is_accepted_or_refused_with_a_400_in_openais_shape(payload: Any) -> None:
    _judged(json.dumps(payload).encode())


@settings(max_examples=200, deadline=500)
@given(body=st.binary(max_size=200))
def test_any_bytes_as_a_body_are_accepted_or_refused_with_a_400(body: bytes) -> None:
    _judged(body)


# --- a stream's events ------------------------------------------------------------------------

_PIECES = st.sampled_from(
    [
        b"data: ",
        b"\n",
        b"\r\n",
        b"\n\n",
        b"\r\n\r\n",
        b"[DONE]",
        b'"usage"',
        b'{"choices": [{"delta": {"content": "hi"}}]}',
        b'{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}',
        b'{"choices": [], "usage": {"completion_tokens": 99999999999999999999999999}}',
        b'{"usage": {"prompt_tokens": true, "completion_tokens": -4}}',
        b'event: message_start\ndata: {"message": {"usage": {"input_tokens": 9}}}\n\n',
        b'data: {"usage": ' + b"[" * 5000 + b"\n\n",
        b"{",
        b"]",
    ]
)
_STREAMS = st.lists(_PIECES | st.binary(max_size=30), max_size=30).map(b"".join)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    at = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *at, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@settings(max_examples=150, deadline=500)
@given(stream=_STREAMS, cuts=st.lists(st.integers(min_value=0), max_size=12), strip=st.booleans())
def test_any_stream_split_anywhere_is_passed_on_in_order_and_counted(
    stream: bytes, cuts: list[int], strip: bool
) -> None:
    meter = Meter()
    reader = Events(meter, strip=strip)
    out = b"".join(reader.feed(piece) for piece in _split(stream, cuts)) + reader.end()
    if strip:
        assert len(out) <= len(stream)
    else:
        assert out == stream  # nothing lost, nothing reordered, nothing added
    assert 0 <= meter.prompt <= MAX_TOKENS
    assert 0 <= meter.completion <= MAX_TOKENS
    assert 0 <= meter.events <= len(stream)
    meter.estimate(5)
    assert meter.completion >= meter.events


def test_an_event_that_never_ends_is_passed_on_unread_past_its_bound() -> None:
    meter = Meter()
    reader = Events(meter, strip=True)
    piece = b"x" * (64 << 10)
    passed = sum(len(reader.feed(piece)) for _ in range(48))  # 3 MiB, no blank line
    # Kept at most MAX_EVENT_BYTES (and the piece over it) before it goes on.
    assert passed >= 48 * len(piece) - MAX_EVENT_BYTES - len(piece)
    assert passed + len(reader.end()) == 48 * len(piece)
    # An event's end that came a byte at a time goes on as soon as it is in.
    reader = Events(Meter(), strip=False)
    assert [reader.feed(b) for b in (b"data: x", b"\r", b"\n", b"\r", b"\n", b"data: y")] == [
        *[b""] * 4,
        b"data: x\r\n\r\n",
        b"",
    ]
    assert reader.end() == b"data: y"
    # A usage nested past the parser's stack is not read, and costs nothing else.
    deep = b'data: {"usage": ' + b"[" * 200_000 + b"\n\n"
    assert read_events(deep, meter, strip=True) == deep


def test_a_cut_answer_is_charged_for_what_was_passed_on() -> None:
    # An OpenAI stream cut after 6 events: its prompt estimated, a token per event.
    meter = Meter(events=6)
    meter.estimate(23)
    assert (meter.prompt, meter.completion) == (23, 6)
    # Anthropic's stream says its prompt first: kept; what was generated is what was passed on.
    meter = Meter(events=8)
    meter.take({"type": "message_start", "message": {"usage": {"input_tokens": 9, "output_tokens": 1}}})
    meter.estimate(23)
    assert (meter.prompt, meter.completion) == (9, 8)
    # Cut after its usage came: what the engine said, where it is more.
    meter = Meter(events=3)
    meter.take({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 5}})
    meter.estimate(23)
    assert (meter.prompt, meter.completion) == (4, 5)
    # An answer not streamed, cut after 401 bytes.
    meter = Meter(passed=401)
    meter.estimate(23)
    assert (meter.prompt, meter.completion) == (23, 101)
    # Embeddings: the prompt only.
    meter = Meter(passed=4000)
    meter.estimate(3, generates=False)
    assert (meter.prompt, meter.completion) == (3, 0)


# --- reservations -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_tokens_held_for_answers_in_flight_count_until_settled_or_dropped() -> None:
    budgets = Budgets(None)
    key = ApiKey(name="k", hash=secret_hash("sk-llmgw-k"), tpm=300)
    now = time.time()
    guess = Estimate(23, 73)
    held = [budgets.reserve_at_once(key, guess, now) for _ in range(6)]
    # Admitted while the minute's tokens and those held are under the tpm: 0, 73, … 292.
    assert [r is not None for r in held] == [True] * 5 + [False]
    assert budgets.held("k") == 365
    refused = await budgets.reserve(key, guess, now)
    # Only answers in flight hold the rest: they end sooner than the minute.
    assert refused == Limited("tokens", 300, 1, 365)
    first = held[0]
    assert first is not None
    first.settle(54, now)
    first.settle(54, now)  # once
    assert (budgets.held("k"), budgets.tokens("k", now)) == (292, 54)
    # A reservation dropped without an answer gives its tokens back.
    held.clear()
    assert budgets.held("k") == 0
    again = await budgets.reserve(key, Estimate(23, 10_000), now)
    assert not isinstance(again, Limited)
    assert again.tokens == 300  # at most the tpm
    assert isinstance(await budgets.reserve(key, guess, now), Limited)


# --- through the gateway ----------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_fields_of_another_type_are_refused_in_openais_words_and_never_sent() -> None:
    with sim_engines([]) as (engine,):
        async with proxy_over([engine]) as served, httpx.AsyncClient(timeout=30) as raw:
            cases = [
                ({"stream": "true"}, "stream", "a boolean", "a string"),
                ({"stream": 1}, "stream", "a boolean", "an integer"),
                (
                    {"stream": True, "stream_options": {"include_usage": "yes"}},
                    "stream_options.include_usage",
                    "a boolean",
                    "a string",
                ),
                ({"max_tokens": "50"}, "max_tokens", "an integer", "a string"),
            ]
            for fields, param, wanted, got in cases:
                body = {"model": "chat", "messages": CHAT, **fields}
                for path in ROUTED:
                    r = await raw.post(f"{served.url}{path}", json=body)
                    assert r.status_code == 400, (path, r.text)
                    assert r.json() == {
                        "error": {
                            "message": f"Invalid type for '{param}': expected {wanted}, but got {got} "
                            "instead.",
                            "type": "invalid_request_error",
                            "param": param,
                            "code": "invalid_type",
                        }
                    }
            # None of them reached the engine.
            assert metric((await raw.get(f"{engine}/metrics")).text, "llmgw_sim_requests_total") == 0
            # A null `stream` is no stream: answered whole, and counted.
            r = await raw.post(
                f"{served.url}{CHAT_PATH}",
                json={"model": "chat", "messages": CHAT, "stream": None, "max_tokens": 3},
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            scrape = (await raw.get(f"{served.url}/metrics")).text
            assert metric(scrape, 'llmgw_gateway_completion_tokens_total{deployment="chat",key="_"}') == 3


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_stream_the_client_cuts_is_charged_for_what_was_sent(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a streamed answer the client closed before its last (usage) chunk was
    charged nothing: the engine's words delivered, 0 tokens in usage and in the key's tpm."""
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines(["--tokens-per-second", "10"]) as (engine,):
        await serve_chat_and_other(bus, engine)
        probe, secret = "sk-llmgw-test-probe", "sk-llmgw-test-cut"
        for key in (
            ApiKey(name="probe", hash=secret_hash(probe)),
            ApiKey(name="cut", hash=secret_hash(secret), tpm=100_000),
        ):
            await bus.put(bus.names.keys_bucket, key.name, key)
        async with running_gateway(c, require_api_key=True) as (url, _), httpx.AsyncClient(timeout=30) as raw:

            async def up() -> bool:
                r = await raw.post(
                    f"{url}{CHAT_PATH}",
                    json={"model": "other", "messages": CHAT, "max_tokens": 1},
                    headers={"Authorization": f"Bearer {probe}"},
                )
                return r.status_code == 200

            await eventually(up, timeout=30, interval=0.2)
            # 200 words at 10 a second: 20 s whole; the client reads 6 of them and leaves.
            body = json.dumps({"model": "chat", "messages": CHAT, "max_tokens": 200, "stream": True}).encode()
            read = 0
            async with raw.stream(
                "POST", f"{url}{CHAT_PATH}", content=body, headers={"Authorization": f"Bearer {secret}"}
            ) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    read += line.startswith("data: {")
                    if read == 6:
                        break
            prompt = math.ceil(len(body) / 4)
            auth = {"Authorization": f"Bearer {secret}"}

            async def counted() -> tuple[float, float]:
                scrape = (await raw.get(f"{url}/metrics", headers=auth)).text
                line = '{name}_tokens_total{{deployment="chat",key="cut"}}'
                counts = (
                    metric(scrape, line.format(name="llmgw_gateway_prompt"), absent=0),
                    metric(scrape, line.format(name="llmgw_gateway_completion"), absent=0),
                )
                assert counts[0], "no prompt tokens counted for key cut"
                return counts

            # The prompt as estimated (the engine's count was in the chunk never sent), and a
            # token per event passed on: those the client read, and the few on their way.
            in_metrics = await eventually(counted, timeout=10, interval=0.1)
            assert in_metrics[0] == prompt
            assert 6 <= in_metrics[1] < 100, in_metrics

            async def recorded() -> dict[str, Any]:
                # ctl in a thread: this loop serves the gateway too.
                rows = [
                    row for row in await anyio.to_thread.run_sync(ctl_json, c, "usage") if row["key"] == "cut"
                ]
                assert rows, "no usage recorded for key cut"
                return rows[0]

            row = await eventually(recorded, timeout=30, interval=0.5)
            assert (row["prompt_tokens"], row["completion_tokens"], row["requests"]) == (*in_metrics, 1)
            spent = prompt + row["completion_tokens"]

            async def in_the_window() -> bool:
                found = await bus.get(bus.names.limits_bucket, "cut", KeyWindow)
                assert found is not None, "no window for key cut"
                assert found[0].tokens == spent, found
                return True

            await eventually(in_the_window, timeout=10, interval=0.1)


TPM = 300
MAX_TOKENS_ASKED = 50


@contextlib.asynccontextmanager
async def gateway_with_keys(url: str, *keys: ApiKey) -> AsyncIterator[tuple[str, Proxy]]:
    """The gateway's proxy in this process, served as `llmgw-gateway` serves it (its express lane
    included), over one ready sim replica of deployment `chat` at `url`, with `keys` required
    and their limits held here (no bus)."""
    table = Table(routing=RoutingConfig())
    table.set_replica(
        "chat.r0",
        ReplicaRecord(
            deployment="chat",
            replica="r0",
            profile="tiny",
            profile_fp="x",
            state="ready",
            url=url,
            engine="sim",
        ),
    )
    keyring = Keyring(required=True)
    for key in keys:
        keyring.set(key.name, key)
    async with httpx.AsyncClient(timeout=30) as client:
        await eventually(lambda: answers_health(client, url), timeout=30, interval=0.1)
        async with (
            Proxy(table, client, keyring=keyring, budgets=Budgets(None)) as proxy,
            anyio.create_task_group() as tg,
        ):
            proxy.loaded.set()
            port = await tg.start(serve_proxy, proxy)
            yield f"http://127.0.0.1:{port}", proxy
            tg.cancel_scope.cancel()


def key_of(name: str, tpm: int = 0) -> tuple[ApiKey, dict[str, str]]:
    secret = f"sk-llmgw-test-{name}"
    return ApiKey(name=name, hash=secret_hash(secret), tpm=tpm), {"Authorization": f"Bearer {secret}"}


async def answer_tokens(
    raw: httpx.AsyncClient, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, Any]:
    """One request's status, and its tokens as its answer said them (or its error)."""
    async with raw.stream("POST", f"{url}{CHAT_PATH}", content=body, headers=headers) as r:
        data = await r.aread()
    if r.status_code != 200:
        return r.status_code, json.loads(data)
    if not r.headers["content-type"].startswith("text/event-stream"):
        usage = json.loads(data)["usage"]
    else:
        events = [json.loads(e[6:]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]
        usage = next(e["usage"] for e in events if e.get("usage"))
    return 200, usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_forty_requests_at_once_spend_at_most_the_tpm_and_one_reservation() -> None:
    """Regression: with tpm 300, 40 requests sent at once were all admitted (the minute's count
    was 0 until the first answer ended) and 2,200 tokens served. Each request now reserves its
    prompt's estimate and its max_tokens before it is sent: the minute's tokens stay within the
    tpm and the reservation of the request admitted last, on the express lane (answers not
    streamed) and the ASGI path (streamed) alike."""
    lane, lane_auth = key_of("lane", TPM)
    streams, streams_auth = key_of("streams", TPM)
    warm, warm_auth = key_of("warm")
    with sim_engines(["--tokens-per-second", "200"]) as (engine,):
        async with (
            gateway_with_keys(engine, lane, streams, warm) as (url, proxy),
            httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=100)) as raw,
        ):
            # The replica's model name read once: the lane sends to a replica only then.
            first = json.dumps({"model": "chat", "messages": CHAT, "max_tokens": 1}).encode()
            assert (await answer_tokens(raw, url, first, warm_auth))[0] == 200
            for key, auth, stream in ((lane, lane_auth, False), (streams, streams_auth, True)):
                fields: dict[str, Any] = {"model": "chat", "messages": CHAT, "max_tokens": MAX_TOKENS_ASKED}
                if stream:
                    fields |= {"stream": True, "stream_options": {"include_usage": True}}
                body = json.dumps(fields).encode()
                # The most one request reserves: its body's bytes / 4, and its max_tokens.
                reservation = math.ceil(len(body) / 4) + MAX_TOKENS_ASKED
                if WINDOW_S - time.time() % WINDOW_S < 5:
                    await anyio.sleep(WINDOW_S - time.time() % WINDOW_S + 0.1)  # one minute's budget
                results: list[tuple[int, Any]] = []

                async def one(
                    body: bytes = body, auth: dict[str, str] = auth, results: list[tuple[int, Any]] = results
                ) -> None:
                    results.append(await answer_tokens(raw, url, body, auth))

                async with anyio.create_task_group() as tg:
                    for _ in range(40):
                        tg.start_soon(one)
                served = sum(tokens for status, tokens in results if status == 200)
                refused = [error for status, error in results if status == 429]
                assert len(results) == 40
                assert len(refused) == 40 - sum(s == 200 for s, _ in results), results
                assert 0 < served <= TPM + reservation, (served, results)
                assert refused, results
                message = refused[0]["error"]["message"]
                assert re.fullmatch(
                    rf"API key '{key.name}' is at its limit of {TPM} tokens \(prompt and completion\) per "
                    r"minute(, \d+ of them held for its requests in flight)?; retry in \d+s",
                    message,
                ), message

                # Every reservation settled once its answer ended: none left holding the key.
                def settled(name: str = key.name) -> bool:
                    return proxy.budgets.held(name) == 0

                await eventually(settled, timeout=10)
