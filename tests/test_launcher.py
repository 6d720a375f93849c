from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus, prepare_node
from llmgw_core.events import ShardStatus
from llmgw_launcher import diff
from llmgw_launcher.procs import autogroup
from tests.launcher_support import (
    agent_config,
    pid_alive,
    processes_with,
    running_launcher,
    shard,
    shard_events,
    sim_profile,
    start_launcher_process,
    two_rank_members,
)
from tests.metrics_support import families, value
from tests.test_sim_engine import free_port
from tests.waiting import eventually, passes

pytestmark = pytest.mark.anyio


def thread_nices(pid: int) -> set[int]:
    """The nice value of each thread of `pid` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    nices = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            nices.add(int((task / "stat").read_text().rsplit(")", 1)[1].split()[16]))
    return nices


def test_diff_is_sorted_and_ignores_bookkeeping() -> None:
    p = sim_profile()
    a, b, c = (shard("n", x, p) for x in ("a", "b", "c"))
    desired = {"n.c": c, "n.a": a, "n.b": msgspec.structs.replace(b, pool="other", fabric="f")}
    observed = {"n.b": b, "n.z": a, "n.y": a}
    d = diff(desired, observed)
    assert d.added == ("n.a", "n.c")
    assert d.removed == ("n.y", "n.z")
    assert d.changed == ()
    assert diff({"n.b": msgspec.structs.replace(b, port=1)}, observed).changed == ("n.b",)


async def test_a_sim_shard_goes_ready_and_answers(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent", engine_nice=5)
    spec = shard("node-a", "s1", sim_profile("--load-time", "0.5"))
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.s1", spec)
        await eventually(lambda: events.states("s1")[-1:] == ["ready"], timeout=20)
        assert events.states("s1") == ["pending", "starting", "loading", "ready"]
        ready = events.last("s1")
        assert ready is not None
        assert ready.url == f"http://127.0.0.1:{ready.port}"
        assert ready.profile_fp == spec.profile_fp
        assert ready.pool == "default"
        assert len(ready.pids) == 1
        # The engine, every thread of it, runs `engine_nice` steps below the launcher.
        assert thread_nices(ready.pids[0]) == {min(19, os.getpriority(os.PRIO_PROCESS, 0) + 5)}
        # Where the kernel shares the CPU between sessions first (autogroups), the engine's
        # session is lowered too, below the one the launcher runs in.
        mine = autogroup("self")
        if mine is not None:
            theirs = autogroup(str(ready.pids[0]))
            assert theirs is not None
            assert theirs[0] != mine[0]
            assert theirs[1] == min(19, mine[1] + 5)
        stored = await bus.get(bus.names.shard_status_bucket, "node-a.s1", ShardStatus)
        assert stored is not None
        assert stored[0].state == "ready"
        async with httpx.AsyncClient(base_url=ready.url) as client:
            r = await client.post(
                "/v1/chat/completions",
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            )
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"]

        # Deleting the key stops the whole process group within the grace period.
        [pid] = ready.pids
        started = time.monotonic()
        await bus.delete(bus.names.shards_bucket, "node-a.s1")
        await eventually(lambda: events.states("s1")[-1:] == ["stopped"], timeout=config.stop_grace_s + 2)
        assert time.monotonic() - started < config.stop_grace_s + 2
        assert not pid_alive(pid)
        assert events.states("s1")[-2:] == ["stopping", "stopped"]
        assert await bus.get(bus.names.shard_status_bucket, "node-a.s1", ShardStatus) is None


async def test_a_killed_engine_fails_with_the_signal_and_restarts_with_backoff(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", sim_profile()))
        first = await eventually(lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=20)
        os.kill(first.pids[0], signal.SIGKILL)
        failed = await eventually(lambda: [s for s in events.of("s1") if s.state == "failed"], timeout=10)
        assert failed[0].reason.startswith(
            f"sim (pid {first.pids[0]}) killed by signal SIGKILL; last log lines:\n"
        )
        assert "llmgw-sim: serving tiny on http://127.0.0.1:" in failed[0].reason
        assert failed[0].retryable
        # The same failure as fields: the signal as subprocess gives it (minus its number).
        assert failed[0].failure is not None
        assert failed[0].failure.reason == f"sim (pid {first.pids[0]}) killed by signal SIGKILL"
        assert failed[0].failure.exit == -signal.SIGKILL
        assert failed[0].failure.attempt == 1
        second = await eventually(
            lambda: (s := events.last("s1")) and s.state == "ready" and s.restarts == 1 and s, timeout=20
        )
        assert second.pids != first.pids
        fail_at = failed[0].at
        restart_at = next(s.at for s in events.of("s1") if s.restarts == 1)
        assert restart_at - fail_at >= config.restart_backoff_s * 0.9

        os.kill(second.pids[0], signal.SIGKILL)
        third = await eventually(
            lambda: (s := events.last("s1")) and s.state == "ready" and s.restarts == 2 and s, timeout=20
        )
        assert third.pids[0] not in (first.pids[0], second.pids[0])


async def test_a_profile_too_big_for_the_node_fails_once_and_starts_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    big = sim_profile(tp=4, gpu_class="H100-80G")
    async with shard_events(bus) as events, running_launcher(config) as launcher:
        await bus.put(bus.names.shards_bucket, "node-a.big", shard("node-a", "big", big, gpus=[0, 1]))
        await eventually(lambda: "failed" in events.states("big"), timeout=10)
        # A validation failure is not retried. Counted, not slept: a shard whose engine exits
        # (a retryable failure), put after the refused one failed, is restarted twice, each time
        # after a backoff no shorter than the refused shard's first retry would have waited.
        refused = sim_profile("--refuse", "not today")
        await bus.put(bus.names.shards_bucket, "node-a.exits", shard("node-a", "exits", refused))

        def restarts() -> int:
            handle = launcher.handles.get("node-a.exits")  # not there until the launcher hears of it
            return handle.runner.restarts if handle else 0

        await passes(restarts, 2, timeout=30)
        assert launcher.handles["node-a.big"].runner.restarts == 0
        assert events.states("big") == ["pending", "failed"]
        [failed] = [s for s in events.of("big") if s.state == "failed"]
        assert failed.reason == (
            "profile tiny: needs 4 GPUs per node, node has 2; "
            "shard big: given 2 GPUs, profile tiny needs 4 per node"
        )
        assert failed.retryable is False
        assert failed.pids == ()
        await bus.delete(bus.names.shards_bucket, "node-a.exits")
        await eventually(lambda: processes_with(str(tmp_path)) == [], timeout=20)


async def test_two_launchers_run_a_two_rank_shard_and_the_worker_waits_for_the_leader(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    dist = free_port()
    members = two_rank_members(dist)
    p = sim_profile("--load-time", "0.3", nodes=2, gpus_per_node=1, tp=2)
    rank0 = shard("node-a", "r0-0", p, rank=0, members=members, gpus=[0], fabric="ib-a")
    rank1 = shard("node-b", "r0-1", p, rank=1, members=members, gpus=[0], fabric="ib-a")
    a = agent_config(nats_url, prefix, tmp_path / "a", node="node-a")
    b = agent_config(nats_url, prefix, tmp_path / "b", node="node-b")
    async with shard_events(bus) as events, running_launcher(a), running_launcher(b):
        await bus.put(bus.names.shards_bucket, "node-b.r0-1", rank1)
        await eventually(lambda: events.states("r0-1")[-1:] == ["waiting"], timeout=10)
        leader_put = time.time()
        await bus.put(bus.names.shards_bucket, "node-a.r0-0", rank0)
        await eventually(lambda: events.states("r0-0")[-1:] == ["ready"], timeout=20)
        await eventually(lambda: events.states("r0-1")[-1:] == ["ready"], timeout=20)
        assert events.states("r0-1") == ["pending", "starting", "waiting", "ready"]
        worker_ready = events.last("r0-1")
        assert worker_ready is not None
        assert worker_ready.at > leader_put
        # Only rank 0 serves HTTP: the worker has no URL, and no health-check state.
        assert worker_ready.url == ""
        assert "loading" not in events.states("r0-1")
        assert events.states("r0-0") == ["pending", "starting", "loading", "ready"]


async def test_the_launcher_survives_its_own_sigkill_and_adopts_the_shard(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    config_path = tmp_path / "agent.yaml"
    config_path.write_bytes(msgspec.yaml.encode(config))
    spec = shard("node-a", "s1", sim_profile("--load-time", "0.2"))

    def start_launcher() -> subprocess.Popen[bytes]:
        return start_launcher_process(config_path, tmp_path / "launcher.log")

    first = start_launcher()
    second: subprocess.Popen[bytes] | None = None
    # The engine's pids as this test's launcher recorded them: only those are signalled at the end.
    engine_pids: list[int] = []
    try:
        async with shard_events(bus) as events:
            await bus.put(bus.names.shards_bucket, "node-a.s1", spec)
            ready = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=30
            )
            engine_pids.extend(ready.pids)
            first.kill()
            first.wait()
            assert pid_alive(ready.pids[0]), "the engine outlives a killed launcher"
            events.items.clear()
            second = start_launcher()
            adopted = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=30
            )
            assert adopted.pids == ready.pids
            assert adopted.profile_fp == spec.profile_fp
            assert events.states("s1") == ["ready"]
            assert processes_with(f"--model {spec.profile.name}", under=tmp_path) == list(ready.pids)

            # SIGTERM stops the launcher, not the engine.
            second.terminate()
            assert second.wait(timeout=10) == 0
            assert pid_alive(ready.pids[0])
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        # Regression: this cleanup once killed every process on the machine whose command line
        # named the model, a developer's own `llmgw up` included.
        for pid in engine_pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


async def test_a_shard_whose_health_fails_after_ready_is_failed_and_restarted(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(
            bus.names.shards_bucket,
            "node-a.s1",
            shard("node-a", "s1", sim_profile("--fail-health-after", "1")),
        )
        failed = await eventually(lambda: [s for s in events.of("s1") if s.state == "failed"], timeout=20)
        assert failed[0].reason.endswith("/health failed 3 health checks in a row (last: answered 503)")
        assert failed[0].reason.startswith("http://127.0.0.1:")
        await eventually(
            lambda: (s := events.last("s1")) and s.state == "ready" and s.restarts == 1, timeout=20
        )
        assert events.states("s1")[:4] == ["pending", "starting", "loading", "ready"]


async def test_a_worker_whose_leader_never_listens_fails_at_the_wait_deadline(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "b", node="node-b", wait_timeout_s=1.0)
    dist = free_port()
    p = sim_profile(nodes=2, gpus_per_node=1, tp=2)
    rank1 = shard("node-b", "r0-1", p, rank=1, members=two_rank_members(dist), gpus=[0], fabric="ib-a")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-b.r0-1", rank1)
        failed = await eventually(lambda: [s for s in events.of("r0-1") if s.state == "failed"], timeout=10)
        assert failed[0].reason == (
            f"sim-worker: waited 1s for 127.0.0.1:{dist} to accept connections; it never did"
        )
        assert failed[0].pids == ()


class SidecarEngine:
    """A designed seam: an adapter whose first command is a sidecar that dies."""

    name = "sidecar-test"
    health_path = "/health"
    metrics_path = "/metrics"

    def validate(self, profile: object, gpus: object, shard: object = None) -> list[str]:
        return []

    def serves_http(self, shard: object) -> bool:
        return True

    def commands(self, shard: object, environ: dict[str, str] | None = None) -> list[object]:
        from llmgw_core.engines import Command, Sim

        [main] = Sim().commands(shard, environ)  # type: ignore[arg-type]
        port = main.args[main.args.index("--port") + 1]
        # It gives up a second after the engine first answers (however slow a loaded machine
        # makes the engine's start), so the shard is ready first.
        script = (
            "import sys, time, urllib.request\n"
            "while True:\n"
            "    try:\n"
            f"        urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=1)\n"
            "        break\n"
            "    except OSError:\n"
            "        time.sleep(0.1)\n"
            "time.sleep(1.0)\n"
            "print('sidecar giving up')\n"
            "sys.exit(3)\n"
        )
        sidecar = Command(name="sidecar", path=sys.executable, args=("-c", script), env=main.env)
        return [sidecar, main]


async def test_a_crashing_engine_fails_with_its_exit_code_log_tail_and_attempt_as_fields(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a failure went out as one text ("…; last log lines:\n…", "attempt N; last: …")
    that placement and ctl parsed back, each by its own rule."""
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    crashing = sim_profile("--load-time", "30", "--exit-after", "0.3", "--exit-code", "42")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", crashing))

        def failed_twice() -> list[ShardStatus]:
            return [s for s in events.of("s1") if s.state == "failed"][:2]

        first, second = await eventually(lambda: len(failed_twice()) == 2 and failed_twice(), timeout=30)
        for attempt, status in ((1, first), (2, second)):
            failure = status.failure
            assert failure is not None, status
            assert failure.reason == f"sim (pid {status.pids[0]}) exited with code 42", failure
            assert failure.exit == 42
            assert failure.attempt == attempt
            assert failure.at > 0
            # The failing attempt's own lines only: the first attempt's never explain the second's.
            assert failure.log_tail[-1] == "llmgw-sim: exiting with code 42 after 0.3s", failure
            assert sum(line.startswith("llmgw-sim: serving") for line in failure.log_tail) == 1, failure
            assert not any(line.startswith("--- llmgw: attempt") for line in failure.log_tail)
            # The text form, for readers that predate the fields, as it always read.
            text = f"{failure.reason}; last log lines:\n" + "\n".join(failure.log_tail)
            assert status.reason == status.last_failure == text
            assert status.last_failure_at == failure.at
        # Between the two: the retry names its attempt and the first failure, which it carries.
        retrying = next(s for s in events.of("s1") if s.restarts == 1 and s.state == "starting")
        assert retrying.reason == f"attempt 2; last: {first.failure.reason}", retrying
        assert retrying.failure == first.failure


async def test_a_sidecar_that_dies_fails_the_shard(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    from llmgw_launcher import Launcher
    from tests.launcher_support import H100

    config = agent_config(nats_url, prefix, tmp_path / "agent")
    launcher_bus = await Bus.connect(config.nats, service=f"launcher-{config.node}")
    await prepare_node(launcher_bus)
    launcher = Launcher(config, launcher_bus, gpus=H100)
    launcher.ctx.registry.add(SidecarEngine())  # type: ignore[arg-type]
    try:
        async with shard_events(bus) as events, anyio.create_task_group() as tg:
            await tg.start(launcher.run)
            await bus.put(
                bus.names.shards_bucket,
                "node-a.s1",
                shard("node-a", "s1", sim_profile(engine="sidecar-test")),
            )
            ready = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=20
            )
            assert len(ready.pids) == 2
            failed = await eventually(lambda: [s for s in events.of("s1") if s.state == "failed"], timeout=20)
            assert failed[0].reason == (
                f"sidecar (pid {ready.pids[0]}) exited with code 3; last log lines:\nsidecar giving up"
            )
            assert failed[0].failure is not None
            assert (failed[0].failure.exit, failed[0].failure.log_tail) == (3, ("sidecar giving up",))
            assert not pid_alive(ready.pids[1]), "the whole shard goes when its sidecar does"
            tg.cancel_scope.cancel()
    finally:
        await launcher.stop_all()
        await launcher_bus.close()


async def test_a_shard_removed_while_the_launcher_was_down_is_stopped_when_it_returns(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    config_path = tmp_path / "agent.yaml"
    config_path.write_bytes(msgspec.yaml.encode(config))
    spec = shard("node-a", "orphan", sim_profile())

    def start_launcher() -> subprocess.Popen[bytes]:
        return start_launcher_process(config_path, tmp_path / "launcher.log")

    procs = [start_launcher()]
    try:
        async with shard_events(bus) as events:
            await bus.put(bus.names.shards_bucket, "node-a.orphan", spec)
            ready = await eventually(
                lambda: (s := events.last("orphan")) and s.state == "ready" and s, timeout=30
            )
            procs[0].kill()
            procs[0].wait()
            # The node was declared lost: placement took its shards away.
            await bus.delete(bus.names.shards_bucket, "node-a.orphan")
            assert pid_alive(ready.pids[0])
            procs.append(start_launcher())
            await eventually(lambda: events.states("orphan")[-1:] == ["stopped"], timeout=30)
            assert not pid_alive(ready.pids[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=10)


async def test_the_launcher_serves_prometheus_metrics(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    port = free_port()
    config = agent_config(nats_url, prefix, tmp_path / "agent", launcher_metrics_port=port)
    async with shard_events(bus) as events, running_launcher(config), httpx.AsyncClient() as client:

        async def scrape() -> str:
            return (await client.get(f"http://127.0.0.1:{port}/metrics")).text

        await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", sim_profile()))
        first = await eventually(lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=20)
        text = await scrape()
        assert value(text, "llmgw_launcher_shards", state="ready") == 1
        assert value(text, "llmgw_launcher_shards", state="failed") == 0
        assert families(text)["llmgw_launcher_restarts"] == "counter"
        assert value(text, "llmgw_launcher_restarts_total") == 0
        assert value(text, "llmgw_build_info", service="launcher") == 1
        # A restart counts, and still counts once its shard is gone: a counter, not a gauge of
        # the shards now on the node (which fell whenever a shard that had restarted went).
        os.kill(first.pids[0], signal.SIGKILL)
        await eventually(
            lambda: (s := events.last("s1")) and s.state == "ready" and s.restarts == 1, timeout=20
        )
        assert value(await scrape(), "llmgw_launcher_restarts_total") == 1
        await bus.delete(bus.names.shards_bucket, "node-a.s1")
        await eventually(lambda: events.states("s1")[-1:] == ["stopped"], timeout=20)
        text = await scrape()
        assert value(text, "llmgw_launcher_restarts_total") == 1
        assert value(text, "llmgw_launcher_shards", state="ready") == 0


async def test_ports_go_round_the_range_and_skip_ports_in_use(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Each port handed out is free and not handed out already: one that another process
    listens on is skipped, and a port just released is not handed out again while the range
    has others."""
    low = free_port()
    config = agent_config(nats_url, prefix, tmp_path / "agent", port_range=[low, low + 6])
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", low + 3))
        blocker.listen()
        async with running_launcher(config) as launcher:
            got = [launcher.ports.allocate() for _ in range(4)]
            assert len(set(got)) == 4
            assert all(low <= p <= low + 6 for p in got)
            assert low + 3 not in got
            launcher.ports.in_use.discard(got[0])
            assert launcher.ports.allocate() != got[0]


def _time_wait_on(port: int) -> None:
    """Leave a connection of a server on `port` in TIME_WAIT: the server closes first (the
    side that closes first waits), then the client, then the listener."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen()
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()
        assert client.recv(1) == b""  # the server's FIN has arrived
        client.close()


async def test_a_port_whose_connections_are_in_time_wait_is_free(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: the free-port check bound without SO_REUSEADDR, so during churn every port
    an engine had just served on counted as busy (`no free port in …`), though an engine's
    server binds it at once."""
    port = free_port()
    _time_wait_on(port)
    with socket.socket() as plain, pytest.raises(OSError, match="Address already in use") as busy:
        plain.bind(("127.0.0.1", port))  # what the check did: TIME_WAIT made the port look taken
    assert busy.value.errno == errno.EADDRINUSE
    config = agent_config(nats_url, prefix, tmp_path / "agent", port_range=[port, port])
    async with running_launcher(config) as launcher:
        assert launcher.ports.allocate() == port
