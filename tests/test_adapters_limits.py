"""Each LoRA adapter's own limits: rpm and tpm across every key that calls it, counted by the
gateways together in the limits bucket, written on the adapter, shown by ctl, and never part of
the base profile's fingerprint (changing one replaces no replica)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.ctl._adapters import AdapterView, limit_words, limits
from llmgw_core.adapter_rules import adapter_problem
from llmgw_core.adapters import LIMIT_MAX, Adapter, AdapterQuota, ServedAdapter, adapter_quotas
from llmgw_core.bus import Bus
from llmgw_core.config import loads
from llmgw_core.engines import Profile
from llmgw_core.events import DeploymentStatus, ReplicaRecord, ShardStatus
from llmgw_core.keys import WINDOW_S, ApiKey, KeyWindow, secret_hash
from llmgw_gateway.adapter_limits import AdapterLimit, AdapterLimits, window_name
from llmgw_gateway.budgets import Budgets, Estimate, Limited, Reservation
from llmgw_gateway.keyring import Keyring
from llmgw_gateway.proxy import Proxy
from llmgw_gateway.routing import Table
from llmgw_placement.config import ServerConfig
from tests.adapters_support import write_peft_lora
from tests.cluster_support import cluster, sim_catalog
from tests.gateway_support import answers_health, serve_proxy
from tests.test_gateway import running_gateway
from tests.test_gateway_api import sim_engines
from tests.test_gateway_keys import a_minute_just_begun
from tests.waiting import eventually

BASE = {"name": "tiny", "engine": "sim", "model": "tiny"}
LEGAL = {"name": "legal", "base": "tiny", "source": "file:///models/legal"}


def _profile(*adapters: dict[str, Any]) -> Profile:
    return Profile(**BASE, adapters=tuple(Adapter(**a) for a in adapters))  # type: ignore[arg-type]


def test_an_adapters_limits_are_no_part_of_its_bases_fingerprint() -> None:
    """Changing an adapter's limits replaces no replica (placement compares fingerprints); a
    profile whose adapters have none keeps the digest it had before limits existed."""
    plain = _profile(LEGAL)
    limited = _profile({**LEGAL, "rpm": 60, "tpm": 20_000})
    assert limited.fingerprint() == plain.fingerprint()
    assert _profile({**LEGAL, "rpm": 1}).fingerprint() == plain.fingerprint()
    # As the digest was written before adapters had limits.
    fields = msgspec.to_builtins(plain)
    for late in ("model_sha256", "kv_events", "max_loras", "max_lora_rank"):
        fields.pop(late)
    fields["adapters"] = [{k: v for k, v in a.items() if k not in ("rpm", "tpm")} for a in fields["adapters"]]
    digest = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:16]
    assert plain.fingerprint() == digest
    # What the engine is started with still counts.
    assert _profile({**LEGAL, "scale": 0.5}).fingerprint() != plain.fingerprint()


@pytest.mark.parametrize(
    ("limit", "words"),
    [
        ({"rpm": -1}, "adapter legal: rpm -1 is not a whole number from 0 to 1,000,000,000"),
        ({"tpm": LIMIT_MAX + 1}, "adapter legal: tpm 1000000001 is not a whole number"),
        ({"rpm": 1.5}, "adapter legal: rpm 1.5 is not a whole number"),
    ],
)
def test_an_adapters_limit_out_of_bounds_is_refused_by_name(limit: dict[str, Any], words: str) -> None:
    catalog = {"tiny": Profile(**BASE)}  # type: ignore[arg-type]
    problem = adapter_problem(Adapter(**{**LEGAL, **limit}), catalog)
    assert problem is not None
    assert problem.startswith(words)
    assert adapter_problem(Adapter(**{**LEGAL, "rpm": 60, "tpm": LIMIT_MAX}), catalog) is None
    # As a file or the bus carries it: refused where it is decoded, at its field.
    raw = msgspec.json.encode({**LEGAL, **limit})
    with pytest.raises(msgspec.ValidationError, match=r"at `\$\.[rt]pm`"):
        msgspec.json.decode(raw, type=Adapter)


def test_server_yaml_takes_an_adapters_limits_and_refuses_them_out_of_bounds_at_their_field() -> None:
    def config(adapter: dict[str, Any]) -> ServerConfig:
        return loads(msgspec.yaml.encode({"catalog": [BASE], "adapters": [adapter]}), ServerConfig)

    [held] = config({**LEGAL, "rpm": 600, "tpm": 200_000}).profiles()["tiny"].adapters
    assert (held.rpm, held.tpm) == (600, 200_000)
    with pytest.raises(Exception, match=r"at `\$\.adapters\[0\]\.rpm`"):
        config({**LEGAL, "rpm": -1})


def test_ctl_shows_an_adapters_limits() -> None:
    view = AdapterView(name="legal", base="tiny", source="file:///x", scale=1.0, rpm=60, tpm=20_000)
    assert limits(view) == "60rpm,20000tpm"
    assert limit_words(view) == "60 requests per minute, 20000 tokens per minute (every key's together)"
    assert limits(AdapterView(name="a", base="tiny", source="file:///x", scale=1.0, tpm=5)) == "5tpm"
    assert limits(AdapterView(name="a", base="tiny", source="file:///x", scale=1.0)) == "-"
    none = AdapterView(name="a", base="tiny", source="file:///x", scale=1.0)
    assert limit_words(none) == "none of its own (each key's apply)"


def test_placement_says_each_deployments_adapter_limits_and_the_gateway_keeps_them_by_adapter() -> None:
    """What placement says of a deployment: its profile's adapters that have limits, by name;
    the gateway keeps them per deployment (a deleted one says none); one adapter's limits
    first by deployment name."""
    profile = _profile({**LEGAL, "rpm": 60}, {**LEGAL, "name": "tax"}, {**LEGAL, "name": "hr", "tpm": 9})
    quotas = adapter_quotas(profile.adapters)
    assert quotas == (AdapterQuota(name="hr", tpm=9), AdapterQuota(name="legal", rpm=60))
    status = DeploymentStatus(deployment="chat", desired=1, adapter_quotas=quotas)
    said = msgspec.json.decode(msgspec.json.encode(status), type=DeploymentStatus)
    held = AdapterLimits()
    held.observe("chat", said.adapter_quotas)
    assert held.of("legal") == AdapterLimit("adapter.legal", 60, 0, "legal")
    assert held.of("hr") == AdapterLimit("adapter.hr", 0, 9, "hr")
    assert held.of("tax") is None
    held.observe("a-first", (AdapterQuota(name="legal", rpm=5),))
    assert held.of("legal") == AdapterLimit("adapter.legal", 5, 0, "legal")
    held.observe("a-first", ())
    held.observe("chat", ())
    assert held.of("legal") is None


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.text(max_size=12), st.one_of(st.integers(), st.text(max_size=8), st.none()), max_size=6
    )
)
def test_any_status_value_decodes_to_bounded_limits_or_is_refused_by_msgspec(fields: dict[str, Any]) -> None:
    raw = msgspec.json.encode(
        {"deployment": "chat", "desired": 1, "adapter_quotas": [{"name": "legal", **fields}]}
    )
    try:
        said = msgspec.json.decode(raw, type=DeploymentStatus)
    except msgspec.ValidationError:
        return
    held = AdapterLimits()
    held.observe("chat", said.adapter_quotas)
    found = held.of("legal")
    assert found is None or (0 <= found.rpm <= LIMIT_MAX and 0 <= found.tpm <= LIMIT_MAX)


def _key(name: str, **limits: int) -> ApiKey:
    return ApiKey(name=name, hash=secret_hash(f"sk-{name}"), **limits)


@pytest.mark.anyio
async def test_a_request_the_adapter_refuses_gives_its_keys_request_back_and_tokens_charge_both() -> None:
    budgets = Budgets(None)
    key = _key("team", rpm=2, tpm=10_000)
    legal = AdapterLimit(window_name("legal"), 1, 10_000, "legal")
    start = 1000 * WINDOW_S
    spend = Estimate(10, 40)
    first = await budgets.reserve(key, spend, now=start + 1, adapter=legal)
    assert isinstance(first, Reservation)
    assert (budgets.held("team"), budgets.held("adapter.legal")) == (40, 40)
    refused = await budgets.reserve(key, spend, now=start + 2, adapter=legal)
    assert refused == Limited("requests", 1, WINDOW_S - 2, window="adapter.legal")
    # The key lost nothing to the refusal: its second request of the minute goes to the base.
    assert isinstance(await budgets.reserve(key, spend, now=start + 3), Reservation)
    assert isinstance(await budgets.reserve(key, spend, now=start + 4), Limited)
    first.settle(25, now=start + 5)
    assert (budgets.tokens("team", start + 6), budgets.tokens("adapter.legal", start + 6)) == (25, 25)
    assert budgets.held("adapter.legal") == 0


def _status(adapter: str) -> ShardStatus:
    return ShardStatus(
        node="n0",
        shard="chat-r0-0",
        replica="r0",
        deployment="chat",
        state="ready",
        adapters=(ServedAdapter(name=adapter),),
        adapters_loadable=(adapter,),
    )


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_two_gateways_hold_an_adapter_to_its_own_limit_across_every_key(
    bus: Bus, tmp_path: Path
) -> None:
    """Two gateways over one sim replica holding adapter `legal` (rpm 3): requests for it from
    two keys are served 3 times in the minute by the first gateway; the fourth gets 429 naming
    the adapter and its limit, with Retry-After, and so does the other gateway's first, which
    reads the same window. The base is not held by the adapter's limit, and the shared window
    holds the adapter's tokens."""
    write_peft_lora(tmp_path / "legal")
    clock = a_minute_just_begun()
    with sim_engines(["--max-loras", "2"]) as [url]:
        async with httpx.AsyncClient(timeout=30) as client:
            await eventually(lambda: answers_health(client, url), timeout=30, interval=0.1)
            load = {"lora_name": "legal", "lora_path": str(tmp_path / "legal")}
            assert (await client.post(f"{url}/v1/load_lora_adapter", json=load)).status_code == 200
            keyring = Keyring(required=True)
            for name in ("red", "blue"):
                keyring.set(name, _key(name, tpm=1_000_000))
            limits_said = AdapterLimits()
            limits_said.observe("chat", (AdapterQuota(name="legal", rpm=3, tpm=100_000),))
            async with anyio.create_task_group() as tg:
                gateways = []
                for writer in ("gw-a", "gw-b"):
                    table = Table()
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
                    table.set_shard_status("n0.chat-r0-0", _status("legal"))
                    budgets = Budgets(bus, writer=writer, clock=clock)
                    await tg.start(budgets.run)
                    proxy = Proxy(table, client, keyring=keyring, budgets=budgets, adapter_limits=limits_said)
                    proxy.loaded.set()
                    gateways.append(f"http://127.0.0.1:{await tg.start(serve_proxy, proxy)}")

                async def chat(n: int, model: str, gateway: str) -> httpx.Response:
                    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
                    headers = {"authorization": f"Bearer sk-{('red', 'blue')[n % 2]}"}
                    return await client.post(
                        f"{gateway}/v1/chat/completions",
                        content=json.dumps(body),
                        headers=headers,
                    )

                first, other = gateways
                served = [await chat(n, "legal", first) for n in range(3)]
                assert [r.status_code for r in served] == [200, 200, 200], [r.text for r in served]
                for n, gateway in ((3, first), (4, other)):
                    over = await chat(n, "legal", gateway)
                    assert over.status_code == 429, over.text
                    said = over.json()["error"]
                    assert said["code"] == "rate_limit_exceeded"
                    assert said["message"].startswith(
                        "adapter 'legal' is at its own limit of 3 requests per minute, every key's "
                        "requests for it together; retry in "
                    )
                    assert 0 < int(over.headers["retry-after"]) <= WINDOW_S
                # The base is the base's: the adapter's limit holds only the adapter.
                assert (await chat(5, "chat", other)).status_code == 200

                async def window() -> KeyWindow:
                    found = await bus.get(bus.names.limits_bucket, "adapter.legal", KeyWindow)
                    assert found is not None
                    assert found[0].requests == 3
                    assert found[0].tokens > 0
                    return found[0]

                shared = await eventually(window, timeout=10)
                # The first gateway claimed all three; the other found none left.
                parts = {writer.split(".")[0]: part.requests for writer, part in shared.by.items()}
                assert parts == {"gw-a": 3, "gw-b": 0}
                tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_gateway_takes_the_limits_placement_says_and_follows_a_change(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Through the real path: placement (its own process) reads the catalog and says each
    deployment's adapters' limits on its status; a gateway (which may not read the catalog)
    takes them into the table its proxy enforces (as the test above shows), and follows a change
    written to the catalog, which replaces no replica."""
    adapters = {"adapters": [{**LEGAL, "rpm": 7}, {**LEGAL, "name": "tax"}]}
    with cluster(tmp_path, nats_url, prefix) as c:
        chat = {"name": "chat", "profile": "tiny", "replicas": 0}
        c.start_placement("p1", [sim_catalog()], [chat], adapters)
        async with running_gateway(c) as (_, gateway):
            limits_of = gateway.proxy.adapter_limits.of
            await eventually(lambda: limits_of("legal") is not None, timeout=30, interval=0.1)
            assert limits_of("legal") == AdapterLimit("adapter.legal", 7, 0, "legal")
            assert limits_of("tax") is None

            found = await bus.get(bus.names.catalog_bucket, "tiny", Profile)
            assert found is not None
            stored = found[0]
            changed = (Adapter(**{**LEGAL, "rpm": 7}), Adapter(**{**LEGAL, "name": "tax", "tpm": 500}))
            await bus.put(bus.names.catalog_bucket, "tiny", msgspec.structs.replace(stored, adapters=changed))
            await eventually(lambda: limits_of("tax") is not None, timeout=30, interval=0.1)
            assert limits_of("tax") == AdapterLimit("adapter.tax", 0, 500, "tax")
            assert msgspec.structs.replace(stored, adapters=changed).fingerprint() == stored.fingerprint()
