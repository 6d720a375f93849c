"""Identities against a real nats-server running the permissions `llmgw auth init` writes.

Each refusal is nats-server's own: the client sees it as PermissionDenied,
carrying the server's words, at once (not after a timeout) and only once.
"""

from __future__ import annotations

import logging
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw.auth import AuthDir
from llmgw_core.access import PermissionDenied
from llmgw_core.bus import Bus, BusOptions, prepare_node, require_streams
from llmgw_core.engines import ShardSpec
from llmgw_core.errors import BusError, ConfigError
from llmgw_core.events import Deployment, Heartbeat, InstallProgress, NodeStatus, ShardStatus, now
from llmgw_core.keys import ApiKey, KeyWindow, UsageRecord
from tests.auth_support import SessionNats, session_for
from tests.launcher_support import shard, sim_profile
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

NODES = ["gpu-1", "gpu-2"]


@pytest.fixture
def server(nats_url: str) -> SessionNats:
    found = session_for(nats_url)
    if found is None:
        pytest.skip("needs the session's own nats-server (identities are added to its configuration)")
    return found


@pytest.fixture
def auth(server: SessionNats, prefix: str, tmp_path: Path, bus: Bus) -> AuthDir:
    """Identities for this test's prefix; the harness `bus` has created the streams already."""
    return server.identities(prefix, tmp_path / "auth", NODES)


Connect = Callable[[str], Awaitable[Bus]]


@pytest.fixture
async def connect_as(server: SessionNats, auth: AuthDir, prefix: str) -> AsyncIterator[Connect]:
    opened: list[Bus] = []

    async def connect(name: str) -> Bus:
        options = BusOptions(url=server.url, prefix=prefix, nkey_seed_file=str(auth.seed(name)))
        b = await Bus.connect(options, service=name)
        opened.append(b)
        return b

    try:
        yield connect
    finally:
        for b in opened:
            await b.close()


def status(node: str) -> NodeStatus:
    from llmgw_core.events import NodeFacts

    return NodeStatus(node=node, facts=NodeFacts(node=node), updated_at=now())


def shard_status(node: str, name: str) -> ShardStatus:
    return ShardStatus(node=node, shard=name, replica="r0", state="ready", at=now())


async def refused(action: Awaitable[object], subject: str) -> PermissionDenied:
    """The action fails with nats-server's own refusal of `subject`."""
    with pytest.raises((BusError, PermissionDenied)) as err:
        await action
    denied = err.value if isinstance(err.value, PermissionDenied) else err.value.__cause__
    assert isinstance(denied, PermissionDenied), repr(err.value)
    assert denied.subject == subject
    assert denied.server_error == f'permissions violation for publish to "{subject.lower()}"'
    return denied


async def write_refused(bus: Bus, subject: str) -> None:
    """A JetStream publish (what a KV put is), sent as an attacker would: raw bytes."""
    await refused(bus.js.publish(subject, b"garbage"), subject)


async def core_refused(bus: Bus, subject: str) -> None:
    """A plain publish has no reply: the server's refusal comes on its own (even after a PONG)."""
    await bus.publish_core(subject, Heartbeat(node="x", service="launcher", at=now()))
    await eventually(lambda: [(r.verb, r.subject) for r in bus.nc.refusals][-1:] == [("publish to", subject)])


async def subscribe_refused(bus: Bus, subject: str) -> None:
    await bus.nc.subscribe(subject)
    await eventually(
        lambda: [(r.verb, r.subject) for r in bus.nc.refusals][-1:] == [("subscribe to", subject)]
    )


# --- the files -------------------------------------------------------------------


def test_init_writes_one_key_per_identity_that_only_its_owner_reads(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path / "auth")
    created = auth.init(["gpu-1", "gpu-2"], prefix="llmgw")
    assert created == ["placement", "ctl", "observer", "gateway", "node-gpu-1", "node-gpu-2"]
    assert stat.S_IMODE((tmp_path / "auth").stat().st_mode) == 0o700
    for name in ["auth.conf", "api-token", "api-read-token", *(f"{n}.nk" for n in created)]:
        assert stat.S_IMODE((tmp_path / "auth" / name).stat().st_mode) == 0o600, name
    keys = auth.identities()
    conf = auth.conf.read_text()
    for name, public_key in keys.items():
        assert public_key.startswith("U")
        assert f"# {name}\n    {{\n      nkey: {public_key}\n" in conf
    assert auth.seed("placement").read_text().startswith("SU")
    assert auth.token() != auth.token(read_only=True)
    assert len(auth.token()) >= 32

    # Running init again keeps every key; add-node adds one; rotate replaces one.
    assert auth.init(["gpu-1", "gpu-3"], prefix="llmgw") == ["node-gpu-3"]
    assert {k: v for k, v in auth.identities().items() if k != "node-gpu-3"} == keys
    assert auth.add_node("gpu-4") is True
    assert auth.add_node("gpu-4") is False
    auth.rotate("node-gpu-1")
    assert auth.identities()["node-gpu-1"] != keys["node-gpu-1"]
    assert auth.identities()["node-gpu-1"] in auth.conf.read_text()
    assert keys["node-gpu-1"] not in auth.conf.read_text()
    auth.remove_node("gpu-4")
    assert "node-gpu-4" not in auth.identities()


def test_init_refuses_what_would_break_a_subject(tmp_path: Path) -> None:
    auth = AuthDir(tmp_path)
    with pytest.raises(ConfigError) as err:
        auth.init(["gpu-01.dc1.example.com"])
    assert str(err.value) == (
        "'gpu-01.dc1.example.com' is not a node id: node ids match [A-Za-z0-9_-]+ (a dot splits a subject); "
        "for gpu-01.dc1.example.com use gpu-01"
    )
    auth.init(["gpu-1"], prefix="one")
    with pytest.raises(ConfigError, match="holds identities for the prefix 'one', not 'two'"):
        auth.init(["gpu-1"], prefix="two")


def test_the_cli_writes_the_same(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from llmgw.cli import main

    assert main(["auth", "init", "--dir", str(tmp_path / "a"), "--node", "n1", "--node", "n2"]) == 0
    assert main(["auth", "add-node", "n3", "--dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "6 new identities" in out
    assert "node n3: new identity" in out
    assert sorted(AuthDir(tmp_path / "a").identities()) == [
        "ctl",
        "gateway",
        "node-n1",
        "node-n2",
        "node-n3",
        "observer",
        "placement",
    ]
    assert main(["auth", "add-node", "n4", "--dir", str(tmp_path / "nothing")]) == 2
    assert "holds no llmgw identities" in capsys.readouterr().err


# --- a node ----------------------------------------------------------------------


async def test_a_node_writes_its_own_keys_and_nothing_else(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    node = await connect_as("node-gpu-1")
    n = node.names
    # Its own: status, shard status, heartbeats, events.
    await node.put(n.nodes_bucket, "gpu-1", status("gpu-1"))
    await node.put(n.shard_status_bucket, "gpu-1.s1", shard_status("gpu-1", "s1"))
    await node.delete(n.shard_status_bucket, "gpu-1.s1")
    await node.publish(
        n.node_install("gpu-1"), InstallProgress(node="gpu-1", engine="e", step="s", message="m")
    )
    await node.publish(n.shard_event("gpu-1", "s1"), shard_status("gpu-1", "s1"))
    await node.publish_core(
        n.heartbeat("gpu-1", "launcher"), Heartbeat(node="gpu-1", service="launcher", at=now())
    )
    await node.nc.flush()
    assert node.nc.denied_total == 0

    # Another node's.
    await write_refused(node, f"$KV.{prefix}-nodes.gpu-2")
    await write_refused(node, f"$KV.{prefix}-shard-status.gpu-2.s1")
    await write_refused(node, n.shard_event("gpu-2", "s1"))
    await write_refused(node, n.node_facts("gpu-2"))
    await core_refused(node, n.heartbeat("gpu-2", "launcher"))
    await core_refused(node, n.heartbeat("gpu-2", "installer"))

    # What only placement or the operator writes: shard specs (its own key too), the lease,
    # replicas, deployments, the catalog, the desired engines, replica events.
    for subject in [
        f"$KV.{prefix}-shards.gpu-1.evil",
        f"$KV.{prefix}-shards.gpu-2.evil",
        f"$KV.{prefix}-leases.placement",
        f"$KV.{prefix}-replicas.chat.r0",
        f"$KV.{prefix}-deployments.chat",
        f"$KV.{prefix}-catalog.tiny",
        f"$KV.{prefix}-config.engines",
        n.replica_event("chat", "r0"),
    ]:
        await write_refused(node, subject)
    # Through the bus client, the refusal reaches the caller as the cause of its BusError.
    await refused(node.put(n.nodes_bucket, "gpu-2", status("gpu-2")), f"$KV.{prefix}-nodes.gpu-2")
    # Nor may it manage streams.
    with pytest.raises(BusError) as err:
        await node.ensure()
    assert isinstance(err.value.__cause__, PermissionDenied)
    assert err.value.__cause__.subject == f"$JS.API.STREAM.CREATE.{prefix.upper()}_EVENTS"

    # Each refusal was counted, and none was retried: the put above was refused once.
    assert node.nc.denied_total == 16
    assert node.nc.denied[f"publish to $KV.{prefix}-nodes.gpu-2"] == 2


async def test_a_node_reads_only_its_own_shard_specs(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    n = bus.names
    mine, theirs = (
        shard("gpu-1", "s1", sim_profile()),
        shard("gpu-2", "s2", sim_profile(env={"HF_TOKEN": "x"})),
    )
    placement = await connect_as("placement")
    await placement.put(n.shards_bucket, "gpu-1.s1", mine)
    await placement.put(n.shards_bucket, "gpu-2.s2", theirs)

    node = await connect_as("node-gpu-1")
    found = await node.entries(n.shards_bucket, ShardSpec, "gpu-1.*")
    assert {k: c.value for k, c in found.items()} == {"gpu-1.s1": mine}

    for keys in ("gpu-2.*", "*.*", ">"):
        with pytest.raises(BusError) as err:
            await node.entries(n.shards_bucket, ShardSpec, keys)
        assert isinstance(err.value.__cause__, PermissionDenied)
        assert err.value.__cause__.subject.startswith(f"$JS.API.CONSUMER.CREATE.KV_{prefix}-shards.")
        assert err.value.__cause__.subject.endswith(f".$KV.{prefix}-shards.{keys}")
    # A get names the key in its body, where permissions cannot look: refused outright.
    await refused(
        node.get(n.shards_bucket, "gpu-2.s2", ShardSpec), f"$JS.API.STREAM.MSG.GET.KV_{prefix}-shards"
    )
    # It reads the desired engines.
    assert await node.get(n.config_bucket, "engines", ShardSpec) is None


async def test_a_consumer_cannot_widen_its_filter_in_the_request_body(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    """The subject names gpu-1's filter, the body asks for everything: the server says no."""
    node = await connect_as("node-gpu-1")
    body = {
        "stream_name": f"KV_{prefix}-shards",
        "config": {"name": "c1", "filter_subject": f"$KV.{prefix}-shards.>", "ack_policy": "none"},
    }
    reply = await node.nc.request(
        f"$JS.API.CONSUMER.CREATE.KV_{prefix}-shards.c1.$KV.{prefix}-shards.gpu-1.*",
        msgspec.json.encode(body),
        timeout=5,
    )
    error = msgspec.json.decode(reply.data)["error"]
    assert (
        error["description"] == "Consumer create request did not match filtered subject from create subject"
    )


async def test_a_node_service_starts_when_the_buckets_exist_and_says_what_is_missing_otherwise(
    server: SessionNats, prefix: str, tmp_path: Path
) -> None:
    auth = server.identities(prefix, tmp_path / "auth", ["gpu-1"])
    options = BusOptions(url=server.url, prefix=prefix, nkey_seed_file=str(auth.node_seed("gpu-1")))
    async with await Bus.connect(options, service="launcher-gpu-1") as node:
        with pytest.raises(BusError) as err:
            await require_streams(node, [f"KV_{prefix}-shards"], timeout=1)
        assert str(err.value) == (
            f"launcher-gpu-1: KV_{prefix}-shards still missing after 1s at {server.url} (prefix {prefix!r}); "
            "placement creates llmgw's streams and buckets when it starts: start it first, with the same "
            "nats prefix"
        )
        placement_options = BusOptions(
            url=server.url, prefix=prefix, nkey_seed_file=str(auth.seed("placement"))
        )
        async with await Bus.connect(placement_options, service="placement") as placement:
            await placement.ensure()
        await prepare_node(node)


# --- the others --------------------------------------------------------------------


async def test_the_observer_reads_state_and_writes_nothing(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    n = bus.names
    await bus.put(n.nodes_bucket, "gpu-1", status("gpu-1"))
    await bus.put(n.shards_bucket, "gpu-1.s1", shard("gpu-1", "s1", sim_profile()))
    observer = await connect_as("observer")
    assert set(await observer.entries(n.nodes_bucket, NodeStatus)) == {"gpu-1"}
    assert await observer.entries(n.replicas_bucket, NodeStatus) == {}

    for bucket, key in [
        (n.nodes_bucket, "gpu-1"),
        (n.shard_status_bucket, "gpu-1.s1"),
        (n.shards_bucket, "gpu-1.s1"),
        (n.deployments_bucket, "chat"),
        (n.catalog_bucket, "tiny"),
        (n.replicas_bucket, "chat.r0"),
        (n.leases_bucket, "placement"),
        (n.config_bucket, "engines"),
        (n.keys_bucket, "team"),
    ]:
        await write_refused(observer, f"$KV.{bucket}.{key}")
    await write_refused(observer, n.node_facts("gpu-1"))
    await write_refused(observer, n.dlq("observer"))
    await core_refused(observer, n.heartbeat("gpu-1", "installer"))
    # Shard specs carry environments: not even a watch.
    with pytest.raises(BusError) as err:
        await observer.entries(n.shards_bucket, ShardSpec)
    assert isinstance(err.value.__cause__, PermissionDenied)
    # Nor can it listen in on other identities' replies, or on writes as they pass.
    for subject in ("_INBOX.>", f"$KV.{prefix}-shards.>", ">"):
        await subscribe_refused(observer, subject)


async def test_the_operator_writes_deployments_and_the_catalog_only(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    n = bus.names
    ctl = await connect_as("ctl")
    await ctl.put(n.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
    await ctl.put(n.catalog_bucket, "tiny", sim_profile())
    await bus.put(n.shards_bucket, "gpu-1.s1", shard("gpu-1", "s1", sim_profile()))
    # The operator reads every shard spec. (Polled: a watch opened on another connection right
    # after the put has once come back empty in CI, the key not yet counted as pending.)

    async def ctl_reads_the_spec() -> bool:
        assert set(await ctl.entries(n.shards_bucket, ShardSpec)) == {"gpu-1.s1"}
        return True

    await eventually(ctl_reads_the_spec, timeout=10, interval=0.2)
    for subject in [
        f"$KV.{prefix}-shards.gpu-1.s2",
        f"$KV.{prefix}-leases.placement",
        f"$KV.{prefix}-nodes.gpu-1",
        f"$KV.{prefix}-replicas.chat.r0",
    ]:
        await write_refused(ctl, subject)
    await core_refused(ctl, n.heartbeat("gpu-1", "launcher"))

    # The operator makes client keys; a gateway reads them, and shares limits and usage.
    key = ApiKey(name="team", hash="0" * 64)
    await ctl.put(n.keys_bucket, "team", key)
    gateway = await connect_as("gateway")
    assert await gateway.entries(n.replicas_bucket, NodeStatus) == {}
    assert set(await gateway.entries(n.keys_bucket, ApiKey)) == {"team"}
    await gateway.put(n.limits_bucket, "team", KeyWindow(window=1, requests=1))
    await gateway.publish(n.usage("chat", "team"), UsageRecord(key="team", deployment="chat"))
    await write_refused(gateway, f"$KV.{prefix}-replicas.chat.r0")
    await write_refused(gateway, f"$KV.{prefix}-keys.team")
    await write_refused(gateway, f"$KV.{prefix}-deployments.chat")
    with pytest.raises(BusError):
        await gateway.entries(n.nodes_bucket, NodeStatus)


async def test_only_the_operator_asks_a_launcher_for_logs_and_only_its_node_answers(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str
) -> None:
    n = bus.names
    node = await connect_as("node-gpu-1")

    async def answer(msg: Msg) -> None:
        await msg.respond(b"its lines")

    await node.nc.subscribe(n.launcher_logs("gpu-1"), cb=answer)
    await node.nc.flush()
    ctl = await connect_as("ctl")
    reply = await ctl.nc.request(n.launcher_logs("gpu-1"), b"{}", timeout=5)
    assert reply.data == b"its lines"
    assert node.nc.denied_total == 0
    # Logs can quote secrets: observers may not ask, and no node may answer for another.
    observer = await connect_as("observer")
    await core_refused(observer, n.launcher_logs("gpu-1"))
    other = await connect_as("node-gpu-2")
    await subscribe_refused(other, n.launcher_logs("gpu-1"))


# --- connecting ----------------------------------------------------------------------


async def test_without_credentials_nobody_gets_in(server: SessionNats, prefix: str) -> None:
    with pytest.raises(BusError) as err:
        await Bus.connect(BusOptions(url=server.url, prefix=prefix), service="placement")
    assert str(err.value) == (
        f"placement: no NATS identity for {server.url}: set nats: nkey_seed_file (or LLMGW_NATS_NKEY) to a "
        "seed that `llmgw auth init` wrote, or nats: insecure: true (LLMGW_NATS_INSECURE=1) for a cluster "
        "without authentication"
    )
    # Asking for no authentication does not make the server give in.
    with pytest.raises(BusError) as err:
        await Bus.connect(BusOptions(url=server.url, prefix=prefix, insecure=True), service="placement")
    assert str(err.value).startswith(
        f"placement: cannot connect to NATS at {server.url} as no credentials: "
        "nats: 'Authorization Violation'; "
    )


@pytest.mark.timeout(20)
async def test_a_key_the_server_does_not_know_fails_at_once_in_one_line(
    server: SessionNats, auth: AuthDir, prefix: str, tmp_path: Path
) -> None:
    stranger = AuthDir(tmp_path / "other")
    stranger.init(["gpu-1"], prefix=prefix)
    options = BusOptions(
        url=server.url, prefix=prefix, nkey_seed_file=str(stranger.node_seed("gpu-1")), connect_timeout_s=60
    )
    with pytest.raises(BusError) as err:
        await Bus.connect(options, service="launcher-gpu-1")
    key = stranger.identities()["node-gpu-1"]
    assert str(err.value) == (
        f"launcher-gpu-1: cannot connect to NATS at {server.url} as node-gpu-1 ({key[:12]}…): "
        "nats: 'Authorization Violation'; the server does not accept this identity: check that its "
        "auth.conf lists the key (`llmgw auth init` and `llmgw auth add-node` write it) and that this is "
        "the right seed file"
    )
    with pytest.raises(ConfigError, match=r"^cannot read the nkey seed file /nonexistent.nk: No such file"):
        await Bus.connect(BusOptions(url=server.url, nkey_seed_file="/nonexistent.nk"), service="x")


async def test_a_new_node_and_a_rotated_key_count_from_the_reload(
    server: SessionNats, auth: AuthDir, prefix: str
) -> None:
    def options(seed: Path) -> BusOptions:
        return BusOptions(url=server.url, prefix=prefix, nkey_seed_file=str(seed), connect_timeout_s=10)

    auth.add_node("gpu-9")  # written, not yet loaded
    with pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(options(auth.node_seed("gpu-9")), service="installer-gpu-9")
    server.write()
    server.server.reload()
    async with await Bus.connect(options(auth.node_seed("gpu-9")), service="installer-gpu-9"):
        pass

    old_seed = auth.node_seed("gpu-1").read_text()
    before = await Bus.connect(options(auth.node_seed("gpu-1")), service="installer-gpu-1")
    auth.rotate("node-gpu-1")
    server.write()
    server.server.reload()
    # The server closes what the old key had open.
    await eventually(lambda: not before.nc.is_connected, timeout=10)
    await before.close()
    async with await Bus.connect(options(auth.node_seed("gpu-1")), service="installer-gpu-1"):
        pass
    auth.node_seed("gpu-1").write_text(old_seed)
    with pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(options(auth.node_seed("gpu-1")), service="installer-gpu-1")


async def test_a_refusal_is_logged_with_the_subject_and_the_identity_once(
    bus: Bus, auth: AuthDir, connect_as: Connect, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="llmgw.access")
    node = await connect_as("node-gpu-1")
    for _ in range(3):
        with pytest.raises(BusError):
            await node.put(node.names.nodes_bucket, "gpu-2", status("gpu-2"))
    key = auth.identities()["node-gpu-1"]
    lines = [r.getMessage() for r in caplog.records if r.name == "llmgw.access"]
    assert lines == [
        f"node-gpu-1: nats-server refused identity node-gpu-1 ({key[:12]}…) permission to publish to "
        f"$KV.{prefix}-nodes.gpu-2; not retried. Its permissions are in the server's auth.conf "
        "(llmgw auth init writes them)"
    ]
    assert node.nc.denied_total == 3


async def test_a_heartbeat_counts_for_the_node_its_subject_names(
    bus: Bus, auth: AuthDir, connect_as: Connect, nats_url: str, prefix: str
) -> None:
    """gpu-1 may beat only on its own subject; what it writes inside does not keep gpu-2 alive."""
    import anyio

    from llmgw_placement import PlacementService, ServerConfig

    config = msgspec.convert({"nats": {"url": nats_url, "prefix": prefix}, "engines": []}, ServerConfig)
    service = PlacementService(config, await connect_as("placement"))
    node = await connect_as("node-gpu-1")
    async with anyio.create_task_group() as tg:
        await tg.start(service.run)

        async def beat() -> bool:
            # A core publish from another connection can reach the server before placement's
            # subscription does: beat until one is heard, as a node does.
            await node.publish_core(
                node.names.heartbeat("gpu-1", "launcher"),
                Heartbeat(node="gpu-2", service="launcher", at=now()),
            )
            return "gpu-1" in service.state.last_seen

        await eventually(beat)
        assert "gpu-2" not in service.state.last_seen
        tg.cancel_scope.cancel()


async def test_ctl_takes_its_identity_from_a_flag(auth: AuthDir, server: SessionNats, prefix: str) -> None:
    import os
    import sys

    import anyio

    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_NATS_")}
    env["LLMGW_NATS_URL"] = server.url
    ctl = [
        sys.executable,
        "-c",
        "import sys; from llmgw.cli import main; sys.exit(main())",
        "ctl",
        "--prefix",
        prefix,
    ]
    ok = await anyio.run_process([*ctl, "--nkey", str(auth.seed("ctl")), "nodes"], env=env, check=False)
    assert ok.returncode == 0, ok.stderr.decode()
    assert ok.stdout.decode().split() == ["NODE", "STATE", "GPUS", "ENGINES", "INSTALL", "WARNINGS"]
    # The observer may read nodes, but not write a deployment.
    deploy = ["deploy", "chat", "--profile", "tiny"]
    denied = await anyio.run_process(
        [*ctl, "--nkey", str(auth.seed("observer")), *deploy], env=env, check=False
    )
    # Refused (exit code 4, docs/ctl.md; nats-server's own refusal is logged above it): the
    # observer may not even read the catalog that `deploy` checks the profile against.
    assert denied.returncode == 4, denied.stderr.decode()
    line = denied.stderr.decode().splitlines()[-1]
    assert line.startswith("llmgw: ")
    assert "nats-server refused observer (" in line


async def test_the_fleet_command_joins_as_the_fleet_identity(
    bus: Bus, auth: AuthDir, server: SessionNats, prefix: str, tmp_path: Path
) -> None:
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_NATS_")}
    env["LLMGW_NATS_URL"] = server.url
    argv = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "fleet"]
    argv += ["--prefix", prefix, "--nkey", str(auth.seed("fleet")), "--nodes", "3", "--name", "fl"]
    with (tmp_path / "fleet.log").open("wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        async def three() -> bool:
            found = await bus.entries(bus.names.nodes_bucket, NodeStatus)
            assert sorted(found) == ["fl-00000", "fl-00001", "fl-00002"]
            return True

        await eventually(three, timeout=30, interval=0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    assert "permission" not in (tmp_path / "fleet.log").read_text()
