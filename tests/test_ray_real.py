"""Two vLLM replicas' Ray clusters on one machine, started for real from the vLLM adapter's
command lines (`ray` from the real-engines dependency group): each worker joins its own
replica's head, and a driver with vLLM's environment finds its own replica's cluster."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import VLLM, Command, Member, Profile, ShardSpec, VLLMConfig
from tests.launcher_support import agent_config, running_launcher, shard, shard_events
from tests.test_sim_engine import free_port
from tests.waiting import eventually

T = TypeVar("T")

pytestmark = [pytest.mark.timeout(600)]


def ray_bin_dir() -> str:
    bin_dir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bin_dir, "ray")):
        why = "needs Ray from the real-engines dependency group (just test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run the real Ray tests, not skip them")
        pytest.skip(why)
    return bin_dir


def replica_shards(replica: str, rendezvous: int) -> tuple[ShardSpec, ShardSpec]:
    """Rank 0 and rank 1 of a two-node replica whose "nodes" are both this machine."""
    profile = msgspec.convert(
        {
            "name": "tiny",
            "engine": "vllm",
            "model_path": "/models/tiny",
            "tp": 2,
            "nodes": 2,
            "gpus_per_node": 1,
        },
        Profile,
    )
    members = (
        Member(node="node-a", addr="127.0.0.1", port=rendezvous),
        Member(node="node-b", addr="127.0.0.1", port=rendezvous),
    )
    return tuple(  # type: ignore[return-value]
        ShardSpec(
            replica=replica,
            shard=f"{replica}-{rank}",
            node=members[rank].node,
            profile=profile,
            rank=rank,
            port=free_port() if rank == 0 else 0,
            members=members,
            fabric="loopback",
            extra_ports=(free_port(),) if rank == 0 else (),
        )
        for rank in (0, 1)
    )


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def started(cmds: list[Command], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run each command as the launcher would (its own process group, its wait_for first)."""
    groups: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in cmds:
            for addr in cmd.wait_for:
                deadline = time.monotonic() + 120
                while not listening(addr.port):
                    assert time.monotonic() < deadline, f"{cmd.name}: {addr} never listened"
                    time.sleep(0.2)
            with (logs / f"{cmd.name}-{len(groups)}.log").open("ab") as log:
                groups.append(
                    subprocess.Popen(
                        cmd.argv,
                        env=cmd.env_dict(),
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        yield groups
    finally:
        for proc in reversed(groups):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in groups:
            try:
                # A Ray node whose head is gone drains for 30 s before it exits: no need to wait.
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            # What the head left behind in its group (raylet, GCS) goes too.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def ray_status(bin_dir: str, port: int) -> str:
    out = subprocess.run(
        [os.path.join(bin_dir, "ray"), "status", f"--address=127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout + out.stderr


def alive_nodes(status: str) -> int:
    """The node count under `Active:` in `ray status`'s report."""
    active = status.split("Active:", 1)[1].split("Pending:", 1)[0]
    return len(re.findall(r"^\s*1 node_", active, re.MULTILINE))


@pytest.mark.real_ray
def test_two_replicas_rays_on_one_machine_never_meet() -> None:
    bin_dir = ray_bin_dir()
    # Short: Ray's socket paths must fit in 107 bytes.
    temp_root = Path(tempfile.mkdtemp(prefix="llmgw-ray-", dir="/tmp"))
    logs = temp_root / "logs"
    logs.mkdir()
    vllm = VLLM(VLLMConfig(bin_dir=bin_dir, multinode="ray", ray_temp_root=str(temp_root)))
    # Adjacent rendezvous ports, as placement hands them out on one node.
    first = adjacent_free_ports()
    replicas = {"r0": replica_shards("r0", first), "r1": replica_shards("r1", first + 1)}
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    plans = {}
    for name, (leader, worker) in replicas.items():
        assert vllm.validate(leader.profile, [], leader) == []
        head, serve = vllm.commands(leader, environ)
        [join] = vllm.commands(worker, environ)
        assert (head.name, serve.name, join.name) == ("ray-head", "vllm", "ray-worker")
        plans[name] = (head, serve, join)

    for name in plans:
        (logs / name).mkdir()
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutil.rmtree, temp_root, ignore_errors=True)
        nodes: list[subprocess.Popen[bytes]] = []

        def none_ended() -> None:
            # `ray start --block` runs as long as its node: one that ended will never join.
            ended = {" ".join(map(str, p.args[1:3])): p.returncode for p in nodes if p.poll() is not None}
            if ended:
                raise RuntimeError(f"Ray nodes ended: {ended}\n{log_tails(temp_root)}")

        def active(expected: dict[str, int]) -> dict[str, str]:
            none_ended()
            found = {name: ray_status(bin_dir, replicas[name][0].leader().port) for name in expected}
            said = "\n".join(f"{name}:\n{status}" for name, status in found.items())
            # Its own head and its own worker: never three on one head and one on the other.
            assert all("Active:" in status for status in found.values()), said
            assert {name: alive_nodes(status) for name, status in found.items()} == expected, said
            return found

        def wait(expected: dict[str, int]) -> dict[str, str]:
            try:
                return until(lambda: active(expected), timeout=300)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{log_tails(temp_root)}") from None

        def registered(log: Path) -> None:
            # `ray start` says so once its node has registered with the head's GCS.
            deadline = time.monotonic() + 300
            while "Ray runtime started" not in log.read_text(errors="replace"):
                none_ended()
                assert time.monotonic() < deadline, f"{log.name} never said so\n{log_tails(temp_root)}"
                time.sleep(0.5)

        # One node at a time, each once the one before has registered: Ray gives a starting
        # raylet 30 s to register (not configurable), which four nodes starting at once on a
        # busy 2-core machine overran. r1's head still starts after r0's cluster is whole, and
        # its worker must find r1's head, not r0's on the port beside it.
        for name in ("r0", "r1"):
            head, _, join = plans[name]
            nodes += cleanup.enter_context(started([head], logs / name))
            registered(logs / name / "ray-head-0.log")
            nodes += cleanup.enter_context(started([join], logs / name))
            registered(logs / name / "ray-worker-0.log")
        statuses = wait({"r0": 2, "r1": 2})
        assert set(statuses) == {"r0", "r1"}
        for leader, _ in replicas.values():
            sessions = list((temp_root / str(leader.leader().port)).glob("session_2*"))
            # One session per replica, in the replica's own temp dir.
            assert len(sessions) == 1, sessions
        # A driver with r0's vLLM environment attaches to r0's cluster, though r1's head
        # started last: RAY_ADDRESS names it.
        serve_env = plans["r0"][1].env_dict()
        assert serve_env["RAY_ADDRESS"] == f"127.0.0.1:{first}"
        probe = subprocess.run(
            [
                sys.executable,
                "-c",
                "import ray; ray.init(); import ray._private.worker as w; "
                "alive = [n for n in ray.nodes() if n['Alive']]; "
                "print('gcs', w.global_worker.node.gcs_address, 'nodes', len(alive))",
            ],
            env=serve_env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        # Ray names the head by the machine's own address, whatever loopback address it was given.
        assert re.search(rf"^gcs [^ ]+:{first} nodes 2$", probe.stdout, re.MULTILINE), (
            probe.stdout + probe.stderr
        )


def log_tails(temp_root: Path, lines: int = 30) -> str:
    """For a failure: each Ray node's own output, and each session's raylet and GCS logs."""
    found = sorted(temp_root.glob("logs/*/*.log"))
    for name in ("raylet.out", "gcs_server.out"):
        found += sorted(temp_root.glob(f"*/session_2*/logs/{name}"))
    tails = []
    for log in found:
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        tails.append(f"--- {log.relative_to(temp_root)}\n" + "\n".join(tail))
    return "\n".join(tails)


def until(check: Callable[[], T], timeout: float) -> T:
    """`check()` once it stops raising AssertionError; at the deadline, its last AssertionError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def adjacent_free_ports() -> int:
    """A port that is free with its neighbour: placement gives replicas on a node adjacent ports."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two adjacent free ports")


@pytest.mark.anyio
async def test_the_launcher_gives_each_ray_head_its_own_client_port_and_temp_dir(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Two replicas' Ray heads on one launcher, with a `ray` that records its argv (the real one
    runs above): each head gets a client-server port of its own from the node's port range."""
    env = tmp_path / "env" / "bin"
    env.mkdir(parents=True)
    for script in ("ray", "vllm"):
        (env / script).write_text('#!/bin/sh\nprintf "%s\\n" "$@" > argv\nexec sleep 600\n')
        (env / script).chmod(0o755)
    state = Path(tempfile.mkdtemp(prefix="llmgw-", dir="/tmp"))
    config = agent_config(
        nats_url,
        prefix,
        state,
        port_range=[24100, 24199],
        engines={"vllm": {"path": str(env), "multinode": "ray"}},
    )
    # A model path the node holds: one it lacks fails the shard before any process starts.
    profile = msgspec.structs.replace(replica_shards("r0", 1)[0].profile, model_path=str(tmp_path))
    rendezvous = adjacent_free_ports()
    try:
        async with shard_events(bus) as events, running_launcher(config, gpus=[]):
            for i, replica in enumerate(("r0", "r1")):
                members = [
                    {"node": "node-a", "addr": "127.0.0.1", "port": rendezvous + i},
                    {"node": "node-b", "addr": "127.0.0.1", "port": rendezvous + i},
                ]
                await bus.put(
                    bus.names.shards_bucket,
                    f"node-a.{replica}-0",
                    shard("node-a", f"{replica}-0", profile, replica=replica, members=members, fabric="lo"),
                )
            # The fake head never listens: each server waits for its own head.
            for i, replica in enumerate(("r0", "r1")):
                await eventually(
                    lambda r=replica, i=i: (
                        (s := events.last(f"{r}-0")) and s.reason == f"waiting for 127.0.0.1:{rendezvous + i}"
                    ),
                    timeout=30,
                )
            heads = {}
            for replica in ("r0", "r1"):
                argv = state / "run" / f"node-a.{replica}-0" / "argv"
                heads[replica] = await eventually(lambda a=argv: a.exists() and a.read_text().split("\n"))
        client_ports = {
            r: int(next(a for a in argv if a.startswith("--ray-client-server-port=")).split("=")[1])
            for r, argv in heads.items()
        }
        assert client_ports["r0"] != client_ports["r1"]
        assert all(24100 <= p <= 24199 for p in client_ports.values()), client_ports
        for i, replica in enumerate(("r0", "r1")):
            assert f"--port={rendezvous + i}" in heads[replica]
            assert f"--temp-dir={state / 'ray' / str(rendezvous + i)}" in heads[replica]
    finally:
        shutil.rmtree(state, ignore_errors=True)
