"""Client API keys as an operator makes them (`llmgw ctl keys`) and a client sees them through
the gateway (the official `openai` client): models per key, expiry, revocation, limits shared
by two gateway processes, and the usage each key spent (`llmgw ctl usage`, `/metrics`)."""

from __future__ import annotations

import contextlib
import gzip
import json
import re
import subprocess
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import msgspec
import openai
import pytest
from prometheus_client import CollectorRegistry

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.keys import (
    WINDOW_S,
    ApiKey,
    KeyWindow,
    Spent,
    parse_duration,
    retry_after,
    secret_hash,
)
from llmgw_core.lifecycle import connect_service
from llmgw_core.natsd import NatsServer
from llmgw_gateway import Gateway, GatewayConfig
from llmgw_gateway import budgets as budgets_module
from llmgw_gateway.budgets import CLAIM_TIMEOUT_S, Budgets, Limited, batch, chunk
from llmgw_gateway.usage import JsonTail, Meter, Usage, read_events
from llmgw_placement.usage import UsageRow, UsageWindow
from tests.cluster_support import Cluster, cluster
from tests.gateway_support import gateway_process
from tests.nats_link import nats_link
from tests.test_ctl import CTL
from tests.test_gateway import metric, running_gateway
from tests.test_gateway_api import sim_engines
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

CHAT = [{"role": "user", "content": "hello"}]
# What the sim engine counts for CHAT: the words of its JSON, and max_tokens words back.
PROMPT_TOKENS = 4


def ctl(c: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CTL, "--prefix", c.prefix, *args],
        env=c.ctl_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def ctl_json(c: Cluster, *args: str) -> Any:
    done = ctl(c, *args, "-o", "json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def new_key(c: Cluster, name: str, *flags: str) -> str:
    created = ctl_json(c, "keys", "create", name, *flags)
    assert created["name"] == name
    secret = created["secret"]
    assert isinstance(secret, str)
    assert secret.startswith("sk-llmgw-")
    return secret


async def serve_chat_and_other(bus: Bus, url: str) -> None:
    """Deployments `chat` (alias gpt-4o) and `other`, each with a ready replica at `url`."""
    for name, aliases in (("chat", ("gpt-4o",)), ("other", ())):
        await bus.put(
            bus.names.deployments_bucket, name, Deployment(name=name, profile="tiny", aliases=aliases)
        )
        record = ReplicaRecord(
            deployment=name,
            replica="r0",
            profile="tiny",
            profile_fp="x",
            state="ready",
            url=url,
            engine="sim",
        )
        await bus.put(bus.names.replicas_bucket, f"{name}.r0", record)


def client(url: str, secret: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0, timeout=30)


async def chat(url: str, secret: str, model: str = "chat", **more: Any) -> Any:
    async with client(url, secret) as c:
        return await c.chat.completions.create(model=model, messages=CHAT, **{"max_tokens": 5, **more})  # type: ignore[arg-type]


async def refusal(url: str, secret: str) -> dict[str, Any]:
    """The 401 body the gateway answers `secret` with; AssertionError while it serves it."""
    try:
        await chat(url, secret)
    except openai.AuthenticationError as exc:
        body: dict[str, Any] = exc.body  # type: ignore[assignment]
        return body
    raise AssertionError(f"{secret[:12]}… still served")


async def test_a_key_sees_only_its_models_and_is_refused_once_expired_or_revoked(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([]) as (engine,):
        await serve_chat_and_other(bus, engine)
        team = new_key(c, "team", "--models", "chat")
        everything = new_key(c, "all")
        brief = new_key(c, "brief", "--expires", "2s")
        # The secret is stored only as its hash.
        stored = await bus.get(bus.names.keys_bucket, "team", ApiKey)
        assert stored is not None
        assert team not in json.dumps(msgspec.to_builtins(stored[0]))
        async with running_gateway(c, require_api_key=True) as (url, _):

            async def served() -> bool:
                return bool((await chat(url, team)).choices[0].message.content)

            await eventually(served, timeout=30, interval=0.2)

            # The key sees its model only, by name or alias; another is unknown to it, as one
            # that does not exist (never a 403 that confirms its name).
            async with client(url, team) as oc:
                assert [m.id for m in (await oc.models.list()).data] == ["chat"]
                assert (await oc.models.retrieve("gpt-4o")).id == "chat"
                for model in ("other", "nope"):
                    with pytest.raises(openai.NotFoundError) as hidden:
                        await oc.chat.completions.create(model=model, messages=CHAT)  # type: ignore[arg-type]
                    known = "chat (aliases: gpt-4o)"
                    assert hidden.value.body == {
                        "message": f"model '{model}' is not served here; known models: {known}",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "model_not_found",
                    }
                    with pytest.raises(openai.NotFoundError):
                        await oc.models.retrieve(model)
            async with client(url, everything) as oc:
                assert [m.id for m in (await oc.models.list()).data] == ["chat", "other"]
                done = await oc.chat.completions.create(model="other", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
                assert done.choices[0].message.content

            # No key, a wrong one, an expired one: 401 in OpenAI's shape.
            async with httpx.AsyncClient(timeout=30) as raw:
                r = await raw.get(f"{url}/v1/models")
                assert r.status_code == 401
                assert r.json()["error"]["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError) as wrong:
                await chat(url, "sk-llmgw-not-a-key")
            assert wrong.value.body["code"] == "invalid_api_key"  # type: ignore[index]

            body = await eventually(partial(refusal, url, brief), timeout=30, interval=0.2)
            assert body["code"] == "expired_api_key"
            assert re.fullmatch(
                r"API key 'brief' expired at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ; ask for a new key",
                body["message"],
            ), body

            # Revoked while this gateway runs: refused as soon as it hears.
            done = ctl(c, "keys", "revoke", "team")
            assert done.returncode == 0, done.stderr
            assert done.stdout == "key team revoked: every gateway refuses it (401) as soon as it hears\n"

            revoked = await eventually(partial(refusal, url, team), timeout=30, interval=0.1)
            assert revoked == {
                "message": revoked["message"],
                "type": "authentication_error",
                "param": None,
                "code": "revoked_api_key",
            }
            assert re.fullmatch(r"API key 'team' was revoked at \S+Z; ask for a new key", revoked["message"])
            assert (await chat(url, everything)).choices[0].message.content

        # What the operator sees: states, models, limits; never a secret.
        listed = ctl_json(c, "keys", "list")
        assert [(k["name"], k["state"], k["models"]) for k in listed] == [
            ("all", "active", []),
            ("brief", "expired", []),
            ("team", "revoked", ["chat"]),
        ]
        text = ctl(c, "keys", "list").stdout
        assert team not in text
        assert everything not in text
        assert ctl_json(c, "keys", "describe", "team")["fingerprint"] == stored[0].hash[:8]
        again = ctl(c, "keys", "create", "team")
        assert again.returncode == 4
        assert again.stderr.startswith("llmgw: key team exists already")
        missing = ctl(c, "keys", "revoke", "nobody")
        assert (missing.returncode, missing.stderr) == (
            3,
            "llmgw: no key nobody (`llmgw ctl keys list` lists them)\n",
        )
        bad = ctl(c, "keys", "create", "x", "--expires", "soon")
        assert (bad.returncode, bad.stderr) == (
            2,
            "llmgw: --expires 'soon': give a duration such as 30d, 12h, 90m, 45s or 2w\n",
        )


def a_minute_just_begun() -> Callable[[], float]:
    """A Unix clock set back so that its minute began half a second ago (`Budgets`' seam): a
    test of one minute's budget neither straddles two minutes nor waits for the next."""
    shift = time.time() % WINDOW_S - 0.5
    return lambda: time.time() - shift


async def early_in_a_minute(margin: float = 40.0) -> None:
    """Wait for a limit's minute (Unix time // 60) to have `margin` seconds left: a test of
    one minute's budget must not straddle two."""
    left = WINDOW_S - time.time() % WINDOW_S
    if left < margin:
        await anyio.sleep(left + 0.1)


@pytest.mark.slow  # two gateway processes and a cluster, within one minute of the limits
async def test_two_gateway_processes_share_one_key_budget(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with (
        cluster(tmp_path, nats_url, prefix) as c,
        sim_engines([]) as (engine,),
        gateway_process(c, tmp_path / "g1") as g1,
        gateway_process(c, tmp_path / "g2") as g2,
    ):
        one, two = await g1.endpoint(), await g2.endpoint()
        await serve_chat_and_other(bus, engine)
        probe = new_key(c, "probe")
        for url in (one, two):

            async def up(url: str = url) -> bool:
                return bool((await chat(url, probe)).choices)

            await eventually(up, timeout=60, interval=0.2)

        # Requests: 5 a minute in all, however the client spreads them over the two gateways.
        secret = new_key(c, "rpm5", "--rpm", "5")
        await early_in_a_minute()
        answered: list[str] = []
        refused: list[openai.RateLimitError] = []
        for i in range(12):
            try:
                await chat(one if i % 2 else two, secret)
                answered.append("ok")
            except openai.RateLimitError as exc:
                refused.append(exc)
        assert len(answered) == 5, (answered, [str(r) for r in refused])
        assert len(refused) == 7
        first = refused[0]
        assert first.status_code == 429
        retry_after = int(first.response.headers["retry-after"])
        assert 1 <= retry_after <= WINDOW_S
        body: dict[str, Any] = first.body  # type: ignore[assignment]
        assert body["type"] == "requests"
        assert body["code"] == "rate_limit_exceeded"
        assert re.fullmatch(
            r"API key 'rpm5' is at its limit of 5 requests per minute; retry in \d+s", body["message"]
        ), body

        # Tokens: what one gateway's answers spent counts at the other.
        secret = new_key(c, "tpm20", "--tpm", "20")
        await early_in_a_minute()
        spent = 0
        over: openai.RateLimitError | None = None
        while over is None and spent < 100:
            try:
                await chat(one, secret)
                spent += PROMPT_TOKENS + 5
            except openai.RateLimitError as exc:
                over = exc
        assert over is not None
        assert over.body["type"] == "tokens"  # type: ignore[index]
        assert 20 <= spent < 20 + 2 * (PROMPT_TOKENS + 5)

        async def refused_at_two() -> bool:
            # Answered (the spend not heard there yet) is a try again, not a failure.
            try:
                await chat(two, secret)
            except openai.RateLimitError as exc:
                return exc.body["type"] == "tokens"  # type: ignore[index,no-any-return]
            return False

        assert await eventually(refused_at_two, timeout=10, interval=0.1)


async def stream_text(url: str, secret: str, **more: Any) -> tuple[str, list[dict[str, Any]]]:
    """A streamed chat completion as raw SSE: its words, and its chunks."""
    body = {"model": "chat", "messages": CHAT, "max_tokens": 5, "stream": True, **more}
    headers = {"Authorization": f"Bearer {secret}"}
    async with (
        httpx.AsyncClient(timeout=30) as raw,
        raw.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        sse = b"".join([chunk async for chunk in r.aiter_raw()])
    events = sse.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    return text, chunks


async def test_usage_per_key_and_deployment_streamed_or_not(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([]) as (engine,):
        await serve_chat_and_other(bus, engine)
        a = new_key(c, "a")
        b = new_key(c, "b")
        async with running_gateway(c, require_api_key=True) as (url, _):

            async def served() -> bool:
                return bool((await chat(url, b, model="other", max_tokens=3)).choices)

            await eventually(served, timeout=30, interval=0.2)
            # Not streamed: the engine's usage, as the client sees it.
            done = await chat(url, a)
            assert done.usage is not None
            assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (PROMPT_TOKENS, 5)
            # Streamed without asking for usage: the words only, no usage chunk.
            text, chunks = await stream_text(url, a)
            assert len(text.split()) == 5
            assert all(ch["choices"] and "usage" not in ch for ch in chunks), chunks
            # Streamed, asking: the usage chunk comes through, once.
            text, chunks = await stream_text(url, a, stream_options={"include_usage": True})
            assert len(text.split()) == 5
            assert [ch["usage"] for ch in chunks if ch.get("usage")] == [
                {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 5, "total_tokens": PROMPT_TOKENS + 5}
            ]
            # The official client, streaming with usage asked for.
            async with client(url, a) as oc:
                stream = await oc.chat.completions.create(
                    model="gpt-4o",
                    messages=CHAT,  # type: ignore[arg-type]
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                usage = [ch.usage async for ch in stream if ch.usage is not None]
            assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(PROMPT_TOKENS, 5)]

            want = [
                {
                    "key": "a",
                    "deployment": "chat",
                    "prompt_tokens": 16,
                    "completion_tokens": 20,
                    "requests": 4,
                },
            ]

            def rows(*args: str) -> list[dict[str, Any]]:
                found: list[dict[str, Any]] = ctl_json(c, "usage", *args)
                return found

            async def recorded() -> list[dict[str, Any]]:
                found = rows()
                # b's first requests may have met the replica before it was known ready.
                assert [r["key"] for r in found] == ["a", "b"], found
                assert found[0] == want[0], found
                assert found[1]["deployment"] == "other", found
                assert found[1]["requests"] >= 1, found
                return found

            found = await eventually(recorded, timeout=30, interval=0.5)
            b_requests = found[1]["requests"]
            assert found[1]["prompt_tokens"] == PROMPT_TOKENS * b_requests
            assert found[1]["completion_tokens"] == 3 * b_requests
            by_deployment = rows("--by", "deployment")
            assert [(r["key"], r["deployment"], r["requests"]) for r in by_deployment] == [
                ("*", "chat", 4),
                ("*", "other", b_requests),
            ]
            by_key = rows("--by", "key", "--since", "1h")
            assert [(r["key"], r["deployment"], r["prompt_tokens"]) for r in by_key] == [
                ("a", "*", 16),
                ("b", "*", PROMPT_TOKENS * b_requests),
            ]
            # And as Prometheus counters, per key and deployment.
            async with httpx.AsyncClient(timeout=30) as raw:
                scrape = (await raw.get(f"{url}/metrics", headers={"Authorization": f"Bearer {a}"})).text
            assert metric(scrape, 'llmgw_gateway_prompt_tokens_total{deployment="chat",key="a"}') == 16
            assert metric(scrape, 'llmgw_gateway_completion_tokens_total{deployment="chat",key="a"}') == 20
            assert metric(scrape, 'llmgw_gateway_key_requests_total{deployment="chat",key="a"}') == 4
        bad = ctl(c, "usage", "--since", "yesterday")
        assert (bad.returncode, bad.stderr) == (
            2,
            "llmgw: --since 'yesterday': give a duration such as 24h, 30d, 90m or 2w\n",
        )


def test_durations_windows_and_an_answers_usage_read_as_the_gateway_reads_them() -> None:
    assert [parse_duration(t) for t in ("30d", "12h", "90m", "45s", "2w")] == [
        30 * 86400,
        12 * 3600,
        90 * 60,
        45,
        14 * 86400,
    ]
    assert [parse_duration(t) for t in ("0d", "1y", "soon", "", "-1h")] == [None] * 5
    assert retry_after(120.0) == 60
    assert retry_after(179.5) == 1
    assert chunk(5) == 1
    assert chunk(600) == 60
    assert chunk(100_000) == 100
    # A gateway serving a key fast claims two seconds of its rate at once, within a tenth of
    # the limit and what the minute has left; a slow one, the smallest batch.
    assert batch(10**9, rate=1400.0, left_s=30) == 2800
    assert batch(10**9, rate=1400.0, left_s=0.5) == 700
    assert batch(10**9, rate=1400.0, left_s=0) == 100
    assert batch(12_000, rate=1400.0, left_s=30) == 1200
    assert batch(600, rate=0.5, left_s=30) == 60
    # A stream whose engine was asked for usage: the usage-only chunk is read, then dropped
    # for a client that did not ask; kept for one that did.
    words = b'data: {"choices": [{"delta": {"content": "hi"}}], "usage": null}'
    last = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
    chunk_ = words + b"\n\n" + last + b"\n\ndata: [DONE]\n\n"
    meter = Meter()
    assert read_events(chunk_, meter, strip=True) == words + b"\n\ndata: [DONE]\n\n"
    assert (meter.prompt, meter.completion) == (7, 3)
    assert read_events(chunk_, Meter(), strip=False) == chunk_
    # Anthropic's stream says input tokens first, output tokens last.
    meter = Meter()
    start = (
        b'event: message_start\ndata: {"type": "message_start", "message": {"usage": {"input_tokens": 9}}}'
    )
    delta = b'event: message_delta\ndata: {"type": "message_delta", "usage": {"output_tokens": 4}}'
    assert (
        read_events(start + b"\n\n" + delta + b"\n\n", meter, strip=True) == start + b"\n\n" + delta + b"\n\n"
    )
    assert (meter.prompt, meter.completion) == (9, 4)


async def test_while_nats_is_down_a_gateway_holds_each_key_to_its_limit_on_its_own(
    own_nats: NatsServer, prefix: str
) -> None:
    """No request waits for NATS to come back, and none goes past the key's limit at this gateway."""
    options = BusOptions(url=own_nats.url, prefix=prefix, insecure=True)
    secret = "sk-llmgw-test-secret"
    async with await Bus.connect(options, service="test") as bus, anyio.create_task_group() as tg:
        await bus.ensure()
        with sim_engines([]) as (engine,):
            await serve_chat_and_other(bus, engine)
            key = ApiKey(name="k", hash=secret_hash(secret), rpm=3)
            await bus.put(bus.names.keys_bucket, "k", key)
            config = msgspec.convert(
                {"nats": {"url": own_nats.url, "prefix": prefix, "insecure": True}, "http": {"port": 0}},
                GatewayConfig,
            )
            gateway_bus = await connect_service(config.nats, "gateway", ensure=False)
            async with gateway_bus:
                gateway = Gateway(config, gateway_bus)
                port = await tg.start(gateway.run)
                url = f"http://127.0.0.1:{port}"
                async with httpx.AsyncClient(timeout=10) as raw:

                    async def engine_up() -> bool:
                        with contextlib.suppress(httpx.ConnectError):
                            return (await raw.get(f"{engine}/health")).status_code == 200
                        return False

                    await eventually(engine_up, timeout=30, interval=0.1)
                await early_in_a_minute()
                assert (await chat(url, secret)).choices

                # One request claimed for it, and the next claimed ahead (the batch is 1).
                async def claimed() -> bool:
                    window = await bus.get(bus.names.limits_bucket, "k", KeyWindow)
                    assert window is not None
                    assert window[0].requests == 2
                    return True

                await eventually(claimed, timeout=10)
                own_nats.stop()
                # The two requests left of the minute, granted here; the next refused.
                for _ in range(2):
                    assert (await chat(url, secret)).choices
                with pytest.raises(openai.RateLimitError):
                    await chat(url, secret)
                tg.cancel_scope.cancel()


async def test_usage_kept_through_a_nats_outage_is_summed_per_key_and_deployment_and_stored_once(
    own_nats: NatsServer, prefix: str
) -> None:
    """While NATS is down, a gateway's usage is summed per key and deployment, not piled up one
    record a second; once it is back, every token is stored, and stored once. Regression: each
    second of an outage kept one more record per key and deployment in memory, all written one
    by one when the bus came back."""
    options = BusOptions(url=own_nats.url, prefix=prefix, insecure=True)
    pairs = [("k1", "chat"), ("k2", "chat"), ("k1", "other")]
    spent = {pair: [0, 0, 0] for pair in pairs}
    async with await Bus.connect(options, service="gateway") as bus:
        await bus.ensure()
        usage = Usage(bus, CollectorRegistry())

        def serve(prompt: int) -> None:
            for key, deployment in pairs:
                usage.add(key, deployment, Meter(prompt=prompt, completion=5))
                counts = spent[(key, deployment)]
                counts[0] += prompt
                counts[1] += 5
                counts[2] += 1

        serve(3)
        await usage.flush()
        await anyio.to_thread.run_sync(own_nats.stop)
        for second in range(10):
            serve(10 + second)
            # A flush while the bus is gone: refused, or given up (the record it was sending
            # may still land once NATS is back, and must then be stored once).
            with anyio.move_on_after(0.3), contextlib.suppress(BusError):
                await usage.flush()
            assert len(usage._unsent) <= len(pairs) + 1, usage._unsent
        await anyio.to_thread.run_sync(own_nats.start)

        async def written() -> bool:
            with contextlib.suppress(BusError):
                await usage.flush()
            return not usage._unsent

        await eventually(written, timeout=60, interval=0.5)
        # As placement reads the stream for `ctl usage`.
        window = UsageWindow(bus)
        wanted = [
            UsageRow(key=k, deployment=d, prompt_tokens=p, completion_tokens=c, requests=n)
            for (k, d), (p, c, n) in sorted(spent.items())
        ]
        async with anyio.create_task_group() as tg:
            tg.start_soon(window.follow)
            await eventually(lambda: window.rows() == wanted, timeout=30)
            tg.cancel_scope.cancel()
        assert window.rows() == wanted
        stored = (await bus.js.stream_info(bus.names.usage_stream)).state.messages
        # The first flush's records, then at most the one being sent and one per pair.
        assert stored <= 2 * len(pairs) + 1, stored


async def test_tokens_not_yet_shared_count_only_in_the_minute_they_were_spent() -> None:
    """Tokens a gateway could not add to the shared window (NATS down: no flush runs here) hold
    the key to its tpm in their own minute only. Regression: they were added to every later
    minute's count, so a key at its limit for one minute of an outage was refused until NATS
    came back."""
    budgets = Budgets(None)
    key = ApiKey(name="k", hash=secret_hash("sk-llmgw-test"), tpm=100)
    start = 1000 * WINDOW_S
    budgets.charge(key, 60, now=start + 1)
    assert await budgets.admit(key, now=start + 2) is None
    budgets.charge(key, 40, now=start + 3)
    refused = await budgets.admit(key, now=start + 4)
    assert refused == Limited("tokens", 100, retry_after(start + 4))
    # The next minute starts from nothing, and is held to its own limit.
    assert budgets.tokens("k", start + WINDOW_S) == 0
    assert await budgets.admit(key, now=start + WINDOW_S + 1) is None
    budgets.charge(key, 100, now=start + WINDOW_S + 2)
    assert budgets.tokens("k", start + WINDOW_S + 3) == 100
    assert await budgets.admit(key, now=start + WINDOW_S + 3) is not None
    # A minute with no request of the key reads none of the last one's.
    assert budgets.tokens("k", start + 3 * WINDOW_S) == 0


async def test_requests_admitted_at_once_count_with_the_others_and_never_pass_a_limit() -> None:
    """The express lane admits a request without waiting (`admit_at_once`) only out of a batch
    already claimed, counted in it; a batch to claim or a limit reached is for `admit`."""
    budgets = Budgets(None)
    key = ApiKey(name="k", hash=secret_hash("sk-llmgw-test"), rpm=50)
    start = 1000 * WINDOW_S
    # Nothing claimed yet this minute.
    assert not budgets.admit_at_once(key, start + 1)
    at_once = waited = 0
    for n in range(100):
        now = start + 1 + n * 0.1
        if budgets.admit_at_once(key, now):
            at_once += 1
        elif await budgets.admit(key, now=now) is None:
            waited += 1
        else:
            break
    assert at_once + waited == 50
    assert at_once > waited > 0
    assert not budgets.admit_at_once(key, start + 30)
    assert await budgets.admit(key, now=start + 30) == Limited("requests", 50, retry_after(start + 30))
    # Tokens: at the tpm, nothing at once either.
    spender = ApiKey(name="t", hash=secret_hash("sk-llmgw-test-2"), tpm=100)
    assert budgets.admit_at_once(spender, start + 1)
    budgets.charge(spender, 100, now=start + 2)
    assert not budgets.admit_at_once(spender, start + 3)
    assert await budgets.admit(spender, now=start + 3) == Limited("tokens", 100, retry_after(start + 3))


async def test_a_limits_write_whose_answer_was_lost_is_counted_once(
    own_nats: NatsServer, prefix: str
) -> None:
    """A gateway's write to the limits bucket lands and its answer is lost on the way back (the
    link to NATS fails mid-request): the gateway times out, reconnects and writes again. Every
    token and request is counted once, beside another gateway's. Regression: the write added
    its tokens again on top of those that had landed, so a key was refused short of its tpm."""
    key = ApiKey(name="k", hash=secret_hash("sk-x"), rpm=1000, tpm=10**6)
    async with (
        nats_link(own_nats.port) as link,
        await Bus.connect(BusOptions(url=own_nats.url, prefix=prefix, insecure=True), service="test") as bus,
        await Bus.connect(BusOptions(url=link.url, prefix=prefix, insecure=True), service="gateway") as lossy,
    ):
        await bus.ensure()
        clock = a_minute_just_begun()
        budgets, other = Budgets(lossy, writer="gw-a", clock=clock), Budgets(bus, writer="gw-b", clock=clock)
        bucket = bus.names.limits_bucket

        async def stored(requests: int, tokens: int) -> KeyWindow:
            found = await bus.get(bucket, "k", KeyWindow)
            assert found is not None
            assert (found[0].requests, found[0].tokens) == (requests, tokens), found[0]
            return found[0]

        async with anyio.create_task_group() as tg:
            await tg.start(budgets.run)
            await tg.start(other.run)
            # Each claims a batch of the minute's requests (a tenth of rpm).
            assert await budgets.admit(key) is None
            assert await other.admit(key) is None
            budgets.charge(key, 100)
            other.charge(key, 7)
            await eventually(partial(stored, 200, 107), timeout=10)

            link.lose_answers_after(f"$KV.{bucket}.k", deaf_s=CLAIM_TIMEOUT_S + 1)
            budgets.charge(key, 50)
            with anyio.fail_after(10):
                await link.lost.wait()
            with anyio.fail_after(10):
                await link.cut.wait()
            # The write landed; once the gateway is through again it has nothing left to add.
            await eventually(partial(stored, 200, 157), timeout=10)
            local = budgets._local["k"]
            await eventually(lambda: local.shared_tokens == local.tokens == 150, timeout=30)
            other.charge(key, 3)
            window = await eventually(partial(stored, 200, 160), timeout=10)
            assert window.by == {budgets.writer: Spent(100, 150), other.writer: Spent(100, 10)}
            tg.cancel_scope.cancel()


async def test_a_window_an_older_gateway_wrote_without_parts_holds_this_ones_part_once(
    nats_url: str, prefix: str
) -> None:
    """During a rolling upgrade a gateway of an older release adds to a key's totals and writes
    the value without the gateways' parts. The totals still hold this gateway's part: it is
    neither counted twice in admission nor added again by its next write."""
    key = ApiKey(name="k", hash=secret_hash("sk-x"), rpm=1000, tpm=10**6)
    async with await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test") as bus:
        await bus.ensure()
        clock = a_minute_just_begun()
        budgets = Budgets(bus, writer="gw-new", clock=clock)
        bucket = bus.names.limits_bucket

        async def stored(requests: int, tokens: int) -> tuple[KeyWindow, int]:
            found = await bus.get(bucket, "k", KeyWindow)
            assert found is not None
            assert (found[0].requests, found[0].tokens) == (requests, tokens), found[0]
            return found

        async with anyio.create_task_group() as tg:
            await tg.start(budgets.run)
            assert await budgets.admit(key) is None  # a batch of 100 requests claimed
            budgets.charge(key, 40)
            value, rev = await eventually(partial(stored, 100, 40), timeout=10)
            # The older gateway claims 100 requests and adds 5 tokens, its way: totals only.
            older = KeyWindow(window=value.window, requests=value.requests + 100, tokens=value.tokens + 5)
            assert await bus.update(bucket, "k", older, last=rev) is not None
            budgets.observe("k", older)  # as the gateway's watch of the bucket shows it
            assert budgets.tokens("k", clock()) == 45
            budgets.charge(key, 10)
            value, _ = await eventually(partial(stored, 200, 55), timeout=10)
            assert value.by == {budgets.writer: Spent(100, 50)}
            tg.cancel_scope.cancel()


async def test_tokens_far_from_a_keys_tpm_wait_for_the_idle_flush_and_near_it_do_not(
    nats_url: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway adds tokens that cannot bring their key near its tpm on the idle flush (each
    write held a request in flight; short answers wrote every 50 ms), and those that can
    within FLUSH_S: a twentieth of the tpm not yet added, or the key's minute at half of it."""
    key = ApiKey(name="k", hash=secret_hash("sk-x"), tpm=1000)
    async with await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test") as bus:
        await bus.ensure()
        budgets = Budgets(bus, writer="gw", clock=a_minute_just_begun())
        bucket = bus.names.limits_bucket

        async def stored() -> int:
            found = await bus.get(bucket, "k", KeyWindow)
            return 0 if found is None else found[0].tokens

        async def written(tokens: int) -> bool:
            return await stored() == tokens

        async with anyio.create_task_group() as tg:
            await tg.start(budgets.run)
            budgets.charge(key, 10)  # far from the limit: the idle flush adds it
            await eventually(partial(written, 10), timeout=10)
            # From here the idle flush would take 30 s: what is written sooner was urgent.
            monkeypatch.setattr(budgets_module, "FLUSH_IDLE_S", 30.0)
            budgets.charge(key, 20)
            await anyio.sleep(1)
            assert await stored() == 10
            budgets.charge(key, 30)  # 50 unsent: a twentieth of the tpm
            await eventually(partial(written, 60), timeout=10)
            budgets.charge(key, 439)
            await eventually(partial(written, 499), timeout=10)
            budgets.charge(key, 1)  # 1 token unsent, but the minute is at half the tpm
            await eventually(partial(written, 500), timeout=10)
            tg.cancel_scope.cancel()


def test_a_json_answers_usage_is_read_from_its_end_plain_or_gzipped() -> None:
    answer = {
        "choices": [
            {"message": {"content": 'a reply quoting "usage": {"prompt_tokens": 999}' + "x" * 100_000}}
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 34, "total_tokens": 46},
    }
    body = json.dumps(answer).encode()
    for encoding, sent in (("", body), ("gzip", gzip.compress(body))):
        tail, meter = JsonTail(encoding), Meter()
        for at in range(0, len(sent), 4096):
            tail.feed(sent[at : at + 4096])
        tail.read(meter)
        assert (meter.prompt, meter.completion) == (12, 34), encoding
    # Anthropic's names; an answer without usage, or cut short, reads as none.
    tail, meter = JsonTail(""), Meter()
    tail.feed(b'{"content": [], "usage": {"input_tokens": 5, "output_tokens": 6}}')
    tail.read(meter)
    assert (meter.prompt, meter.completion) == (5, 6)
    for text in (b'{"choices": []}', b'{"usage": {"prompt_tok'):
        tail, meter = JsonTail(""), Meter()
        tail.feed(text)
        tail.read(meter)
        assert (meter.prompt, meter.completion) == (0, 0)


async def test_a_request_whose_claim_outlives_its_minute_is_judged_in_the_next(
    nats_url: str, prefix: str
) -> None:
    """A claim on the bus when the minute ends: a request of the next minute resets the count
    meanwhile. The request that waited is admitted in the new minute, not refused for the
    old one's (at 256 in flight, every request waiting on that claim was a 429)."""
    async with await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test") as bus:
        await bus.ensure()
        budgets = Budgets(bus)
        key = ApiKey(name="k", hash=secret_hash("sk-x"), rpm=10**9)
        end = (int(time.time() // WINDOW_S) + 1) * WINDOW_S
        answers: dict[str, object] = {}

        async def admit(name: str, at: float) -> None:
            answers[name] = await budgets.admit(key, at)

        async with anyio.create_task_group() as tg:
            # The minute's first request claims a batch: it is on the bus when the next
            # minute's first request arrives.
            tg.start_soon(admit, "last of the minute", end - 0.001)
            await anyio.lowlevel.checkpoint()
            tg.start_soon(admit, "first of the next", end + 0.001)
        assert answers == {"last of the minute": None, "first of the next": None}
        window = await bus.get(bus.names.limits_bucket, "k", KeyWindow)
        assert window is not None
        assert window[0].window == end // WINDOW_S
