"""Held requests released under attack: a few hundred held at zero replicas go out paced when a
replica is ready, each with the name its engine serves (read once), each answered 200; a key
revoked or expired while its request is held gets 401 at release, not an answer. A real gateway
on the session's NATS, and a replica's engine served in this process, as strict about the
model's name as vLLM."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from msgspec.structs import replace
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from llmgw_core.bus import Bus
from llmgw_core.keys import ApiKey, secret_hash
from llmgw_core.web import serve
from llmgw_gateway.holds import Holds
from llmgw_gateway.keyring import OPEN, Keyring, Refused
from llmgw_gateway.proxy import Proxy
from llmgw_gateway.routing import Table
from tests.cluster_support import cluster
from tests.gateway_support import gateway_process
from tests.test_gateway import metric
from tests.test_gateway_hold import AT_ZERO, BODY, gateway, held, record
from tests.test_gateway_hostile import open_files_at_least
from tests.waiting import eventually

SERVED = "served-tiny"


class Engine:
    """A replica's engine: it serves the model `served-tiny` and, as vLLM does, answers 404 to a
    request for any other name. Counts its `/v1/models` reads, and keeps when each completion
    request came and the name it asked for."""

    def __init__(self) -> None:
        self.lookups = 0
        self.came: list[float] = []
        self.names: list[str] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> Response:
        self.lookups += 1
        return JSONResponse({"object": "list", "data": [{"id": SERVED, "object": "model"}]})

    async def chat(self, request: Request) -> Response:
        self.came.append(time.monotonic())
        model = json.loads(await request.body()).get("model")
        self.names.append(model)
        if model != SERVED:
            return JSONResponse({"error": {"message": f"The model `{model}` does not exist."}}, 404)
        message = {"role": "assistant", "content": "a b c"}
        return JSONResponse(
            {
                "object": "chat.completion",
                "model": SERVED,
                "choices": [{"index": 0, "message": message, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
            }
        )


@contextlib.asynccontextmanager
async def engine_served() -> AsyncIterator[tuple[str, Engine]]:
    engine = Engine()
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, engine.app, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{port}", engine
        finally:
            tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_two_hundred_held_requests_go_out_paced_with_the_served_name_read_once_all_200(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Woken all at once, 1,000 held requests each read the replica's model name (most timed
    out and went without it) and each opened a connection to a replica that had just started
    (a third were refused)."""
    n, rate = 200, 200.0
    with (
        cluster(tmp_path, nats_url, prefix) as c,
        open_files_at_least(4 * n + 512),
    ):
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        async with (
            engine_served() as (engine_url, engine),
            gateway(c, hold_queue=n, hold_release_per_s=rate) as (url, _),
            httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n + 10)) as client,
            anyio.create_task_group() as tg,
        ):
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

            for _ in range(n):
                tg.start_soon(ask)
            await held(url, n)
            assert engine.came == []

            await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine_url))
            await eventually(lambda: len(answers) == n, timeout=60, interval=0.1)
            scrape = (await client.get(f"{url}/metrics")).text

        refused = [a.text for a in answers if a.status_code != 200]
        assert not refused, (len(refused), refused[:3])
        assert len(answers) == n
        assert all(a.json()["choices"][0]["message"]["content"] == "a b c" for a in answers)
        # One read of the name for the replica, and every request sent with it.
        assert engine.lookups == 1
        assert engine.names == [SERVED] * n
        # At most `rate` a second: the last went (n - 1) / rate after the first, at the earliest.
        assert max(engine.came) - min(engine.came) >= (n - 1) / rate * 0.95
        assert metric(scrape, 'llmgw_gateway_hold_wait_seconds_count{deployment="chat",outcome="sent"}') == n


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_key_revoked_or_expired_while_its_request_is_held_gets_401_at_release(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """A held request was served 27 s after its key was revoked."""
    secrets = {name: f"sk-llmgw-held-{name}" for name in ("revoked", "expiring", "deleted", "kept")}
    keys = {name: ApiKey(name=name, hash=secret_hash(secret)) for name, secret in secrets.items()}
    with cluster(tmp_path, nats_url, prefix) as c:
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        for name, key in keys.items():
            await bus.put(bus.names.keys_bucket, name, key)
        async with (
            engine_served() as (engine_url, engine),
            gateway(c, http={"port": 0, "require_api_key": True}) as (url, gw),
            httpx.AsyncClient(timeout=60) as client,
            anyio.create_task_group() as tg,
        ):
            answers: dict[str, httpx.Response] = {}

            async def ask(name: str) -> None:
                headers = {"Authorization": f"Bearer {secrets[name]}"}
                answers[name] = await client.post(f"{url}/v1/chat/completions", json=BODY, headers=headers)

            for name in secrets:
                tg.start_soon(ask, name)
            metrics = {"Authorization": f"Bearer {secrets['kept']}"}

            async def all_held() -> bool:
                scrape = (await client.get(f"{url}/metrics", headers=metrics)).text
                return metric(scrape, 'llmgw_gateway_held_requests{deployment="chat"}') == len(secrets)

            await eventually(all_held, timeout=30)
            # While they are held: one key revoked, one given an expiry a moment away, one deleted.
            revoked_at = time.time()
            expires = revoked_at + 0.2
            await bus.put(bus.names.keys_bucket, "revoked", replace(keys["revoked"], revoked_at=revoked_at))
            await bus.put(bus.names.keys_bucket, "expiring", replace(keys["expiring"], expires_at=expires))
            await bus.delete(bus.names.keys_bucket, "deleted")

            def heard() -> bool:
                # The gateway's watch of the keys bucket has both changes, and the key expired.
                return all(
                    isinstance(gw.keyring.identify(f"Bearer {secrets[n]}"), Refused)
                    for n in ("revoked", "expiring", "deleted")
                )

            await eventually(heard, timeout=10)
            await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine_url))
            await eventually(lambda: len(answers) == len(secrets), timeout=30)

        assert answers["kept"].status_code == 200, answers["kept"].text
        assert engine.names == [SERVED]  # the others were never sent
        for name, code, said in (
            (
                "revoked",
                "revoked_api_key",
                f"API key 'revoked' was revoked at {_utc(revoked_at)}; ask for a new key",
            ),
            (
                "expiring",
                "expired_api_key",
                f"API key 'expiring' expired at {_utc(expires)}; ask for a new key",
            ),
            ("deleted", "invalid_api_key", "API key 'deleted' was deleted"),
        ):
            answer = answers[name]
            assert answer.status_code == 401, (name, answer.text)
            error = answer.json()["error"]
            assert (error["type"], error["code"]) == ("authentication_error", code), name
            assert error["message"].startswith(said), error["message"]
            assert "for a ready replica of deployment chat and was not sent)" in error["message"]


def _utc(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))


@pytest.mark.anyio
@pytest.mark.timeout(180)
async def test_a_gateway_stopped_while_released_requests_wait_for_their_turn_answers_them_503(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Released one every 2 s, four held requests: the first is answered, and when the gateway
    is stopped the three still waiting for their turn are answered 503, not cut off."""
    with cluster(tmp_path, nats_url, prefix) as c:
        await bus.put(bus.names.deployments_bucket, "chat", AT_ZERO)
        async with (
            engine_served() as (engine_url, engine),
            httpx.AsyncClient(timeout=60) as client,
        ):
            with gateway_process(c, tmp_path, http={"require_api_key": False}, hold_release_per_s=0.5) as gw:
                url, proc = await gw.endpoint(), gw.proc
                answers: list[httpx.Response] = []
                async with anyio.create_task_group() as tg:

                    async def ask() -> None:
                        answers.append(await client.post(f"{url}/v1/chat/completions", json=BODY))

                    for _ in range(4):
                        tg.start_soon(ask)
                    await held(url, 4)
                    await bus.put(bus.names.replicas_bucket, "chat.r0", record("r0", engine_url))
                    await eventually(lambda: answers, timeout=30)
                    proc.send_signal(signal.SIGTERM)
                assert await anyio.to_thread.run_sync(lambda: proc.wait(timeout=30)) == 0
        assert [a.status_code for a in answers] == [200, 503, 503, 503], [a.text for a in answers]
        assert engine.names == [SERVED]
        for answer in answers[1:]:
            assert answer.json()["error"]["code"] == "gateway_restarting"
            assert answer.headers["retry-after"] == "1"


@pytest.mark.anyio
async def test_the_served_name_is_read_once_for_many_and_again_where_its_reader_was_cancelled() -> None:
    """Through httpx's transport seam: 50 requests asking at once make one read; a reader whose
    client left (cancelled) leaves the read to one of those waiting, not to nobody."""
    reads = 0
    answer = anyio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal reads
        reads += 1
        await answer.wait()
        return httpx.Response(200, json={"data": [{"id": SERVED}]})

    replica = record("r0", "http://replica.invalid:8000")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        proxy = Proxy(Table(), client)
        names: list[str | None] = []

        async def ask() -> None:
            names.append(await proxy.names.of(replica))

        first = anyio.CancelScope()

        async def lead() -> None:
            with first:
                await proxy.names.of(replica)

        async with anyio.create_task_group() as tg:
            tg.start_soon(lead)
            await eventually(lambda: reads == 1)
            for _ in range(50):
                tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            first.cancel()
            await eventually(lambda: reads == 2)
            answer.set()
        assert names == [SERVED] * 50
        assert reads == 2
        # Read, it is kept: no more reads.
        assert await proxy.names.of(replica) == SERVED
        assert reads == 2


# --- the pure parts -------------------------------------------------------------------------


def test_released_requests_get_turns_at_the_rate_first_come_first_and_a_next_release_waits_behind() -> None:
    holds = Holds(limit=10, timeout_s=60, release_per_s=4.0)
    first = [holds.add("chat") for _ in range(3)]
    assert holds.release("chat", now=100.0) == 3
    assert [h.at for h in first if h is not None] == [100.0, 100.25, 100.5]
    assert all(h is not None and h.woken.is_set() for h in first)
    # Held after the release, released while the first ones still go out: after them.
    later = [holds.add("chat") for _ in range(2)]
    holds.release("chat", now=100.1)
    assert [h.at for h in later if h is not None] == [100.75, 101.0]
    # Another deployment has turns of its own; one released long after starts now.
    other = holds.add("embed")
    holds.release("embed", now=100.1)
    assert other is not None
    assert other.at == 100.1
    again = holds.add("chat")
    holds.release("chat", now=500.0)
    assert again is not None
    assert again.at == 500.0
    assert holds.release("chat") == 0
    # The gateway stopping: those released and not yet at their turn are stopped, to be
    # answered rather than cut off; one that went out (removed) is left alone.
    waiting, gone = holds.add("chat"), holds.add("chat")
    assert waiting is not None
    assert gone is not None
    holds.release("chat", now=600.0)
    holds.remove(gone)
    holds.close()
    assert waiting.closing
    assert waiting.stopped.is_set()
    assert not gone.stopped.is_set()


def test_recheck_refuses_a_key_revoked_expired_or_deleted_since_it_was_identified() -> None:
    secret = "sk-llmgw-recheck"
    key = ApiKey(name="team", hash=secret_hash(secret), expires_at=2000.0)
    ring = Keyring(required=True)
    ring.set("team", key)
    found = ring.identify(f"Bearer {secret}", now=1000.0)
    assert found == key
    assert ring.recheck(key, now=1500.0) == key
    expired = ring.recheck(key, now=2000.0)
    assert isinstance(expired, Refused)
    assert expired.code == "expired_api_key"
    ring.set("team", ApiKey(name="team", hash=key.hash, revoked_at=1200.0))
    revoked = ring.recheck(key, now=1500.0)
    assert isinstance(revoked, Refused)
    assert revoked.code == "revoked_api_key"
    ring.set("team", None)
    deleted = ring.recheck(key, now=1500.0)
    assert deleted == Refused(
        "API key 'team' was deleted; send `Authorization: Bearer <key>` with a key that "
        "`llmgw ctl keys create` made",
        "invalid_api_key",
    )
    # A name made again with another secret is another key.
    ring.set("team", ApiKey(name="team", hash=secret_hash("sk-llmgw-other")))
    assert isinstance(ring.recheck(key, now=1500.0), Refused)
    # Open access stays open.
    assert Keyring(required=False).recheck(OPEN) is OPEN
