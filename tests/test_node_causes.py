"""Causes found on the node, said on every surface: a model file the node lacks (found before
any engine starts, and placement sends the profile elsewhere until the file is there), and an
engine the kernel's OOM killer ended (its memory cgroup's count, and the kernel log)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw.fleet import Fleet
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, DeploymentStatus, Heartbeat, ReplicaStatus, decoder
from llmgw_launcher import oom
from llmgw_launcher.modelfiles import MissingModels, existing
from llmgw_placement.feasibility import NodeView, unfit
from tests.cluster_support import cluster, sim_catalog
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually, passes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]


# --- a model file the node lacks ------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "path"),
    [
        ({"model_path": "/models/x.gguf"}, "/models/x.gguf"),
        ({"model": "file:///models/x.gguf"}, "/models/x.gguf"),
        # A relative path may be a hub id that vLLM or SGLang resolves itself.
        ({"model_path": "meta-llama/Llama-3-8B"}, ""),
        ({"model_path": "sim://tiny"}, ""),
        # Staged by the node itself: nothing it must hold beforehand.
        ({"model": "hf://org/repo/x.gguf", "model_path": ""}, ""),
    ],
)
def test_the_file_a_node_must_hold_for_a_profile(fields: dict[str, str], path: str) -> None:
    profile = msgspec.convert({"name": "p", "engine": "llamacpp", **fields}, Profile)
    assert profile.node_file == path


def test_a_node_that_lacks_the_model_file_is_refused_in_those_words() -> None:
    profile = msgspec.convert({"name": "p", "engine": "sim", "model_path": "/models/x.gguf"}, Profile)
    dep = Deployment(name="chat", profile="p")
    lacking = NodeView(node="node-b", missing_models=frozenset({"/models/x.gguf"}))
    assert unfit(lacking, profile, dep) == "model file not found: /models/x.gguf"
    assert unfit(NodeView(node="node-b", missing_models=frozenset({"/models/other.gguf"})), profile, dep) != (
        "model file not found: /models/x.gguf"
    )


def test_missing_model_files_are_forgotten_once_they_exist(tmp_path: Path) -> None:
    told: list[tuple[str, ...]] = []
    missing = MissingModels(told.append)
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    missing.add(b)
    missing.add(a)
    missing.add(a)
    assert missing.paths() == (a, b)
    assert told == [(b,), (a, b)]
    Path(a).write_bytes(b"gguf")
    missing.found(existing(missing.paths()))
    assert missing.paths() == (b,)
    assert told[-1] == (b,)


async def test_a_missing_model_file_fails_once_and_placement_sends_the_profile_elsewhere(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a profile whose model file was not on the node was placed there anyway and
    restarted forever, with only llama.cpp's "No such file or directory" in describe and the
    page. Now the shard fails once, for good, before any engine starts; the node says it lacks
    the file; placement refuses it for that profile in those words and places the replica on a
    node that has it; and once the file is there, the node is a candidate again."""
    model = tmp_path / "models" / "x.gguf"
    missing = f"model file not found: {model}"
    profile = {**sim_catalog(name="tiny"), "model_path": str(model)}
    replica_events: list[ReplicaStatus] = []

    async def on_replica(msg: Msg) -> None:
        replica_events.append(decoder(ReplicaStatus).decode(msg.data))

    await bus.nc.subscribe(f"{prefix}.events.replica.>", cb=on_replica)

    def ctl(*args: str) -> str:
        done = subprocess.run(
            [*CTL, "--prefix", prefix, *args], env=c.ctl_env(), capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    async def summary() -> str:
        found = await bus.history(bus.names.deployment_event("chat"), DeploymentStatus, idle_s=0.3)
        return found[-1].summary if found else ""

    with cluster(tmp_path / "cluster", nats_url, prefix) as c:
        c.start_node("node-b", gpus=1)
        c.start_placement("p1", [profile], [{"name": "chat", "profile": "tiny"}])
        async with shard_events(bus) as events:
            # Fails once on node-b, and node-b is refused for the profile from then on.
            refused = f"chat: 0 of 1 ready; 1 cannot be placed: node-b: {missing}"
            await eventually(_equals(summary, refused), timeout=90, interval=0.3)
            failed = [s for s in events.items if s.node == "node-b" and s.state == "failed"]
            assert len(failed) == 1, [(s.shard, s.state, s.reason) for s in events.items]
            [shard_failed] = failed
            assert (shard_failed.reason, shard_failed.retryable) == (missing, False)
            assert shard_failed.failure is not None
            assert shard_failed.failure.reason == missing
            # No engine process was started, and nothing restarted it.
            assert shard_failed.pids == ()
            assert shard_failed.restarts == 0
            assert "starting" not in events.states(shard_failed.shard), events.states(shard_failed.shard)
            assert any(e.state == "failed" and f"node-b: {missing}" in e.reason for e in replica_events), [
                (e.state, e.reason) for e in replica_events
            ]

            # Every surface says it: the node (ctl, the API, the page) and the deployment.
            assert _warnings(ctl("describe", "node", "node-b")) == f"Warnings:     {missing}"
            assert missing in ctl("get", "nodes")
            assert f"node-b: {missing}" in ctl("explain", "chat")
            api = await eventually(
                lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30
            )
            async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:
                [row] = (await client.get("/api/nodes")).json()
                assert row["missing_models"] == [str(model)], row
                page = (await client.get("/")).text
                assert missing in page
                explained = (await client.get("/api/explain/chat")).json()
                assert f"node-b: {missing}" in str(explained), explained

                # A node that holds it (a simulated one: it runs no engine) gets the replica.
                fleet = Fleet(bus, ["node-c"], gpus_per_node=8, heartbeat_interval_s=0.3)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(fleet.run)
                    await eventually(_equals(summary, "chat: 1 of 1 ready"), timeout=60, interval=0.3)
                    assert [s.node for s in fleet.ready.values()] == ["node-c"]
                    # node-b was not given the profile again.
                    assert len([s for s in events.items if s.node == "node-b" and s.state == "failed"]) == 1

                    # The file appears: node-b says so within a heartbeat or two, and takes the
                    # next replica (binpack: its one GPU is the tightest fit).
                    model.parent.mkdir()
                    model.write_bytes(b"gguf")

                    async def node_b_has_it() -> bool:
                        rows = (await client.get("/api/nodes")).json()
                        return any(r["node"] == "node-b" and r["missing_models"] == [] for r in rows)

                    await eventually(node_b_has_it, timeout=30, interval=0.3)
                    assert _warnings(ctl("describe", "node", "node-b")) == "Warnings:     -"
                    await bus.put(
                        bus.names.deployments_bucket,
                        "chat",
                        Deployment(name="chat", profile="tiny", replicas=2),
                    )
                    await eventually(_equals(summary, "chat: 2 of 2 ready"), timeout=90, interval=0.3)
                    assert any(s.node == "node-b" and s.state == "ready" for s in events.items)
                    tg.cancel_scope.cancel()


def _warnings(described: str) -> str:
    return next(line for line in described.splitlines() if line.startswith("Warnings:"))


def _equals(probe: Any, want: str) -> Any:
    async def check() -> bool:
        got = await probe()
        assert got == want, got
        return True

    return check


async def test_a_missing_model_file_costs_one_attempt_on_the_launcher(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """On the launcher alone: failed once, not retryable, no process, no restart; the node's
    heartbeats name the file until it is there."""
    model = tmp_path / "x.gguf"
    beats: list[tuple[str, ...]] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(decoder(Heartbeat).decode(msg.data).missing_models)

    await bus.nc.subscribe(bus.names.heartbeat("node-a", "launcher"), cb=on_beat)
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    spec = shard("node-a", "s1", sim_profile(model_path=str(model)))
    async with shard_events(bus) as events, running_launcher(config) as launcher:
        await bus.put(bus.names.shards_bucket, "node-a.s1", spec)
        await eventually(lambda: events.states("s1")[-1:] == ["failed"], timeout=20)
        await eventually(lambda: beats and beats[-1] == (str(model),), timeout=20)
        # Several rechecks later, still one attempt.
        await passes(lambda: len(beats), 4, timeout=30)
        assert events.states("s1") == ["pending", "failed"]
        last = events.last("s1")
        assert last is not None
        assert (last.reason, last.retryable, last.pids, last.restarts) == (
            f"model file not found: {model}",
            False,
            (),
            0,
        )
        model.write_bytes(b"gguf")
        await eventually(lambda: beats[-1] == (), timeout=20)
        assert launcher.missing_models.paths() == ()


# --- an OOM kill -----------------------------------------------------------------------------


def test_the_oom_counter_is_read_from_either_cgroup_version(tmp_path: Path) -> None:
    v2 = tmp_path / "unified" / "system.slice" / "llmgw.service"
    v2.mkdir(parents=True)
    (v2 / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 4\noom_kill 3\noom_group_kill 0\n")
    v1 = tmp_path / "memory" / "llmgw"
    v1.mkdir(parents=True)
    (v1 / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    mountinfo = (
        f"30 25 0:26 / {tmp_path / 'unified'} rw,nosuid - cgroup2 cgroup2 rw\n"
        f"31 25 0:27 / {tmp_path / 'memory'} rw,nosuid - cgroup cgroup rw,memory\n"
    )
    both = "4:memory:/llmgw\n0::/system.slice/llmgw.service\n"
    assert oom.counter_file(both, mountinfo) == v2 / "memory.events"
    assert oom.counter_file("4:memory:/llmgw\n0::/\n", mountinfo) == v1 / "memory.oom_control"
    assert oom.counter_file("0::/elsewhere\n", mountinfo) is None
    assert oom.oom_kills((v2 / "memory.events").read_text()) == 3
    assert oom.oom_kills((v1 / "memory.oom_control").read_text()) == 5
    # Counted at start as 3, now 4: the kernel's word.
    started = oom.MemCgroup(v2 / "memory.events", 3)
    (v2 / "memory.events").write_text("oom 5\noom_kill 4\n")
    assert oom.explain(started, 999_999, 0, kmsg=tmp_path / "no-kmsg") == (
        f"killed by the kernel's OOM killer (memory.events oom_kill 3 → 4, {v2})"
    )
    # Unchanged, and no kernel log: nothing more than the signal.
    assert oom.explain(oom.MemCgroup(v2 / "memory.events", 4), 999_999, 0, kmsg=tmp_path / "no-kmsg") == ""


def test_the_memory_cgroup_of_a_real_process_is_found() -> None:
    """The real /proc and /sys/fs/cgroup of a process this test started."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = oom.find(child.pid)
        mine = Path(f"/proc/{child.pid}/cgroup").read_text()
        if "memory" not in mine and not Path("/sys/fs/cgroup/cgroup.controllers").exists():
            assert found is None
            return
        assert found is not None, mine
        assert found.file.name in ("memory.events", "memory.oom_control")
        assert found.count == oom.oom_kills(found.file.read_text())
    finally:
        child.kill()
        child.wait()


@contextlib.contextmanager
def memory_cgroup(limit_mb: int) -> Iterator[Path]:
    """A child of this process's own memory cgroup, limited to `limit_mb` MiB without swap;
    removed afterwards. Skips where this machine does not let the test make one."""
    found = oom.find(os.getpid())
    if found is None:
        pytest.skip("no memory cgroup readable here (/proc/self/cgroup, /sys/fs/cgroup)")
    child = found.file.parent / f"llmgw-oom-{uuid.uuid4().hex[:8]}"
    limit = str(limit_mb << 20)
    try:
        child.mkdir()
        if found.kind == "memory.events":
            (child / "memory.max").write_text(limit)
            with contextlib.suppress(OSError):
                (child / "memory.swap.max").write_text("0")
        else:
            (child / "memory.limit_in_bytes").write_text(limit)
            with contextlib.suppress(OSError):
                (child / "memory.memsw.limit_in_bytes").write_text(limit)
            with contextlib.suppress(OSError):
                (child / "memory.swappiness").write_text("0")
    except OSError as exc:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot make a memory cgroup under {found.file.parent}: {exc}")
    try:
        yield child
    finally:
        # Empty once the launcher (or the cluster) that started the engines has stopped them.
        for _ in range(200):
            try:
                child.rmdir()
                break
            except OSError:
                time.sleep(0.05)


async def test_an_engine_the_oom_killer_ends_is_said_to_be(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: an engine killed for memory read only `killed by signal SIGKILL`. For real:
    the engine enters a memory cgroup of 128 MiB (as a wrapper would) and then takes 512."""
    grow = tmp_path / "grow"
    with memory_cgroup(128) as cgroup:
        profile = sim_profile(
            "--enter-cgroup", str(cgroup), "--allocate-mb", "512", "--allocate-when", str(grow)
        )
        config = agent_config(
            nats_url, prefix, tmp_path / "agent", restart_backoff_s=30.0, restart_backoff_cap_s=30.0
        )
        async with shard_events(bus) as events, running_launcher(config):
            await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", profile))
            await eventually(lambda: events.states("s1")[-1:] == ["ready"], timeout=30)
            ready = events.last("s1")
            assert ready is not None
            [pid] = ready.pids
            grow.write_text("now")
            failed = await eventually(
                lambda: (s := events.last("s1")) is not None and s.state == "failed" and s, timeout=60
            )
        assert failed.failure is not None
        assert failed.failure.exit == -signal.SIGKILL
        kind = "memory.events" if (cgroup / "memory.events").exists() else "memory.oom_control"
        words = f"sim (pid {pid}) killed by the kernel's OOM killer ({kind} oom_kill 0 → 1, {cgroup}"
        assert failed.failure.reason.startswith(words), failed.failure.reason
        assert failed.reason.startswith(words), failed.reason
        assert failed.last_failure.startswith(words), failed.last_failure


async def test_an_oom_kill_reads_the_same_on_the_replica_and_in_ctl(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """The OOM kill through placement: the replica's failure, `/api/replicas`, `/api/explain`
    and `ctl describe deployment` quote the launcher's words."""
    grow = tmp_path / "grow"
    with memory_cgroup(128) as cgroup, cluster(tmp_path / "cluster", nats_url, prefix) as c:
        args = ("--enter-cgroup", str(cgroup), "--allocate-mb", "512", "--allocate-when", str(grow))
        c.start_node("node-a", gpus=1)
        c.start_placement(
            "p1", [sim_catalog(*args, name="hungry")], [{"name": "hungry", "profile": "hungry"}]
        )
        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        words = "killed by the kernel's OOM killer ("
        async with httpx.AsyncClient(base_url=api.group(1), timeout=10, headers=c.api_headers) as client:

            async def replica() -> dict[str, Any] | None:
                found: dict[str, Any] | None = (await client.get("/api/replicas")).json().get("hungry.r0")
                return found

            await eventually(lambda: _state(replica, "ready"), timeout=60, interval=0.3)
            grow.write_text("now")

            async def oom_killed() -> dict[str, Any] | None:
                found = await replica()
                return found if found and words in (found.get("failure") or {}).get("reason", "") else None

            record = await eventually(oom_killed, timeout=60, interval=0.3)
            assert re.match(
                r"sim \(pid \d+\) killed by the kernel's OOM killer \(memory\.", record["failure"]["reason"]
            )
            assert str(cgroup) in record["failure"]["reason"], record
            assert record["failure"]["exit"] == -signal.SIGKILL
            assert words in record["last_failure"], record
            [explained] = (await client.get("/api/explain/hungry")).json()["replicas"]
            assert words in explained["last_failure"], explained
        described = subprocess.run(
            [*CTL, "--prefix", prefix, "describe", "deployment", "hungry"],
            env=c.ctl_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert described.returncode == 0, described.stderr
        assert words in described.stdout, described.stdout


async def _state(probe: Any, state: str) -> bool:
    found = await probe()
    return bool(found) and found["state"] == state
