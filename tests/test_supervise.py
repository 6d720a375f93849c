"""`llmgw up`'s supervision: the restart policy, and the engines it stops when their launcher is gone.

The cluster-level tests (a real `llmgw up` whose nats-server, launcher or
gateway dies) are in tests/test_up.py; here are the parts that need no cluster:
real processes the test starts, real record files.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw.supervise import RestartPolicy, how_it_ended, stop_recorded_engines
from llmgw_launcher import procs
from llmgw_launcher.records import ProcRecord, Records, ShardRecord
from tests.launcher_support import pid_alive, shard, sim_profile
from tests.waiting import eventually

pytestmark = pytest.mark.anyio


def test_restart_policy_backs_off_caps_and_gives_up_on_quick_exits_in_a_row() -> None:
    policy = RestartPolicy(backoff_s=0.5, backoff_cap_s=4.0, settled_s=30.0, give_up_after=5)
    quick, delays = 0, []
    for _ in range(4):
        quick, delay = policy.after_exit(quick, ran_s=1.0)
        delays.append(delay)
    assert (quick, delays) == (4, [1.0, 2.0, 4.0, 4.0])
    # The fifth exit in a row soon after a start: restarting is not going to help.
    assert policy.after_exit(quick, ran_s=1.0) == (5, None)
    # One that ran long enough had started fine: the count and the backoff start again.
    assert policy.after_exit(quick, ran_s=31.0) == (0, 0.5)


def test_how_a_child_ended_is_said_in_words() -> None:
    assert how_it_ended(2) == "exited with code 2"
    assert how_it_ended(-signal.SIGKILL) == "was killed by signal SIGKILL"


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes this test starts, each leading its own session; whatever is left is killed."""
    children: list[subprocess.Popen[bytes]] = []
    yield children
    for child in children:
        # Its group too once it is gone: a worker it started may live on in it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


def _start(children: list[subprocess.Popen[bytes]], *argv: str) -> subprocess.Popen[bytes]:
    child = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
    children.append(child)
    return child


def _record(state: Path, key: str, *members: tuple[str, int, int]) -> Path:
    records = Records(state)
    spec = shard("local-1", key.split(".", 1)[1], sim_profile())
    records.save(
        ShardRecord(
            key=key,
            spec=spec,
            port=28000,
            procs=tuple(ProcRecord(name=n, pid=p, start_time=t, log="") for n, p, t in members),
        )
    )
    return records.path(key)


async def test_engines_a_dead_launcher_left_are_stopped_and_a_recycled_pid_is_never_signalled(
    tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    state = tmp_path / "agent"
    engine = _start(started, sys.executable, "-c", "import time; time.sleep(300)")
    engine_started = await eventually(lambda: procs.start_time(engine.pid), timeout=10)
    # A group whose leader exited and whose worker lives on (a tensor-parallel engine's ranks).
    leader = _start(
        started,
        sys.executable,
        "-c",
        "import subprocess, time; print(subprocess.Popen(['sleep', '300']).pid, flush=True); time.sleep(300)",
    )
    leader_started = await eventually(lambda: procs.start_time(leader.pid), timeout=10)
    # A process that got a recorded pid after its engine was gone: same pid, another start time.
    stranger = _start(started, "sleep", "300")
    stranger_started = await eventually(lambda: procs.start_time(stranger.pid), timeout=10)

    ours = _record(state, "local-1.a", ("sim", engine.pid, engine_started))
    _record(state, "local-1.b", ("leader", leader.pid, leader_started))
    theirs = _record(state, "local-1.c", ("sim", stranger.pid, stranger_started + 1))
    (state / "shards" / "local-1.d.json").write_text("{not json")
    # The leader goes; its worker stays in its process group.
    assert leader.stdout is not None
    worker = int(leader.stdout.readline())
    assert os.getpgid(worker) == leader.pid
    leader.kill()
    leader.wait()
    assert pid_alive(worker)

    said: list[str] = []
    stop_recorded_engines([state, tmp_path / "never-started"], grace_s=5.0, say=said.append)

    assert engine.wait(timeout=10) == -signal.SIGTERM
    await eventually(lambda: not pid_alive(worker), timeout=10)
    assert stranger.poll() is None, "a pid whose start time differs from the record is not the engine"
    assert said == [
        f"{state / 'shards' / 'local-1.d.json'}: unreadable shard record (JSON is malformed: "
        "object keys must be strings (byte 1)); ignored",
        "stopping 2 engine process groups left running without a launcher: "
        f"local-1/a's sim (pid {engine.pid}), local-1/b's leader (pid {leader.pid})",
    ]
    # Nothing is left for the next `up`'s launcher to adopt.
    assert not ours.exists()
    assert not theirs.exists()


_ORPHANING = """
import subprocess, sys
from llmgw.supervise import become_subreaper, orphans, stop_orphans

assert become_subreaper()
# A child that starts a process in a session of its own (as a launcher starts an engine) and dies.
engine = (
    "import subprocess; print(subprocess.Popen(['sleep', '120'], start_new_session=True, "
    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"
)
orphan = int(subprocess.run([sys.executable, "-c", engine], stdout=subprocess.PIPE, check=True).stdout)
print(orphan, [g.pid for g in orphans(set())], flush=True)
stop_orphans(set(), grace_s=5.0)
print(orphans(set()), flush=True)
"""


async def test_up_as_subreaper_stops_a_process_whose_parent_died_before_it(tmp_path: Path) -> None:
    """An engine orphaned before its launcher recorded it is reparented to `up`, which stops it."""
    done = subprocess.run(
        [sys.executable, "-c", _ORPHANING], capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert done.returncode == 0, done.stderr
    first, said, last = done.stdout.splitlines()
    orphan, found = first.split(" ", 1)
    assert found == f"[{orphan}]"
    assert said == f"llmgw: stopping 1 process whose parent exited before it: pids {orphan}"
    assert last == "[]"
    assert not pid_alive(int(orphan))
