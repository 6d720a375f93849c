"""Names and sizes are bounded where they enter: placement's API, `llmgw ctl`, server.yaml and
agent.yaml refuse what breaks the rules of `llmgw_core.limits` in the same words, and every
reader of the bus (placement, the launcher, the gateway) dead-letters a stored key or value
that breaks them, never using it in a subject.

Regression: a 3,955-character deployment name (`llmgw ctl deploy`, or POST /api/deployments)
was stored; the subjects placement and the launchers then built from it were over nats-server's
4 KB control line, the client library closed their connections for good, and every placement
and node was lost until the key was removed by hand (`ctl delete` died the same way).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.config import AgentConfig, load
from llmgw_core.engines import ShardSpec
from llmgw_core.errors import ConfigError
from llmgw_core.events import Deployment, DeploymentStatus, encode
from llmgw_core.limits import NAME_MAX, key_problem, name_problem, replicas_problem
from llmgw_core.validate import check_deployment, check_profile
from llmgw_core.web import serve
from llmgw_gateway import Gateway, GatewayConfig
from llmgw_placement import PlacementService, ServerConfig
from llmgw_placement.api import Api
from tests.cluster_support import cluster, sim_catalog
from tests.control_support import control_plane, dlq, ready_replicas, server_config
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.test_ctl import ctl, ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

# As long as a key can be and still fit, with the subject around it, in one protocol line
# (4 KB) for the writer and its readers.
LONG = "x" * 3800

TOO_LONG_3955 = (
    "deployment 'aaaaaaaaaaaaaaaaaaaaaaaa…' is 3955 characters long, over the limit of 63: "
    "use a name of at most 63 letters, digits, '-' and '_', e.g. chat-7b"
)


# --- the rules, as pure functions ------------------------------------------------------------


def test_the_rules_in_words() -> None:
    assert name_problem("deployment", "chat-7b_v2") is None
    assert name_problem("deployment", "a" * NAME_MAX) is None
    assert name_problem("deployment", "a" * 3955) == TOO_LONG_3955
    assert name_problem("node", "a.b") == (
        "node 'a.b' is not a valid name: use letters, digits, '-' and '_' (a dot splits a subject), "
        "e.g. chat-7b"
    )
    assert name_problem("profile", "") is not None
    assert key_problem("n1.chat-r0-0", "node", "shard") is None
    assert key_problem("n1", "node", "shard") == "key 'n1' is not NODE.SHARD"
    assert key_problem("n1." + "s" * 200, "node", "shard") == (
        "key 'n1.sssssssssssssssssssss…': shard 'ssssssssssssssssssssssss…' is 200 characters long, "
        "over the limit of 128: use a name of at most 128 letters, digits, '-' and '_', e.g. chat-7b"
    )
    assert key_problem("bad.name", "deployment") == (
        "deployment key 'bad.name' is not a valid name: use letters, digits, '-' and '_' "
        "(a dot splits a subject), e.g. chat-7b"
    )
    assert replicas_problem("chat", 10**30, 10_000) == (
        "deployment chat asks for 10^30 or more replicas, over the maximum of 10000 "
        "(placement's max_replicas in server.yaml)"
    )
    assert replicas_problem("chat", 10_000, 10_000) is None


def test_a_deployment_and_a_profile_are_judged_by_one_set_of_rules() -> None:
    """The rules placement dead-letters by, and the API and ctl refuse a write by: llmgw_core's,
    so ctl reaches them without importing placement."""
    chat = Deployment(name="chat", profile="tiny", replicas=2)
    assert check_deployment("chat", chat) is None
    assert check_deployment("evil", chat) == (
        "key evil holds a deployment named chat: a deployment is stored under its own name "
        "(write it to key chat, and delete key evil)"
    )
    assert check_deployment("chat", chat, max_replicas=1) == replicas_problem("chat", 2, 1)
    assert check_deployment("chat", msgspec.structs.replace(chat, profile="a.b")) == name_problem(
        "profile", "a.b"
    )
    tiny = sim_profile()
    assert check_profile("tiny", tiny) is None
    assert check_profile("other", tiny) == (
        "key other holds a profile named tiny: a profile is stored under its own name "
        "(write it to key tiny, and delete key other)"
    )
    ctl_imports = subprocess.run(
        [sys.executable, "-c", "import sys, llmgw.ctl._commands; print('llmgw_placement' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert ctl_imports.stdout.strip() == "False", ctl_imports


def test_the_message_types_carry_the_limits() -> None:
    """A value no entry would accept does not decode, so every reader dead-letters it; the ids
    llmgw makes from names at their limits still decode."""
    longest = "d" * NAME_MAX
    ok_spec = ShardSpec(
        replica="r123456789",
        shard=f"{longest}-r123456789-15",
        node="n" * NAME_MAX,
        profile=sim_profile(),
    )
    assert msgspec.json.decode(encode(ok_spec), type=ShardSpec) == ok_spec
    dep = Deployment(name=longest, profile="tiny", aliases=("meta-llama/Llama-3.1-8B-Instruct",))
    assert msgspec.json.decode(encode(dep), type=Deployment) == dep
    for bad in (
        Deployment(name=longest + "d", profile="tiny"),
        Deployment(name="chat", profile="tiny", aliases=("",)),
        Deployment(name="chat", profile="tiny", aliases=("a" * 256,)),
        Deployment(name="chat", profile="tiny", aliases=tuple(f"a{i}" for i in range(33))),
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(encode(bad), type=Deployment)


# --- configuration files ---------------------------------------------------------------------


def test_server_yaml_with_a_too_long_name_is_refused_at_load_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text(
        "catalog:\n  - {name: tiny, engine: sim, model_path: sim://x}\n"
        f"deployments:\n  - {{name: ok, profile: tiny}}\n  - {{name: {'a' * 64}, profile: tiny}}\n"
    )
    # As the operator meets it: placement does not start, and says which file and entry.
    done = subprocess.run(
        [sys.executable, "-m", "llmgw_placement", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"llmgw-placement: {path}: Expected `str` of length <= 63 - at `$.deployments[1].name`\n",
    )
    path.write_text("max_replicas: 20\ndeployments:\n  - {name: chat, profile: tiny, replicas: 21}\n")
    with pytest.raises(ConfigError) as err:
        load(path, ServerConfig)
    assert str(err.value) == (
        f"{path}: deployment chat asks for 21 replicas, over the maximum of 20 (placement's max_replicas "
        "in server.yaml) - at `$.deployments[0].replicas`"
    )
    agent = tmp_path / "agent.yaml"
    agent.write_text(f"node: {'n' * 64}\n")
    with pytest.raises(ConfigError) as err:
        load(agent, AgentConfig)
    assert str(err.value) == f"{agent}: Expected `str` of length <= 63 - at `$.node`"


# --- placement's API ---------------------------------------------------------------------------


async def test_the_api_refuses_a_4000_character_name_and_10_to_the_30_replicas_storing_nothing(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    config = server_config(nats_url, prefix, http={"port": 0, "insecure": True})
    api = Api(PlacementService(config, bus))
    async with anyio.create_task_group() as tg:
        port = await tg.start(serve, api.app(), "127.0.0.1", 0)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            long_name = await client.post("/api/deployments", json={"name": "a" * 4000, "profile": "tp1"})
            huge = await client.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1", "replicas": 10**30}
            )
            aliases = await client.post(
                "/api/deployments", json={"name": "chat", "profile": "tp1", "aliases": ["m" * 300]}
            )
            keys = await bus.keys(bus.names.deployments_bucket)
            # A deployment names a profile of the catalog (this placement does not run, so its
            # file seeds nothing: the profile is written here).
            await bus.put(bus.names.catalog_bucket, "tp1", config.catalog[0].wire())
            fine = await client.post("/api/deployments", json={"name": "chat", "profile": "tp1"})
        tg.cancel_scope.cancel()
    assert (long_name.status_code, long_name.json()) == (
        400,
        {
            "error": "invalid deployment: deployment 'aaaaaaaaaaaaaaaaaaaaaaaa…' is 4000 characters long, "
            "over the limit of 63: use a name of at most 63 letters, digits, '-' and '_', e.g. chat-7b"
        },
    )
    assert (huge.status_code, huge.json()) == (
        400,
        {
            "error": "invalid deployment: deployment chat asks for 10^30 or more replicas, over the "
            "maximum of 10000 (placement's max_replicas in server.yaml)"
        },
    )
    assert (aliases.status_code, aliases.json()) == (
        400,
        {
            "error": "invalid deployment: deployment 'chat': alias 'mmmmmmmmmmmmmmmmmmmmmmmm…' is 300 "
            "characters long; an alias is 1 to 255 characters"
        },
    )
    assert keys == set(), "nothing refused was stored"
    assert fine.status_code == 200
    assert await bus.keys(bus.names.deployments_bucket) == {"chat"}


# --- the bus mirror ----------------------------------------------------------------------------


async def test_a_too_long_key_written_raw_is_dead_lettered_and_placement_keeps_placing(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0"], gpus=8)
        p = await cp.start_placement("a")
        await eventually(lambda: p.service.controller is not None, timeout=20)
        kv = await bus.kv(bus.names.deployments_bucket)
        # A value that decodes, under a key no name may be; and one whose own name is too long.
        await kv.put(LONG, encode(Deployment(name="docs", profile="tp1")))
        await kv.put("y" * 3800, encode(Deployment(name="y" * 3800, profile="tp1")))

        async def both_dead_lettered() -> list[str]:
            errors = [m.headers.get("Llmgw-Error", "") for m in await dlq(bus) if m.headers]
            assert len(errors) == 2, errors
            return errors

        errors = await eventually(both_dead_lettered, timeout=20, interval=0.3)
        assert set(errors) == {
            "deployment key 'xxxxxxxxxxxxxxxxxxxxxxxx…' is 3800 characters long, over the limit of 63: "
            "use a name of at most 63 letters, digits, '-' and '_', e.g. chat-7b",
            "Expected `str` of length <= 63 - at `$.name`",
        }
        # Placement still works: a normal deployment is placed, on the same connection.
        await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
        await eventually(lambda: ready_replicas(bus, "chat"), timeout=30)
        assert p.bus.nc.is_connected
        assert cp.crashes() == []
        assert set(p.service.state.deployments) == {"chat"}
        statuses = await bus.history(f"{prefix}.events.deployment.>", DeploymentStatus)
        assert {s.deployment for s in statuses} == {"chat"}, "no subject was made of the long keys"


async def test_the_launcher_and_the_gateway_ignore_keys_no_name_may_be(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    names = bus.names
    # The launcher: a spec under a too-long key, and one under a key that is not its own, never run.
    config = agent_config(nats_url, prefix, tmp_path / "a", node="node-a")
    shards = await bus.kv(names.shards_bucket)
    await shards.put(f"node-a.{LONG}", encode(shard("node-a", "s1", sim_profile())))
    await shards.put("node-a.other", encode(shard("node-a", "s2", sim_profile())))
    async with shard_events(bus) as events, running_launcher(config) as launcher:
        await bus.put(names.shards_bucket, "node-a.good", shard("node-a", "good", sim_profile()))
        await eventually(lambda: events.states("good")[-1:] == ["ready"], timeout=60)
        assert set(launcher.handles) == {"node-a.good"}
        assert sorted(launcher.bus.decode_errors) == sorted(
            [f"$KV.{names.shards_bucket}.node-a.{LONG}", f"$KV.{names.shards_bucket}.node-a.other"]
        )
        assert {s.shard for s in events.items} == {"good"}
    # The gateway: a deployment under a too-long key is not a model it knows.
    deployments = await bus.kv(names.deployments_bucket)
    await deployments.put(LONG, encode(Deployment(name="docs", profile="tiny")))
    await bus.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
    gateway = Gateway(msgspec.convert({"http": {"port": 0, "require_api_key": False}}, GatewayConfig), bus)
    async with anyio.create_task_group() as tg:
        port = await tg.start(gateway.run)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:

            async def listed() -> list[str]:
                r = await client.get("/v1/models")
                assert r.status_code == 200, r.text
                return [m["id"] for m in r.json()["data"]]

            assert await eventually(listed, timeout=20) == ["chat"]
        tg.cancel_scope.cancel()
    assert f"$KV.{names.deployments_bucket}.{LONG}" in bus.decode_errors


# --- llmgw ctl ------------------------------------------------------------------------------------


async def test_ctl_refuses_a_3955_character_name_and_deletes_what_no_reader_decodes(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        c.start_placement("p1", [sim_catalog()], [])
        refused = ctl(c, "deploy", "a" * 3955, "--profile", "tiny", "--replicas", "1")
        assert (refused.returncode, refused.stderr) == (4, f"llmgw: {TOO_LONG_3955}\n")
        assert await bus.keys(bus.names.deployments_bucket) == set()
        # The cluster keeps working: a normal deployment is placed and gets ready (once placement
        # has seeded its catalog).
        await eventually(lambda: bus.keys(bus.names.catalog_bucket), timeout=30, interval=0.1)
        assert ok(c, "deploy", "chat", "--profile", "tiny") == "deployment chat: 1 x tiny requested\n"
        await eventually(lambda: ready_replicas(bus, "chat"), timeout=90, interval=0.5)

        # Stored values no reader decodes, and keys no name may be, written by hand: removed.
        kv = await bus.kv(bus.names.deployments_bucket)
        await kv.put("broken", b'{"kind":"Deployment","name":"broken","profile":7}')
        await kv.put("bad.name", b"not json")
        await kv.put(LONG, encode(Deployment(name="docs", profile="tiny")))
        scaled = ctl(c, "scale", "broken", "--replicas", "2")
        assert (scaled.returncode, scaled.stderr) == (
            4,
            "llmgw: deployment broken: the stored value is not a deployment (Expected `str`, got `int` - "
            "at `$.profile`); `llmgw ctl delete deployment broken` removes it\n",
        )
        for key, said in (
            ("broken", "broken"),
            ("bad.name", "bad.name"),
            (LONG, "'xxxxxxxxxxxxxxxxxxxxxxxx…'"),
        ):
            done = ctl(c, "delete", "deployment", key)
            assert (done.returncode, done.stdout, done.stderr) == (
                0,
                f"deployment {said} deleted: its replicas stop\n",
                "",
            )
        assert await bus.keys(bus.names.deployments_bucket) == {"chat"}
        missing = ctl(c, "delete", "deployment", "broken")
        assert (missing.returncode, missing.stderr) == (3, "llmgw: no deployment broken\n")
        wildcard = ctl(c, "delete", "deployment", "*")
        assert wildcard.returncode == 2, wildcard.stderr
        assert "Traceback" not in refused.stderr + scaled.stderr + missing.stderr + wildcard.stderr
