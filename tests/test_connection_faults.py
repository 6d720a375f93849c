"""The connection to NATS ends for good, or nearly: what the bus and the services do then.

Regressions pinned here: a 3,955-character deployment name became a KV subject whose
protocol line the server refused (`-ERR 'maximum control line exceeded'`); nats-py
closed the client for good, llmgw never opened another, and placement stayed up with
every call failing `connection closed`. A placement whose key was rotated stayed up,
refused at every reconnect, saying only `disconnected`. On a fresh 3-server cluster
placement took a minute to create the replicated streams and every node agent gave up
at 30 s.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from nats.aio.client import Client

from llmgw.auth import AuthDir
from llmgw_core.access import SubjectTooLong
from llmgw_core.bus import REFUSED_RECONNECT_GRACE_S, Bus, BusOptions, Writes
from llmgw_core.config import AgentConfig
from llmgw_core.errors import ConnectionLost
from llmgw_core.events import Deployment, Liveness, NodeStatus, decoder
from llmgw_core.lifecycle import while_connected
from llmgw_core.natsd import NatsServer
from llmgw_placement.config import ServerConfig
from tests.nats_cluster import nats_cluster
from tests.waiting import eventually

# As in test_nats_faults: nats-py's reconnect loop drops the transport of an attempt that
# failed its handshake (here: refused) without closing it; each test collects its garbage
# before it ends, so what it leaked is judged with it and no later.
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.filterwarnings(
        "ignore:Exception ignored in. <(socket\\.socket|function StreamWriter\\.__del__|"
        "function _SelectorTransport\\.__del__):pytest.PytestUnraisableExceptionWarning"
    ),
]

TOO_LONG = "d" * 3955


@pytest.fixture(autouse=True)
async def _collect_leaked_transports() -> AsyncIterator[None]:
    # While the test's event loop still runs: a transport collected after it closed warns
    # `loop is closed` outside any test, where no filter applies.
    yield
    gc.collect()


class _Errors(logging.Handler):
    """What llmgw logs at ERROR, as text: caplog keeps each record's arguments, and with
    them the sockets of nats-py's failed reconnects past the test's end."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def said() -> Iterator[list[str]]:
    handler = _Errors()
    logger = logging.getLogger("llmgw")
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _refused(subject: str, limit: int) -> str:
    return (
        f"subject '{subject[:48]}…' is {len(subject):,} bytes long, over the bus's limit of {limit:,} bytes: "
        "nats-server closes a connection whose protocol line is longer than its max_control_line "
        "(4,096 bytes by default), so nothing was sent; use a shorter name"
    )


# --- the guard ------------------------------------------------------------------------


async def test_a_subject_too_long_for_the_server_is_refused_before_anything_is_sent(bus: Bus) -> None:
    bucket = bus.names.deployments_bucket
    key_subject = f"$KV.{bucket}.{TOO_LONG}"
    chat = Deployment(name="chat", profile="tp1")

    for call in (
        bus.put(bucket, TOO_LONG, chat),
        bus.create(bucket, TOO_LONG, chat),
        bus.get(bucket, TOO_LONG, Deployment),
    ):
        with pytest.raises(SubjectTooLong) as refused:
            await call
        assert str(refused.value) == _refused(key_subject, 1024)
        assert not refused.value.retryable

    # A delete is one plain publish: a key over the bus's limit that a raw client stored can
    # be removed, and only a line the server would refuse is refused, by the client's guard.
    await bus.delete(bucket, "k" * 2000)
    with pytest.raises(SubjectTooLong) as refused:
        await bus.delete(bucket, TOO_LONG)
    assert not refused.value.retryable
    assert "over the bus's limit of 3," in str(refused.value)

    event_subject = f"{bus.names.prefix}.events.deployment.{TOO_LONG}"
    with pytest.raises(SubjectTooLong) as refused:
        await bus.publish(event_subject, chat)
    assert str(refused.value) == _refused(event_subject, 1024)

    # One write too long refuses the whole commit: the short one beside it is not written.
    writes = Writes()
    writes.put(bucket, "chat", chat)
    writes.put(bucket, TOO_LONG, chat)
    with pytest.raises(SubjectTooLong):
        await bus.commit(writes)
    assert await bus.get(bucket, "chat", Deployment) is None

    # Beneath the bus, the client itself: the whole protocol line (subject, reply inbox,
    # sizes) must fit the server's, so that no caller can send what it would refuse.
    raw = f"{bus.names.prefix}." + "x" * 4100
    with pytest.raises(SubjectTooLong) as refused:
        await bus.nc.publish(raw, b"")
    assert str(refused.value) == _refused(raw, 4096 - 64)
    with pytest.raises(SubjectTooLong) as refused:
        await bus.nc.subscribe(raw)
    assert str(refused.value) == _refused(raw, 4096 - 64)

    # The connection is whole: nothing reached the server.
    await bus.put(bucket, "chat", chat)
    assert await bus.get(bucket, "chat", Deployment) is not None
    assert not bus.nc.is_closed
    assert not bus.lost.is_set()


# --- a connection closed for good -------------------------------------------------------


async def test_a_connection_the_server_closed_for_good_ends_what_runs_on_it_saying_why(
    bus: Bus, said: list[str]
) -> None:
    url = bus.options.resolved_url()
    cause = (
        f"test: NATS at {url} closed the connection for good (maximum control line exceeded); "
        "the server refused a protocol line longer than its max_control_line; llmgw refuses such "
        "subjects before sending them, so this is a bug: report it with this service's log"
    )
    bucket = bus.names.deployments_bucket

    async def service() -> None:
        async with while_connected(bus):
            # What the bus refuses to send, sent past it by nats-py's own publish: the
            # server answers -ERR 'maximum control line exceeded' and closes, and nats-py
            # closes the client for good.
            await Client.publish(bus.nc, f"{bus.names.prefix}." + "x" * 4100, b"")
            async for _ in bus.watch(bucket, Deployment):
                pass

    with anyio.fail_after(30), pytest.raises(ConnectionLost) as ended:
        await service()
    assert str(ended.value) == f"{cause}; test ends here, for its supervisor to start it again"
    assert not ended.value.retryable
    assert bus.nc.is_closed
    assert said == [cause]

    # Every later call says why at once, instead of retrying `connection closed`.
    started = time.monotonic()
    for call in (
        bus.put(bucket, "chat", Deployment(name="chat", profile="tp1")),
        bus.publish(f"{bus.names.prefix}.events.x", Deployment(name="chat", profile="tp1")),
        bus.entries(bucket, Deployment),
        bus.heartbeat("n1", "test", 0.1),
    ):
        with pytest.raises(ConnectionLost) as again:
            await call
        assert str(again.value) == cause
    with pytest.raises(ConnectionLost):
        async for _ in bus.watch(bucket, Deployment):
            pass
    assert time.monotonic() - started < 5


async def test_while_connected_passes_the_bodys_own_error_through_as_it_is(bus: Bus) -> None:
    """A service's main says an LlmgwError in one line: the body's own error must not come
    out wrapped in an ExceptionGroup."""
    with pytest.raises(SubjectTooLong):
        async with while_connected(bus):
            await bus.put(bus.names.deployments_bucket, TOO_LONG, Deployment(name="chat", profile="tp1"))
    async with while_connected(bus):
        pass  # and a body that ends ends it
    assert not bus.lost.is_set()


@contextlib.contextmanager
def _auth_server(root: Path, prefix: str) -> Iterator[tuple[NatsServer, AuthDir]]:
    auth = AuthDir(root / "auth")
    auth.init(["n1"], prefix=prefix)
    server = NatsServer(store_dir=root / "nats", includes=(auth.conf,))
    server.start()
    try:
        yield server, auth
    finally:
        server.stop()


async def test_a_server_restarted_without_this_identity_ends_the_connection_after_a_grace(
    tmp_path: Path, prefix: str, said: list[str]
) -> None:
    """nats-py tries a refused reconnect for ever with the public key of its first
    connection: a rotated key is only read by a new connection, so the bus gives up."""
    with _auth_server(tmp_path, prefix) as (server, auth):
        options = BusOptions(url=server.url, prefix=prefix, nkey_seed_file=str(auth.seed("placement")))
        identity = str(options.identity())
        async with await Bus.connect(options, service="placement") as bus:
            await bus.ensure()
            server.stop()
            auth.rotate("placement")
            server.start()

            def first_refusal() -> bool:
                return any("refuses" in line for line in said)

            await eventually(first_refusal, timeout=30, interval=0.1)
            refused_at = time.monotonic()
            assert not bus.lost.is_set()
            with anyio.fail_after(60):
                await bus.lost.wait()
            assert time.monotonic() - refused_at >= REFUSED_RECONNECT_GRACE_S - 1.0
            cause = (
                f"placement: NATS at {server.url} refused every reconnect for 10 s "
                "(Authorization Violation); the server no longer accepts this identity (its key was "
                "rotated or removed, or its credentials expired): check its entry in the server's "
                "auth.conf; a new connection reads the seed file again"
            )
            assert bus.lost_cause == cause
            assert said == [
                f"placement: NATS at {server.url} refuses {identity} at reconnect: Authorization Violation; "
                "check its entry in the server's auth.conf",
                cause,
            ]
            with pytest.raises(ConnectionLost) as again:
                await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))
            assert str(again.value) == cause

        # A new connection reads the rotated seed and is accepted.
        async with await Bus.connect(options, service="placement") as bus:
            await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1"))


# --- real processes ---------------------------------------------------------------------


def _server_yaml(root: Path, url: str, prefix: str, auth: AuthDir, replicas: int = 1) -> Path:
    config = msgspec.convert(
        {
            "nats": {
                "url": url,
                "prefix": prefix,
                "nkey_seed_file": str(auth.seed("placement")),
                "replicas": replicas,
            },
            "engines": [],
            "catalog": [],
            "deployments": [],
            "heartbeat_interval_s": 0.3,
            "node_timeout_s": 3.0,
            "http": {
                "host": "127.0.0.1",
                "port": 0,
                "token_file": str(auth.api_token_file),
                "read_token_file": str(auth.api_read_token_file),
            },
            "identity": "a",
        },
        ServerConfig,
    )
    path = root / "server.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    return path


class _Procs:
    """Processes this test started, each logging to a file; killed by their pids at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def _processes(root: Path) -> Iterator[_Procs]:
    procs = _Procs(root)
    try:
        yield procs
    finally:
        procs.close()


async def _leader(ctl: Bus) -> bool:
    try:
        reply = await ctl.nc.request(ctl.names.liveness_request, b"", timeout=1)
    except Exception:
        return False
    return decoder(Liveness).decode(reply.data).leader


@pytest.mark.timeout(240)
async def test_a_placement_whose_connection_is_lost_for_good_exits_saying_why_and_a_restart_works(
    tmp_path: Path, prefix: str
) -> None:
    with _auth_server(tmp_path, prefix) as (server, auth), _processes(tmp_path) as procs:
        argv = [
            sys.executable,
            "-m",
            "llmgw_placement",
            "--config",
            str(_server_yaml(tmp_path, server.url, prefix, auth)),
        ]
        placement = procs.start("placement", argv)
        ctl_options = BusOptions(url=server.url, prefix=prefix, nkey_seed_file=str(auth.seed("ctl")))
        async with await Bus.connect(ctl_options, service="test-ctl") as ctl:
            await eventually(lambda: _leader(ctl), timeout=60, interval=0.3)

            # `llmgw auth rotate placement` and a reload: the server drops the connection
            # and refuses the key nats-py goes on signing with.
            auth.rotate("placement")
            server.reload()
            await eventually(lambda: placement.poll() is not None, timeout=90, interval=0.2)
            assert placement.returncode == 2
            log = procs.log("placement")
            assert "Traceback" not in log
            assert log.splitlines()[-1] == (
                f"llmgw-placement: placement: NATS at {server.url} refused every reconnect for 10 s "
                "(Authorization Violation); the server no longer accepts this identity (its key was rotated "
                "or removed, or its credentials expired): check its entry in the server's auth.conf; a new "
                "connection reads the seed file again; placement ends here, for its supervisor to start it "
                "again"
            )

            # Its supervisor starts it again: the new connection reads the rotated seed.
            again = procs.start("placement-again", argv)
            await eventually(lambda: _leader(ctl), timeout=60, interval=0.3)
            assert again.poll() is None


def _agent_yaml(root: Path, url: str, prefix: str, auth: AuthDir, node: str) -> Path:
    config = msgspec.convert(
        {
            "node": node,
            "port_range": [21000, 21099],
            "state_dir": str(root / node),
            "nats": {"url": url, "prefix": prefix, "nkey_seed_file": str(auth.node_seed(node))},
            "simulate": {"gpu_count": 1},
            "heartbeat_interval_s": 0.5,
        },
        AgentConfig,
    )
    path = root / f"agent-{node}.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    return path


OLD_AGENT_TIMEOUT_S = 30.0


@pytest.mark.timeout(420)
async def test_agents_started_before_placement_on_a_fresh_3_server_cluster_wait_for_the_streams(
    tmp_path: Path, prefix: str
) -> None:
    """Placement is started after the 30 s at which agents used to give up: they wait for it,
    say so once, say when the streams are there, and come up without a restart."""
    auth = AuthDir(tmp_path / "auth")
    auth.init(["n1"], prefix=prefix)
    with nats_cluster(tmp_path / "nats", includes=(auth.conf,)) as cluster, _processes(tmp_path) as procs:
        agent = str(_agent_yaml(tmp_path, cluster.url, prefix, auth, "n1"))
        started = time.monotonic()
        agents = {
            name: procs.start(name, [sys.executable, "-m", f"llmgw_{name}", "--config", agent])
            for name in ("installer", "launcher")
        }

        def waiting(name: str) -> bool:
            return "waiting for placement to create streams" in procs.log(name)

        for name in agents:
            await eventually(lambda name=name: waiting(name), timeout=60, interval=0.2)
        # The delay of a slow cluster, longer than the agents' old limit.
        await anyio.sleep(max(0.0, OLD_AGENT_TIMEOUT_S + 5 - (time.monotonic() - started)))
        for name, proc in agents.items():
            assert proc.poll() is None, procs.log(name)

        server_yaml = _server_yaml(tmp_path, cluster.url, prefix, auth, replicas=3)
        placement = procs.start(
            "placement", [sys.executable, "-m", "llmgw_placement", "--config", str(server_yaml)]
        )

        def there(name: str) -> bool:
            return "the streams are there after" in procs.log(name)

        for name in agents:
            await eventually(lambda name=name: there(name), timeout=240, interval=0.5)

        ctl_options = BusOptions(url=cluster.url, prefix=prefix, nkey_seed_file=str(auth.seed("ctl")))
        async with await Bus.connect(ctl_options, service="test-ctl") as ctl:

            async def node_reported() -> dict[str, Any]:
                try:
                    return await ctl.entries(ctl.names.nodes_bucket, NodeStatus)
                except Exception:
                    return {}

            assert "n1" in await eventually(node_reported, timeout=120, interval=1.0)
        for name, proc in {**agents, "placement": placement}.items():
            assert proc.poll() is None, procs.log(name)
        for name in agents:
            log = procs.log(name)
            assert log.count("waiting for placement to create streams") == 1, log
            assert log.count("the streams are there after") == 1, log
            assert "still missing" not in log
