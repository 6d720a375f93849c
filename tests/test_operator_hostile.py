"""Operators, keys and demand reports read as an attacker writes them: a key's models are the
names that route to a deployment, never another deployment's alias; names that meet another
deployment's are refused where they enter (server.yaml, `ctl apply`, the API); a gateway's
demand report is bounded; two writers of one deployment at once are told apart by
compare-and-set, and the loser writes nothing."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import msgspec
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam

from llmgw.ctl import _apply
from llmgw.ctl._commands import _exit_code, apply, read_apply_file
from llmgw.ctl._errors import Conflict, Refused
from llmgw_core.bus import Bus
from llmgw_core.config import loads
from llmgw_core.errors import ConfigError
from llmgw_core.events import Demand, Deployment, DeploymentDemand, ReplicaInFlight, ReplicaRecord, decoder
from llmgw_core.keys import ApiKey, allows, secret_hash
from llmgw_core.limits import DEMAND_INTERVAL_MAX_S, document_problem
from llmgw_core.validate import deployments_problem, names_problem
from llmgw_core.web import serve
from llmgw_gateway.routing import Table
from llmgw_placement.api import Api
from llmgw_placement.config import ProfileConfig, ServerConfig
from llmgw_placement.demand import COUNT_MAX, DEPLOYMENTS_MAX, GATEWAYS_MAX, DemandBook, bounded
from llmgw_placement.service import PlacementService
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.control_support import server_config
from tests.test_ctl import ctl
from tests.test_gateway import running_gateway
from tests.test_gateway_api import sim_engines
from tests.waiting import eventually

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
WHY = "a model name routes to one deployment"


def dep(name: str, *aliases: str, replicas: int = 1) -> Deployment:
    return Deployment(name=name, profile="tiny", replicas=replicas, aliases=aliases)


# --- a key's models ------------------------------------------------------------------------------


def test_a_key_names_what_routes_to_a_deployment_never_another_deployments_alias() -> None:
    table = Table()
    table.set_deployment("chat", dep("chat", "gpt-4o"))
    # Stored by a writer before names were checked: `zzz` claims the name of `chat`.
    table.set_deployment("zzz", dep("zzz", "chat", "zed"))
    scoped = ApiKey(name="team", hash="0" * 64, models=("chat",))
    assert allows(scoped, "chat", table.resolve)
    assert not allows(scoped, "zzz", table.resolve), "zzz's alias `chat` widened the key's scope"
    # By an alias that routes to zzz, the key made for it calls zzz and nothing else.
    zed = ApiKey(name="z", hash="0" * 64, models=("zed",))
    assert (allows(zed, "zzz", table.resolve), allows(zed, "chat", table.resolve)) == (True, False)
    # Where no deployment has the name, `chat` routes to the one whose alias it is.
    table.set_deployment("chat", None)
    assert allows(scoped, "zzz", table.resolve)
    assert allows(ApiKey(name="all", hash="0" * 64), "zzz", table.resolve)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_key_for_chat_is_not_served_zzz_whose_alias_is_chat(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c, sim_engines([]) as (engine,):
        for d in (dep("chat"), dep("zzz", "chat")):
            await bus.put(bus.names.deployments_bucket, d.name, d)
            record = ReplicaRecord(
                deployment=d.name,
                replica="r0",
                profile="tiny",
                profile_fp="x",
                state="ready",
                url=engine,
                engine="sim",
            )
            await bus.put(bus.names.replicas_bucket, f"{d.name}.r0", record)
        secret = "sk-llmgw-" + "s" * 43
        key = ApiKey(name="team", hash=secret_hash(secret), models=("chat",))
        await bus.put(bus.names.keys_bucket, "team", key)
        async with (
            running_gateway(c, require_api_key=True) as (url, _),
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0, timeout=30) as client,
        ):

            async def served() -> bool:
                done = await client.chat.completions.create(model="chat", messages=CHAT, max_tokens=2)
                return bool(done.choices[0].message.content)

            await eventually(served, timeout=30, interval=0.2)
            assert [m.id for m in (await client.models.list()).data] == ["chat"]
            with pytest.raises(openai.NotFoundError) as hidden:
                await client.chat.completions.create(model="zzz", messages=CHAT, max_tokens=2)
            body = hidden.value.body
            assert isinstance(body, dict)
            assert body["code"] == "model_not_found"


# --- names that meet another deployment's ---------------------------------------------------------


def test_an_alias_that_meets_another_deployments_name_or_alias_is_refused_naming_both() -> None:
    assert names_problem(dep("zzz", "chat"), [dep("chat")]) == (
        f"deployment zzz: alias 'chat' is the name of deployment chat: {WHY}; remove the alias from zzz"
    )
    assert names_problem(dep("b", "gpt"), [dep("a", "gpt")]) == (
        f"deployment b: alias 'gpt' is also an alias of deployment a: {WHY}; keep it on one of them"
    )
    assert names_problem(dep("chat"), [dep("zzz", "chat")]) == (
        f"deployment chat: its name is an alias of deployment zzz: {WHY}; remove the alias from zzz "
        "first, or name this deployment otherwise"
    )
    # Its own name among its aliases, and its own earlier value, meet nothing.
    assert names_problem(dep("chat", "chat", "gpt"), [dep("chat", "gpt"), dep("other")]) is None
    assert deployments_problem([dep("a"), dep("b"), dep("a")]) == (
        2,
        "deployment a is listed twice (first at $.deployments[0]): list each deployment once",
    )
    # A server.yaml that holds such names is refused when it is read, by placement and by ctl.
    text = "deployments:\n  - {name: chat, profile: tiny}\n  - {name: zzz, profile: tiny, aliases: [chat]}\n"
    with pytest.raises(ConfigError) as refused:
        loads(text, ServerConfig, source="server.yaml")
    assert str(refused.value) == (
        f"server.yaml: deployment zzz: alias 'chat' is the name of deployment chat: {WHY}; "
        "remove the alias from zzz - at `$.deployments[1]`"
    )


# --- ctl apply ------------------------------------------------------------------------------------


async def seed(bus: Bus, *deployments: Deployment) -> None:
    profile = msgspec.convert(sim_catalog(), ProfileConfig).wire()
    await bus.put(bus.names.catalog_bucket, "tiny", profile)
    for d in deployments:
        await bus.put(bus.names.deployments_bucket, d.name, d)


async def stored(bus: Bus) -> dict[str, tuple[int, Deployment]]:
    found = await bus.entries(bus.names.deployments_bucket, Deployment)
    return {k: (c.revision, c.value) for k, c in found.items() if c.value is not None}


def yaml_file(tmp_path: Path, name: str, *deployments: str) -> str:
    path = tmp_path / name
    path.write_text("deployments:\n" + "".join(f"  - {d}\n" for d in deployments))
    return str(path)


async def run_ctl(c: Cluster, *args: str) -> tuple[int, str, str]:
    done = await anyio.to_thread.run_sync(lambda: ctl(c, *args))
    return done.returncode, done.stdout, done.stderr


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_two_applies_of_one_deployment_at_once_the_loser_writes_nothing_and_exits_5(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        await seed(bus)
        two = yaml_file(tmp_path, "two.yaml", "{name: chat, profile: tiny, replicas: 2}")
        three = yaml_file(tmp_path, "three.yaml", "{name: chat, profile: tiny, replicas: 3}")
        won: list[tuple[int, str, str]] = []

        async def add(at: str) -> None:
            if at == "checked":
                won.append(await run_ctl(c, "apply", "-f", two))

        # Both read `chat` absent; the other apply adds it between this one's check and its write.
        with pytest.raises(Conflict) as lost:
            await apply(bus, three, between=add)
        assert won == [
            (
                0,
                "engines: not in the file, left as it is\ncatalog: not in the file, left as it is\n"
                f"deployment chat: added\napplied {two}: 1 added, 0 changed, 0 deleted, 0 unchanged\n",
                "",
            )
        ]
        assert str(lost.value) == (
            f"deployment chat was written by another writer after {three} was compared with it; "
            "written before that: nothing; run the apply again (`--dry-run` shows what it would change now)"
        )
        assert _exit_code(lost.value) == 5
        assert capsys.readouterr().err == f"llmgw: {lost.value}\n"
        after = await stored(bus)
        assert after["chat"][1].replicas == 2, "the loser wrote nothing"

        # Both read `chat` at 2 replicas; the other apply scales it between this one's read and
        # its write: the loser says what changed, and the key stays as the winner wrote it.
        one = yaml_file(tmp_path, "one.yaml", "{name: chat, profile: tiny, replicas: 1}")
        said: list[str] = []

        async def scale(at: str) -> None:
            if at == "compared":
                said.append(await apply(bus, three))

        with pytest.raises(Conflict) as lost:
            await apply(bus, one, between=scale)
        assert "deployment chat: changed (replicas: 2 -> 3)" in said[0]
        assert str(lost.value) == (
            f"{one} was compared with a state another writer has changed since: deployment chat: "
            "changed by another writer (replicas: 2 -> 3); nothing was written; run the apply again "
            "(`--dry-run` shows what it would change now)"
        )
        winner_wrote = await stored(bus)
        assert winner_wrote["chat"][1].replicas == 3
        # Run again, the loser's file is compared with what is there now and applies.
        assert "deployment chat: changed (replicas: 3 -> 1)" in await apply(bus, one)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_apply_refuses_an_alias_that_is_another_deployments_name_writing_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        await seed(bus, dep("chat"))
        before = await stored(bus)
        path = yaml_file(tmp_path, "zzz.yaml", "{name: zzz, profile: tiny, aliases: [chat]}")
        code, out, err = await run_ctl(c, "apply", "-f", path)
        assert (code, out, err) == (
            4,
            "",
            f"llmgw: {path}: $.deployments[0]: deployment zzz: alias 'chat' is the name of deployment "
            f"chat: {WHY}; remove the alias from zzz\nnothing was written\n",
        )
        with pytest.raises(Refused):
            await apply(bus, path)
        assert await stored(bus) == before
        # `ctl deploy` of a new name that is another deployment's alias: the same refusal.
        await seed(bus, dep("yyy", "talk"))
        before = await stored(bus)
        code, out, err = await run_ctl(c, "deploy", "talk", "--profile", "tiny")
        assert (code, out) == (4, "")
        assert err == (
            "llmgw: deployment talk: its name is an alias of deployment yyy: "
            f"{WHY}; remove the alias from yyy first, or name this deployment otherwise; "
            "nothing was written\n"
        )
        assert await stored(bus) == before


# --- placement's API ------------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_the_api_refuses_colliding_names_and_a_write_that_lost_a_race_with_409(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    config = server_config(nats_url, prefix, http={"port": 0, "insecure": True})
    await bus.put(bus.names.catalog_bucket, "tp1", config.catalog[0].wire())
    await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
    api = Api(PlacementService(config, bus))
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, api.app(), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            colliding = await client.post(
                "/api/deployments", json={"name": "zzz", "profile": "tp1", "aliases": ["chat"]}
            )
            assert (colliding.status_code, colliding.json()) == (
                409,
                {
                    "error": f"invalid deployment: deployment zzz: alias 'chat' is the name of "
                    f"deployment chat: {WHY}; remove the alias from zzz"
                },
            )
            assert await bus.keys(bus.names.deployments_bucket) == {"chat"}

            # Another writer scales `chat` between this request's read and its write.
            async def scale(name: str) -> None:
                api.before_write = None
                await bus.put(
                    bus.names.deployments_bucket, name, Deployment(name=name, profile="tp1", replicas=5)
                )

            api.before_write = scale
            lost = await client.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1", "replicas": 2}
            )
            now = await bus.get(bus.names.deployments_bucket, "chat", Deployment)
            assert now is not None
            assert now[0].replicas == 5, "the write that lost wrote nothing"
            body = lost.json()
            assert (lost.status_code, body["revision"], body["changed"]) == (
                409,
                now[1],
                ["replicas: 1 -> 5"],
            )
            assert body["error"].startswith(f"deployment chat is at revision {now[1]}, not ")
            assert body["error"].endswith(
                ": another writer wrote it meanwhile; nothing was written; "
                "read it again and send the change again"
            )

            # A write based on a revision: applied at that revision, refused at an older one.
            done = await client.post(
                "/api/deployments",
                json={"name": "chat", "profile": "tp1", "replicas": 2},
                headers={"If-Match": f'"{now[1]}"'},
            )
            assert done.status_code == 200, done.text
            etag = done.headers["etag"]
            stale = await client.post(
                "/api/deployments",
                json={"name": "chat", "profile": "tp1", "replicas": 7},
                headers={"If-Match": f'"{now[1]}"'},
            )
            assert (stale.status_code, stale.json()["changed"]) == (409, ["replicas: 5 -> 2"])
            assert f'"{stale.json()["revision"]}"' == etag
            bad = await client.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1"}, headers={"If-Match": "soon"}
            )
            assert bad.status_code == 400
        tg.cancel_scope.cancel()


# --- demand reports -------------------------------------------------------------------------------


def report(interval_s: float, *rows: DeploymentDemand) -> Demand:
    return Demand(gateway="gw-a", deployments=rows, interval_s=interval_s)


def test_a_demand_report_of_interval_1e9_or_nan_expires_as_one_of_60_s() -> None:
    for interval in (1e9, math.inf, math.nan):
        book = DemandBook(started=0.0, stale_intervals=3.0)
        book.heard(report(interval, DeploymentDemand(deployment="chat", in_flight=4)), 10.0)
        assert book.sample(10.0 + 3 * DEMAND_INTERVAL_MAX_S, {})["chat"].in_flight == 4
        assert "chat" not in book.sample(10.1 + 3 * DEMAND_INTERVAL_MAX_S, {}), interval
    # Counts past any gateway's are taken as COUNT_MAX; a deployment named twice counts once,
    # and one by no name a deployment can have not at all.
    hostile = report(
        -5.0,
        DeploymentDemand(
            deployment="chat",
            in_flight=10**19,
            queued=3,
            replicas=(ReplicaInFlight(replica="r0", in_flight=10**19),),
        ),
        DeploymentDemand(deployment="chat", in_flight=7),
        DeploymentDemand(deployment="a.b", in_flight=7),
    )
    clean, said = bounded(hostile)
    assert clean.interval_s == 0.001
    assert clean.deployments == (
        DeploymentDemand(
            deployment="chat",
            in_flight=COUNT_MAX,
            queued=3,
            replicas=(ReplicaInFlight(replica="r0", in_flight=COUNT_MAX),),
        ),
    )
    assert said == [
        "interval_s -5 taken as 0.001",
        f"chat: in_flight {10**19} taken as {COUNT_MAX}",
        "chat: replicas bounded (1 named)",
        "deployment 'chat' dropped (no deployment's name, or named twice)",
        "deployment 'a.b' dropped (no deployment's name, or named twice)",
    ]
    fine = report(1.0, DeploymentDemand(deployment="chat", in_flight=2))
    assert bounded(fine) == (fine, [])
    # Gateways heard at once are bounded: one more waits until another's report goes stale.
    book = DemandBook(started=0.0)
    for i in range(GATEWAYS_MAX):
        assert book.heard(Demand(gateway=f"gw-{i}", interval_s=1.0), 1.0)
    assert not book.heard(Demand(gateway="gw-late", interval_s=1.0), 2.0)
    assert book.heard(Demand(gateway="gw-late", interval_s=1.0), 5.0)
    assert list(book.reports) == ["gw-late"]


_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),
)
_json = st.recursive(
    st.none() | st.booleans() | _numbers | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
_row = st.fixed_dictionaries(
    {},
    optional={
        "deployment": st.one_of(st.sampled_from(["chat", "zzz", "a.b", "", "x" * 70]), _json),
        "in_flight": _numbers,
        "queued": _numbers,
        "arrived": _numbers,
        "replicas": st.lists(st.tuples(st.text(max_size=8), _numbers), max_size=4),
    },
)
_report = st.fixed_dictionaries(
    {"kind": st.just("Demand"), "gateway": st.sampled_from(["gw-a", "gw-b", "", "a.b"])},
    optional={"interval_s": _numbers, "at": _numbers, "deployments": st.lists(_row | _json, max_size=6)},
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_report, _json), st.binary(max_size=64))
def test_fuzz_a_demand_report_decodes_or_is_refused_and_is_always_bounded(doc: Any, noise: bytes) -> None:
    for data in (msgspec.json.encode(doc), noise):
        book = DemandBook(started=0.0)
        try:
            heard = decoder(Demand).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # the bus dead-letters it, and keeps consuming
        clean, _ = bounded(heard)
        assert 0.001 <= clean.interval_s <= DEMAND_INTERVAL_MAX_S
        assert len(clean.deployments) <= DEPLOYMENTS_MAX
        assert len({d.deployment for d in clean.deployments}) == len(clean.deployments)
        for d in clean.deployments:
            assert max(d.in_flight, d.queued, d.arrived, *(r.in_flight for r in d.replicas)) <= COUNT_MAX
        book.heard(heard, 1.0)
        sums = book.sample(1.0, {})
        assert all(s.demand <= 2 * COUNT_MAX for s in sums.values())
        # Held no longer than three of the longest interval a gateway may have.
        assert book.sample(1.1 + 3 * DEMAND_INTERVAL_MAX_S, {}) == {}


# --- apply files ----------------------------------------------------------------------------------

_names = st.sampled_from(["chat", "zzz", "tiny", "a.b", "", "x" * 70])
_deployment = st.fixed_dictionaries(
    {"name": _names | _json, "profile": _names | _json},
    optional={
        "replicas": _numbers | _json,
        "aliases": st.lists(_names | _json, max_size=3),
        "autoscale": st.dictionaries(
            st.sampled_from(["min_replicas", "max_replicas", "target_in_flight", "scale_down_after_s"]),
            _numbers,
        )
        | _json,
        "pool": _json,
    },
)
_profile = st.fixed_dictionaries(
    {"name": _names | _json, "engine": st.sampled_from(["sim", "vllm", "nope"]) | _json},
    optional={"model_path": _json, "tp": _numbers, "args": _json, "env": _json},
)
_server = st.fixed_dictionaries(
    {},
    optional={
        "engines": st.lists(
            st.fixed_dictionaries({"name": st.sampled_from(["sim", "nope"]) | _json}), max_size=2
        )
        | _json,
        "catalog": st.lists(_profile | _json, max_size=3) | _json,
        "deployments": st.lists(_deployment | _json, max_size=4) | _json,
        "max_replicas": _numbers,
    },
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_server, _json), st.sampled_from(["yaml", "json", "raw"]), st.binary(max_size=200))
def test_fuzz_an_apply_file_is_applied_or_refused_naming_the_file(doc: Any, form: str, raw: bytes) -> None:
    if form == "raw":
        data = raw
    else:
        try:
            data = msgspec.yaml.encode(doc) if form == "yaml" else msgspec.json.encode(doc)
        except (TypeError, ValueError, OverflowError):
            return  # not a document either encoder writes
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "server.yaml")
        Path(path).write_bytes(data)
        refused = ""
        try:
            config, named = read_apply_file(path)
        except ConfigError as exc:
            refused = str(exc)
    if refused:
        assert refused.startswith(path), refused
        return
    live = _apply.Live(engines=None, catalog={}, deployments={"chat": dep("chat", "gpt")})
    plan = _apply.plan(config, named, live, prune=True)
    problems = _apply.reference_problems(config, named, live, plan, engines={"sim", "vllm"}, path=path)
    assert all(p.startswith(path) for p in problems)


def test_documents_nested_deep_or_expanding_past_a_million_values_are_refused_before_decoding(
    tmp_path: Path,
) -> None:
    assert document_problem(b"[" * 100_000 + b"]" * 100_000) == "collections nested over 64 deep: flatten it"
    laughs = b"a: &a [" + b",".join([b"x"] * 1000) + b"]\nb: [" + b",".join([b"*a"] * 1001) + b"]\n"
    assert (
        document_problem(laughs) == "over 1000000 values once its aliases are expanded: write it out plainly"
    )
    assert document_problem(b"deployments: &d []\ncatalog: *d\n") is None
    # Read by ctl: said as the file's fault, never a crash of the process.
    path = tmp_path / "deep.yaml"
    path.write_bytes(b"{" * 5000 + b"}" * 5000)
    with pytest.raises(ConfigError) as refused:
        read_apply_file(str(path))
    assert str(refused.value) == f"{path}: collections nested over 64 deep: flatten it"


def test_a_server_yaml_nested_thousands_deep_is_refused_naming_the_file() -> None:
    """The decoder itself crashes past some depth: the file is measured first."""
    with pytest.raises(ConfigError) as refused:
        loads(b"deployments: " + b"[" * 100_000 + b"]" * 100_000, ServerConfig, source="server.yaml")
    assert str(refused.value) == "server.yaml: collections nested over 64 deep: flatten it"
