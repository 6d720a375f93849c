"""The launcher with many shards: one prober, records written off the loop, statuses in batches."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.engines import Command
from llmgw_core.events import ShardStatus, decoder
from llmgw_launcher import procs
from llmgw_launcher.health import HealthProber, parse_head
from llmgw_launcher.records import Records, RecordWriter, ShardRecord
from llmgw_launcher.runner import next_tick
from llmgw_launcher.service import ephemeral_overlap
from llmgw_launcher.workers import Workers
from tests.launcher_support import (
    agent_config,
    pid_alive,
    running_launcher,
    shard,
    shard_events,
    sim_profile,
    start_launcher_process,
)
from tests.test_sim_engine import free_port
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

ORDER = ["pending", "starting", "waiting", "loading", "ready", "failed", "stopping", "stopped"]


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


# --- the prober on its own, against real servers on loopback ----------------------------


def test_a_health_answer_is_read_by_its_length_and_kept_only_when_it_can_be() -> None:
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 16\r\nConnection: keep-alive") == (200, 16, True)
    assert parse_head(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2") == (503, 2, True)
    # No length to read by: the status counts, the connection is not reused.
    assert parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked") == (200, None, False)
    assert parse_head(b"HTTP/1.1 200 OK") == (200, None, True)
    assert parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close") == (200, 2, False)
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2") == (200, 2, False)
    assert parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\nConnection: Keep-Alive") == (200, 2, True)
    assert parse_head(b"SSH-2.0-OpenSSH_9.6") == (None, None, False)
    assert parse_head(b"HTTP/1.1 OK") == (None, None, False)


@pytest.fixture
def sim_engine() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_core.sim", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    yield proc, port
    proc.kill()
    proc.wait()


async def test_the_prober_keeps_one_connection_for_many_probes(
    sim_engine: tuple[subprocess.Popen[bytes], int],
) -> None:
    _, port = sim_engine
    prober = HealthProber(timeout_s=2.0)
    url = f"http://127.0.0.1:{port}/health"
    try:
        await eventually(lambda: prober.healthy(url), timeout=20)
        opened = prober.connections_opened
        for _ in range(20):
            assert await prober.healthy(url)
        assert prober.connections_opened == opened, "every probe reused the kept connection"
        # A 404 is an answer, and not healthy; the connection is still kept.
        assert not await prober.healthy(f"http://127.0.0.1:{port}/nowhere")
        assert prober.connections_opened == opened
    finally:
        await prober.aclose()


async def test_a_restarted_engine_on_the_same_port_is_probed_afresh_not_failed(tmp_path: Path) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "llmgw_core.sim", "--port", str(port)]
    prober = HealthProber(timeout_s=2.0)
    url = f"http://127.0.0.1:{port}/health"
    first = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second: subprocess.Popen[bytes] | None = None
    try:
        await eventually(lambda: prober.healthy(url), timeout=20)
        first.kill()
        first.wait()
        # The kept connection now leads nowhere.
        assert not await prober.healthy(url)
        second = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await eventually(lambda: prober.healthy(url), timeout=20)
        failures = prober.failures
        assert await prober.healthy(url)
        assert prober.failures == failures
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
        await prober.aclose()


async def test_a_listener_that_never_answers_fails_the_probe_at_its_timeout() -> None:
    # vLLM binds its port before the model is loaded: accepted, never answered.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        prober = HealthProber(timeout_s=0.3)
        try:
            with anyio.fail_after(5):
                assert not await prober.healthy(f"http://127.0.0.1:{port}/health")
        finally:
            await prober.aclose()
    assert not await HealthProber(timeout_s=0.3).healthy(f"http://127.0.0.1:{port}/health"), "refused"


# --- record writes ------------------------------------------------------------------


def record(key: str, restarts: int) -> ShardRecord:
    return ShardRecord(key=key, spec=shard("node-a", key, sim_profile()), port=20000, restarts=restarts)


async def test_record_writes_of_one_shard_are_coalesced_and_the_newest_wins(tmp_path: Path) -> None:
    records = Records(tmp_path)
    writer = RecordWriter(records)
    async with anyio.create_task_group() as tg:
        for i in range(30):
            tg.start_soon(writer.save, record("s1", i))
            tg.start_soon(writer.save, record("s2", i))
    loaded, problems = records.load_all()
    assert problems == []
    assert loaded["s1"].restarts == 29
    assert loaded["s2"].restarts == 29
    assert writer.writes < 60, "saves that waited together were written once"
    assert writer.batches < 30


async def test_a_failed_record_write_fails_its_own_shard_only(tmp_path: Path) -> None:
    records = Records(tmp_path)
    writer = RecordWriter(records)
    # Where the temporary file goes there is a directory: the write fails.
    (records.dir / "bad.tmp").mkdir()
    errors: dict[str, str] = {}

    async def save(key: str) -> None:
        try:
            await writer.save(record(key, 1))
        except Exception as exc:
            errors[key] = str(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(save, "bad")
        tg.start_soon(save, "good")
    assert set(errors) == {"bad"}
    assert errors["bad"].startswith(f"cannot write the shard record {records.dir / 'bad.json'}: [Errno 21]")
    assert set(records.load_all()[0]) == {"good"}


# --- the launcher -----------------------------------------------------------------------


async def test_one_prober_serves_many_shards_and_keeps_its_connections(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    n = 8
    port = free_port()
    config = agent_config(nats_url, prefix, tmp_path / "agent", launcher_metrics_port=port)
    async with shard_events(bus) as events, running_launcher(config) as launcher:
        for i in range(n):
            await bus.put(bus.names.shards_bucket, f"node-a.s{i}", shard("node-a", f"s{i}", sim_profile()))
        await eventually(lambda: all(events.states(f"s{i}")[-1:] == ["ready"] for i in range(n)), timeout=60)
        assert all(r.runner.ctx.prober is launcher.prober for r in launcher.handles.values())

        def restarts() -> int:
            return sum(h.runner.restarts for h in launcher.handles.values())

        async def scrape() -> str:
            async with httpx.AsyncClient() as client:
                return (await client.get(f"http://127.0.0.1:{port}/metrics")).text

        # On a shared machine an engine may die of other causes: each restart may
        # bring a new connection (two, at most, while it loads), nothing else may.
        text = await scrape()
        opened = metric(text, "llmgw_launcher_health_connections_opened_total")
        probes = metric(text, "llmgw_launcher_health_probes_total")
        assert opened <= 2 * (n + restarts()), f"{opened} connections for {n} engines"
        before = restarts()
        # Five more health intervals: every shard probed again, on the connections already open.
        await eventually(lambda: launcher.prober.probes >= probes + 5 * n, timeout=30)
        text = await scrape()
        new_connections = metric(text, "llmgw_launcher_health_connections_opened_total") - opened
        assert new_connections <= 2 * (restarts() - before), f"{new_connections} new connections"

        # An engine killed and restarted: it gets a new connection, the others keep theirs.
        victim = events.last("s0")
        assert victim is not None
        os.kill(victim.pids[0], signal.SIGKILL)
        await eventually(
            lambda: (s := events.last("s0")) is not None and s.state == "ready" and s.restarts >= 1,
            timeout=30,
        )

        before = (launcher.prober.probes, launcher.prober.connections_opened, restarts())
        await eventually(lambda: launcher.prober.probes >= before[0] + 3 * n, timeout=30)
        new_connections = launcher.prober.connections_opened - before[1]
        assert new_connections <= 2 * (restarts() - before[2]), f"{new_connections} new connections"
        await eventually(lambda: all(events.states(f"s{i}")[-1:] == ["ready"] for i in range(n)), timeout=30)


async def test_a_burst_reports_every_transition_in_order_with_the_bucket_written_first(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    n = 10
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    seen: list[tuple[str, str, str]] = []  # (shard, event state, bucket state when the event arrived)

    async def on_event(msg: Msg) -> None:
        status = decoder(ShardStatus).decode(msg.data)
        stored = await bus.get(bus.names.shard_status_bucket, f"node-a.{status.shard}", ShardStatus)
        seen.append((status.shard, status.state, stored[0].state if stored else "stopped"))

    sub = await bus.nc.subscribe(f"{bus.names.prefix}.events.shard.>", cb=on_event)
    try:
        async with running_launcher(config) as launcher:
            specs = [shard("node-a", f"b{i}", sim_profile()) for i in range(n)]
            async with anyio.create_task_group() as tg:
                for spec in specs:
                    tg.start_soon(bus.put, bus.names.shards_bucket, f"node-a.{spec.shard}", spec)

            def states(name: str) -> list[str]:
                return [state for s, state, _ in seen if s == name]

            await eventually(lambda: all(states(f"b{i}")[-1:] == ["ready"] for i in range(n)), timeout=60)
            for i in range(n):
                assert states(f"b{i}") == ["pending", "starting", "loading", "ready"]
            for name, state, stored in seen:
                assert ORDER.index(stored) >= ORDER.index(state), f"{name}: event {state}, bucket {stored}"
            # Shards that changed together went out together.
            assert launcher.outbox.batches < launcher.outbox.sent
    finally:
        await sub.unsubscribe()


async def test_a_record_write_that_fails_costs_one_attempt_not_the_launcher(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    state = tmp_path / "agent"
    config = agent_config(nats_url, prefix, state)
    blocker = state / "shards" / "node-a.bad.tmp"
    blocker.mkdir(parents=True)
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.bad", shard("node-a", "bad", sim_profile()))
        await bus.put(bus.names.shards_bucket, "node-a.good", shard("node-a", "good", sim_profile()))
        failed = await eventually(lambda: [s for s in events.of("bad") if s.state == "failed"], timeout=30)
        assert failed[0].reason.startswith(
            f"cannot write the shard record {(state / 'shards' / 'node-a.bad.json').resolve()}: [Errno 21]"
        )
        assert failed[0].reason.endswith("a restarted launcher could not adopt this shard, so it is stopped")
        assert failed[0].retryable
        # The engine it could not record was stopped, not left behind.
        assert failed[0].pids
        assert not pid_alive(failed[0].pids[0])
        await eventually(lambda: events.states("good")[-1:] == ["ready"], timeout=30)

        blocker.rmdir()
        await eventually(
            lambda: (s := events.last("bad")) is not None and s.state == "ready" and s.restarts >= 1,
            timeout=30,
        )
        await eventually(lambda: events.states("good")[-1:] == ["ready"], timeout=30)
        stored = msgspec.json.decode((state / "shards" / "node-a.bad.json").read_bytes())
        assert stored["ready"] is True


async def test_an_adopted_engine_that_dies_is_noticed_at_once_and_restarted(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # Not the launcher's child: its exit comes through a pidfd, not waitpid.
    config = agent_config(nats_url, prefix, tmp_path / "agent", health_interval_s=5.0)
    config_path = tmp_path / "agent.yaml"
    config_path.write_bytes(msgspec.yaml.encode(config))
    procs = [start_launcher_process(config_path, tmp_path / "launcher.log")]
    try:
        async with shard_events(bus) as events:
            await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", sim_profile()))
            ready = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=30
            )
            procs[0].kill()
            procs[0].wait()
            events.items.clear()
            procs.append(start_launcher_process(config_path, tmp_path / "launcher.log"))
            adopted = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s, timeout=30
            )
            assert adopted.pids == ready.pids
            os.kill(ready.pids[0], signal.SIGKILL)
            killed = anyio.current_time()
            failed = await eventually(lambda: [s for s in events.of("s1") if s.state == "failed"], timeout=10)
            # Well inside one health interval: the exit, not a failed probe, told it.
            assert anyio.current_time() - killed < config.health_interval_s
            assert failed[0].reason.startswith(
                f"sim (pid {ready.pids[0]}) exited; an earlier launcher started it, so its exit status is "
                "unknown; last log lines:\n"
            )
            # Adopted: its exit status went to whoever reaped it, so the fields carry none.
            assert failed[0].failure is not None
            assert failed[0].failure.exit is None, failed[0].failure
            again = await eventually(
                lambda: (s := events.last("s1")) and s.state == "ready" and s.restarts == 1 and s, timeout=30
            )
            assert again.pids != ready.pids
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=15)
        # The launcher leaves its engines running when it stops: the pids it recorded for them.
        records, _ = Records(config.state_path).load_all()
        for pid in {p.pid for r in records.values() for p in r.procs}:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture(params=["posix_spawn", "subprocess"])
def spawn_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways the launcher starts a process: libc's posix_spawn, and subprocess where libc
    lacks what posix_spawn needs."""
    monkeypatch.setattr(procs, "USE_POSIX_SPAWN", request.param == "posix_spawn")
    return request.param


def test_an_engine_is_started_alone_in_its_session_with_only_what_it_is_given(
    tmp_path: Path, spawn_path: str
) -> None:
    log = tmp_path / "logs" / "0-eng.log"
    env = (("X", "given"), ("PATH", os.defpath))

    def run(path: str, *args: str, attempt: int = 0) -> int | None:
        child, _ = procs.spawn(
            Command(name="eng", path=path, args=args, env=env), log, tmp_path / "run", attempt
        )
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
        return child.poll()

    script = (
        "echo cwd=$(pwd) x=$X home=${HOME:-unset} sid=$(cut -d' ' -f6 /proc/$$/stat) pid=$$;"
        "read l || echo stdin=empty; exit 3"
    )
    assert run("sh", "-c", script, attempt=2) == 3
    # A descriptor the launcher holds, inheritable: the engine must not get it.
    opened = os.open(os.devnull, os.O_RDONLY)
    leak = os.dup2(opened, 50, inheritable=True)
    os.close(opened)
    try:
        assert run("ls", "/proc/self/fd") == 0
    finally:
        os.close(leak)
    assert run("grep", "-E", "^Sig(Ign|Blk)", "/proc/self/status") == 0

    lines = log.read_text().splitlines()
    assert lines[0].startswith(f"{procs.ATTEMPT_MARK}2 started ")
    cwd, x, home, sid, pid = (field.partition("=")[2] for field in lines[1].split())
    assert (cwd, x, home, sid) == (str(tmp_path / "run"), "given", "unset", pid)
    assert lines[2] == "stdin=empty"
    # stdin, stdout, stderr and the directory `ls` reads: not fd 50, nothing else.
    assert lines[3:7] == ["0", "1", "2", "3"], lines[3:]
    sig_blocked = int(lines[7].split()[1], 16)
    sig_ignored = int(lines[8].split()[1], 16)
    assert sig_blocked == 0
    # Python ignores SIGPIPE and SIGXFSZ; the engine gets them back at their defaults.
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        assert not sig_ignored & (1 << (sig - 1)), f"{sig.name} ignored in the engine ({spawn_path})"


def test_a_spawned_engine_reports_how_it_ended_and_a_missing_program_says_so(
    tmp_path: Path, spawn_path: str
) -> None:
    log = tmp_path / "eng.log"
    child, _ = procs.spawn(
        Command(name="eng", path="sleep", args=("30",), env=(("PATH", os.defpath),)), log, tmp_path
    )
    assert child.poll() is None
    assert not child.ended
    os.kill(child.pid, signal.SIGKILL)
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # ended, not yet reaped
    assert child.poll() == -signal.SIGKILL
    assert child.ended
    assert procs.start_time(child.pid) is None  # reaped: no zombie left behind
    for path, env in (("/nonexistent/engine", ()), ("no-such-engine", (("PATH", os.defpath),))):
        with pytest.raises(FileNotFoundError) as raised:
            procs.spawn(Command(name="eng", path=path, args=(), env=env), log, tmp_path)
        assert raised.value.filename == path


def test_an_engine_runs_below_the_launcher_in_its_own_session_too(tmp_path: Path, spawn_path: str) -> None:
    """Where the kernel shares the CPU between sessions before threads (autogroups), a nice
    value alone would leave each engine weighing as much as the whole launcher."""
    mine = procs.autogroup("self")
    if mine is None:
        pytest.skip("this kernel schedules without autogroups: a process's nice value is all there is")
    before = os.getpriority(os.PRIO_PROCESS, 0)
    child, _ = procs.spawn(
        Command(name="eng", path="sleep", args=("30",), env=(("PATH", os.defpath),)),
        tmp_path / "eng.log",
        tmp_path,
        nice=3,
    )
    try:
        theirs = procs.autogroup(str(child.pid))
        assert theirs is not None
        assert theirs[0] != mine[0]
        assert theirs[1] == min(19, mine[1] + 3)
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == min(19, before + 3)
        # The launcher's own session and priority are left as they were.
        assert procs.autogroup("self") == mine
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
    finally:
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        child.poll()


def test_ready_shards_probe_on_one_node_wide_beat() -> None:
    # Shards that went ready at different moments probe at the same instants: a
    # hundred answers come back in a few turns of the loop, not a hundred wakes.
    ticks = {next_tick(at, 1.0) for at in (100.02, 100.5, 100.99)}
    assert ticks == {101.0}
    assert next_tick(101.0, 1.0) == 102.0  # strictly later: a beat is not probed twice
    assert next_tick(7.3, 0.25) == 7.5
    # A probe that overran several beats resumes at the next one, without a catch-up burst.
    assert next_tick(max(101.0, 103.4), 1.0) == 104.0


def test_a_port_range_among_the_kernels_ephemeral_ports_is_called_out(tmp_path: Path) -> None:
    source = tmp_path / "ip_local_port_range"
    source.write_text("32768\t60999\n")
    warning = ephemeral_overlap((41000, 41999), source)
    assert warning is not None
    assert "port_range 41000-41999" in warning
    assert "32768-60999" in warning
    assert "net.ipv4.ip_local_port_range" in warning
    assert ephemeral_overlap((32000, 32768), source) is not None
    assert ephemeral_overlap((20000, 29999), source) is None
    assert ephemeral_overlap((61000, 61999), source) is None
    assert ephemeral_overlap((41000, 41999), tmp_path / "missing") is None


async def test_spawn_jobs_run_in_their_threads_and_each_caller_gets_its_own_outcome() -> None:
    workers = Workers(spawn_threads=2)
    running, most = 0, 0
    lock = threading.Lock()

    def job(i: int) -> tuple[int, str]:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with lock:
            running -= 1
        if i == 3:
            raise OSError(errno.ENOENT, "no such program", f"engine-{i}")
        return i, threading.current_thread().name

    outcomes: dict[int, object] = {}

    async def ask(i: int) -> None:
        try:
            outcomes[i] = await workers.spawn(lambda: job(i))
        except OSError as exc:
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(6):
            tg.start_soon(ask, i)
    assert most == 2  # side by side, never more than its threads
    for i in (0, 1, 2, 4, 5):
        assert outcomes[i] == (i, "llmgw-spawn")
    assert isinstance(outcomes[3], OSError)
    assert outcomes[3].filename == "engine-3"

    # A caller cancelled while its spawn runs still waits for it: the process must have an owner.
    done: list[int] = []
    with anyio.move_on_after(0.01):
        done.append((await workers.spawn(lambda: job(7)))[0])
    assert done == [7]
