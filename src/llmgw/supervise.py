"""What `llmgw up` started, kept running, and stopped for good when `up` stops.

`Supervisor` owns `up`'s children (nats-server, placement, each node's
installer and launcher, the gateway). A child that exits is said at once
(which, its exit code or signal, how long it ran, its last log lines) and
started again with the same command line, after a capped backoff; NATS on the
same port and store, so the cluster resumes where it was. `up` gives up,
naming the child, when restarting cannot help: a port the child needs is held
by another process, or it exited `give_up_after` times in a row soon after
starting. Stopping `up` stops the children in the reverse of their start
order.

A launcher leaves its engines running when it stops (a successor adopts them
from its shard records), and one that crashed or was killed cannot stop them.
So once the children are stopped `up` stops every engine process group the
launchers recorded under their state dirs and that still runs (pid and start
time both matching: a recycled pid is never signalled), then any process that
is still its own child: `up` is a child subreaper, so an engine orphaned
before its record was written is reparented to `up` rather than to init.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from llmgw_core.errors import ConfigError
from llmgw_core.failures import how_it_ended
from llmgw_core.natsd import NatsServer
from llmgw_core.retry import Backoff
from llmgw_launcher import procs
from llmgw_launcher.records import Records

LOG_LINES = 15
# After SIGTERM, what an engine gets to stop before SIGKILL: the launcher's own default grace.
ENGINE_GRACE_S = 10.0
PR_SET_CHILD_SUBREAPER = 36

Say = Callable[[str], None]


def say(line: str) -> None:
    print(f"llmgw: {line}", flush=True)


# --- decisions ----------------------------------------------------------------------


@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 0.5
    backoff_cap_s: float = 10.0
    # A child that ran this long before it exited had started fine: its count of quick exits
    # starts again, and so does its backoff.
    settled_s: float = 30.0
    # Quick exits in a row after which restarting is not going to help.
    give_up_after: int = 5

    def after_exit(self, quick_exits: int, ran_s: float) -> tuple[int, float | None]:
        """The count of quick exits in a row after this exit, and how long to wait before the
        restart (None: give up)."""
        quick = quick_exits + 1 if ran_s < self.settled_s else 0
        if quick >= self.give_up_after:
            return quick, None
        # llmgw's backoff, at its ceiling and not jittered: these children share one machine and
        # no server that a restart in step would flood, and the operator is promised (and shown)
        # a longer wait at each quick exit.
        return quick, Backoff(self.backoff_s, self.backoff_cap_s).ceiling(quick)


def port_in_use(port: int) -> str | None:
    """Why `port` cannot be bound on 127.0.0.1 now (None: it can). SO_REUSEADDR: a port whose
    last connections are in TIME_WAIT is free for a listener."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


# --- children -----------------------------------------------------------------------


@dataclass
class Child:
    """One process `up` runs: a command line with its output in `log`, or the nats-server."""

    name: str
    log: Path
    argv: list[str] = field(default_factory=list)
    # What needs each port, e.g. "placement's API, --api-port": a port taken by another process
    # while the child is down means restarting it cannot help.
    ports: dict[str, int] = field(default_factory=dict)
    # nats-server: started and stopped through NatsServer, which waits for it to be ready.
    server: NatsServer | None = None
    proc: subprocess.Popen[Any] | None = None
    pid: int = 0
    started_at: float = 0.0
    quick_exits: int = 0
    # Why the last start failed before there was a process to wait for ("" when it started).
    start_error: str = ""

    def start(self) -> None:
        """Blocking. A failure is kept in `start_error` (the supervisor handles it as an exit)."""
        self.start_error = ""
        self.started_at = time.monotonic()
        try:
            if self.server is not None:
                self.server.start()
                self.proc = self.server.proc
            else:
                with self.log.open("ab") as log:
                    # Its own session: Ctrl-C reaches `llmgw up` alone, which then stops
                    # the children in order (agents before placement before NATS), once each.
                    self.proc = subprocess.Popen(
                        self.argv,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
        except (OSError, ConfigError) as exc:
            self.proc = None
            self.start_error = str(exc)
            return
        assert self.proc is not None
        self.pid = self.proc.pid

    def stop(self, timeout: float) -> int | None:
        """Blocking: SIGTERM, SIGKILL after `timeout`; its exit code (None if it was not running)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                say(f"{self.name} did not stop in {timeout:g}s; killing it")
                proc.kill()
                proc.wait()
        if self.server is not None:
            self.server.stop()
        return proc.returncode

    def describe_ports(self) -> str:
        if self.server is not None:
            return f" (same port {self.server.port}, same store {self.server.store_dir})"
        return ""


async def _exit_code(proc: subprocess.Popen[Any]) -> int:
    """Wait for `proc` to exit: a pidfd turning readable (it is our unreaped child, so the pid
    cannot name anyone else), or polling where there is none."""
    fd: int | None = None
    opener = getattr(os, "pidfd_open", None)
    if opener is not None:
        with contextlib.suppress(OSError):
            fd = int(opener(proc.pid))
    if fd is not None:
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)
    # With a pidfd only a kernel that signals a moment before waitpid sees the exit loops here.
    while (code := proc.poll()) is None:
        await anyio.sleep(0.01 if fd is not None else 0.2)
    return code


class GaveUp(Exception):
    """`up` gave up on a child; the message names it and why."""


class Supervisor:
    """Keeps `up`'s children running in `tg`; on giving up, `failure` says why and `tg` is cancelled."""

    def __init__(self, tg: anyio.abc.TaskGroup, policy: RestartPolicy | None = None, say: Say = say) -> None:
        self.tg = tg
        self.policy = policy or RestartPolicy()
        self.say = say
        self.children: list[Child] = []
        self.failure = ""

    async def start(self, child: Child) -> None:
        """Start `child` and keep it running from now on."""
        self.children.append(child)
        await anyio.to_thread.run_sync(child.start)
        self.watch(child)

    def watch(self, child: Child) -> None:
        """Keep `child`, started already, running from now on."""
        if not any(c is child for c in self.children):
            self.children.append(child)
        self.tg.start_soon(self._keep, child, name=f"supervise {child.name}")

    async def _keep(self, child: Child) -> None:
        while True:
            if child.proc is not None:
                code = await _exit_code(child.proc)
                how = how_it_ended(code)
                what = f"{child.name} (pid {child.pid}) {how}"
                # Stopping a nats-server joins the thread that copies its output to the log.
                await anyio.to_thread.run_sync(child.stop, 0)
            else:
                # Its first line: a nats-server's own words that follow are in its log's tail.
                how = f"did not start: {child.start_error.splitlines()[0] if child.start_error else '?'}"
                what = f"{child.name} {how}"
            ran = time.monotonic() - child.started_at
            lines = await anyio.to_thread.run_sync(procs.tail, child.log, LOG_LINES)
            tail = "".join(f"\n    {line}" for line in lines)
            self.say(f"{what} after {ran:.1f}s; the last lines of {child.log}:{tail}")
            for needs, port in child.ports.items():
                if port and (why := await anyio.to_thread.run_sync(port_in_use, port)):
                    self._give_up(
                        f"{child.name} {how} and cannot be restarted: port {port} ({needs}) is held by "
                        f"another process ({why}); stop what holds it, then run `llmgw up` again"
                    )
                    return
            child.quick_exits, delay = self.policy.after_exit(child.quick_exits, ran)
            if delay is None:
                self._give_up(
                    f"{child.name} exited {child.quick_exits} times in a row within "
                    f"{self.policy.settled_s:g}s of starting (last: {how}); see {child.log}"
                )
                return
            self.say(f"restarting {child.name} in {delay:g}s{child.describe_ports()}")
            await anyio.sleep(delay)
            await anyio.to_thread.run_sync(child.start)
            if child.proc is not None:
                self.say(f"{child.name} restarted (pid {child.pid})")

    def _give_up(self, why: str) -> None:
        self.failure = why
        self.say(f"giving up: {why}; stopping the cluster")
        self.tg.cancel_scope.cancel()

    def stop_all(self, timeout: float = 20.0) -> None:
        """Blocking: every child, in the reverse of its start order (the launchers, which stop
        their engines, before placement; NATS last)."""
        for child in reversed(self.children):
            code = child.stop(timeout)
            if code not in (0, None):
                self.say(f"{child.name} {how_it_ended(code)} when stopped; see {child.log}")


# --- what is left when the children are stopped -------------------------------------


@dataclass(frozen=True)
class Group:
    """A process group to stop: `pid` leads it; `started` is the leader's start time (0: the
    process is our own child, its pid cannot be recycled before we reap it)."""

    what: str
    pid: int
    started: int


def recorded_groups(state_dir: Path) -> tuple[list[Group], list[Path], list[str]]:
    """The engine process groups the launcher of `state_dir` recorded that are still alive (pid and
    start time both matching), the record files, and a sentence for each record that could not
    be read."""
    if not (state_dir / "shards").is_dir():
        return [], [], []
    records = Records(state_dir)
    found, problems = records.load_all()
    groups: list[Group] = []
    for key, record in sorted(found.items()):
        for p in record.procs:
            # A start time of 0 was never known (the process was gone when it was recorded):
            # there is nothing to prove the pid is still that engine's.
            if p.start_time and procs.group_alive(p.pid, p.start_time):
                groups.append(
                    Group(f"{key.replace('.', '/', 1)}'s {p.name} (pid {p.pid})", p.pid, p.start_time)
                )
    return groups, [records.path(k) for k in sorted(found)], problems


def _alive(group: Group) -> bool:
    if group.started:
        return procs.group_alive(group.pid, group.started)
    return procs.start_time(group.pid) is not None or procs.group_alive(group.pid)


def _signal(group: Group, sig: signal.Signals) -> None:
    if not procs.signal_group(group.pid, sig) and not group.started:
        # Our own child that does not lead a group of its own.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(group.pid, sig)


def stop_groups(groups: list[Group], grace_s: float = ENGINE_GRACE_S, say: Say = say) -> list[Group]:
    """Blocking: SIGTERM each group, SIGKILL what is left after `grace_s`; those still alive after."""
    if not groups:
        return []
    for g in groups:
        _signal(g, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(g) for g in groups):
        time.sleep(0.05)
    for g in groups:
        if _alive(g):
            say(f"{g.what} ignored SIGTERM for {grace_s:g}s; SIGKILL")
            _signal(g, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(_alive(g) for g in groups):
        time.sleep(0.05)
    return [g for g in groups if _alive(g)]


def stop_recorded_engines(state_dirs: list[Path], grace_s: float = ENGINE_GRACE_S, say: Say = say) -> None:
    """Blocking: stop every engine the launchers of `state_dirs` recorded and left running, and
    remove their records (the next `up`'s launchers have nothing left to adopt)."""
    groups: list[Group] = []
    files: list[Path] = []
    for state_dir in state_dirs:
        found, paths, problems = recorded_groups(state_dir)
        for problem in problems:
            say(problem)
        groups += found
        files += paths
    if groups:
        say(
            f"stopping {len(groups)} engine process group{'s' if len(groups) > 1 else ''} left running "
            f"without a launcher: {', '.join(g.what for g in groups)}"
        )
    left = stop_groups(groups, grace_s, say)
    for g in left:
        say(f"{g.what} is still running after SIGKILL")
    if not left:
        for path in files:
            with contextlib.suppress(OSError):
                path.unlink()


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants (Linux): a process whose parent
    dies is reparented here instead of to init, so `up` can still find it. False where the
    kernel has no such thing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def orphans(keep: set[int]) -> list[Group]:
    """This process's children but those in `keep`: as a subreaper, the processes whose own
    parent (a child of ours) died before them. Zombies are reaped here."""
    me = os.getpid()
    found: list[Group] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in keep:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) != me:
            continue
        pid = int(entry.name)
        if fields[0] in ("Z", "X"):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            continue
        found.append(Group(f"orphaned process {pid}", pid, 0))
    return found


def stop_orphans(keep: set[int], grace_s: float = ENGINE_GRACE_S, say: Say = say) -> None:
    """Blocking: stop what `orphans` finds, and reap it."""
    left = orphans(keep)
    if left:
        say(
            f"stopping {len(left)} process{'es' if len(left) > 1 else ''} whose parent exited before "
            f"{'them' if len(left) > 1 else 'it'}: pids {', '.join(str(g.pid) for g in left)}"
        )
    stop_groups(left, grace_s, say)
    orphans(keep)
