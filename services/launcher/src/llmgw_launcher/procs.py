"""Processes of shards: started in their own session, output to files, found again by pid + start time.

Output goes to a file rather than a pipe so the engine outlives the launcher:
a pipe's reader dying would kill the engine with SIGPIPE on its next log line,
and a restarted launcher could not read it anyway.

Everything here is blocking (fork and exec, /proc reads, log files): the
launcher calls it from a worker thread, never on its event loop. Exits are
noticed through a pidfd (Linux 5.3+), which the event loop waits on like a
socket: no polling, and nothing to do while the engine runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

from llmgw_core.engines import Command

LOG_LIMIT = 4 << 20  # bytes per process log before it is rotated
# Every attempt of a shard appends to the same log; this line starts each one, so that a
# failure quotes only the failing attempt's own lines (an earlier attempt's last words
# would otherwise be read as the cause of this one's exit).
ATTEMPT_MARK = "--- llmgw: attempt "


def attempt_mark(attempt: int, at: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{ATTEMPT_MARK}{attempt} started {stamp} ---"


def start(
    cmd: Command, log_path: Path, cwd: Path, attempt: int = 0, nice: int = 0
) -> subprocess.Popen[bytes]:
    """Start `cmd` in a new session (its own process group), output appended to `log_path`
    after a line that marks the start of `attempt` (none when 0), `nice` steps below the
    launcher's own CPU priority."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        if attempt:
            log.write(f"{attempt_mark(attempt, time.time())}\n".encode())
            log.flush()
        popen = subprocess.Popen(
            cmd.argv,
            env=cmd.env_dict(),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
            close_fds=True,
        )
    if nice:
        lower_priority(popen.pid, nice)
    return popen


def lower_priority(pid: int, steps: int) -> None:
    """Raise the nice value of `pid` by `steps` (lowering a priority needs no privilege).

    Popen returns as soon as the exec succeeded, before the engine has started any
    thread of its own, so every thread and child process it makes inherits the value.
    A process already gone is left alone.
    """
    with contextlib.suppress(ProcessLookupError):
        current = os.getpriority(os.PRIO_PROCESS, pid)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, current + steps))


def spawn(
    cmd: Command, log_path: Path, cwd: Path, attempt: int = 0, nice: int = 0
) -> tuple[subprocess.Popen[bytes], int]:
    """`start` and the new process's start time (0 if it is already gone)."""
    cwd.mkdir(parents=True, exist_ok=True)
    popen = start(cmd, log_path, cwd, attempt, nice)
    return popen, start_time(popen.pid) or 0


class NoPidfd(Exception):
    """This kernel (or platform) has no pidfd_open: exits must be polled for."""


def pidfd(pid: int, started: int) -> int | None:
    """A pidfd of the process `pid` started at `started`, None if that process is gone.

    The start time (0: do not check) is checked after the pidfd is open, so
    the fd cannot name a stranger that got a recycled pid. A child of this
    process needs no check: its pid is not reused before it is reaped.
    """
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        raise NoPidfd("os.pidfd_open is missing")
    try:
        fd = int(opener(pid))
    except ProcessLookupError:
        return None
    except OSError as exc:
        raise NoPidfd(str(exc)) from exc
    if started and start_time(pid) != started:
        os.close(fd)
        return None
    return fd


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, None if it is gone or a zombie.

    A pid alone is not an identity: pids are recycled, and adopting a stranger
    that got an old engine's pid would report a dead engine as ready.
    """
    fields = _stat(Path(f"/proc/{pid}"))
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def alive(pid: int, started: int) -> bool:
    return start_time(pid) == started


def signal_group(pid: int, sig: signal.Signals) -> bool:
    """Signal the process group led by `pid`; False if it no longer exists."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False
    return True


def group_alive(pgid: int, leader_started: int = 0) -> bool:
    """Whether the process group led by `pgid` still has a live member that is ours.

    Once the leader is gone its pid can be reused, and a new session leader
    that got it leads a group of the same id: a stranger's (another shard's
    engine, say). With `leader_started`, a group whose leader is alive but
    started at another time is that stranger's, and counts as gone, so that
    stopping a shard never signals someone else's processes.
    """
    if leader_started:
        leader = start_time(pgid)
        if leader is not None and leader != leader_started:
            return False
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # killpg(0) succeeds while only zombies remain; look for a live member.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(entry)
        if fields is not None and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _stat(proc_dir: Path) -> list[str] | None:
    """`/proc/<pid>/stat` after the command name: state, ppid, pgrp, …; None if the process is gone."""
    try:
        return (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def tail(log_path: Path, lines: int = 20, *, this_attempt: bool = False) -> list[str]:
    """The last `lines` lines of a process log; with `this_attempt`, only those after the
    last attempt's mark (the mark itself left out)."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read()
    except OSError:
        return []
    text = data.decode("utf-8", "replace").splitlines()
    if this_attempt:
        marks = [i for i, line in enumerate(text) if line.startswith(ATTEMPT_MARK)]
        if marks:
            text = text[marks[-1] + 1 :]
    return list(deque(text, maxlen=lines))


def read_from(log_path: Path, offset: int, limit: int) -> tuple[list[str], int]:
    """Whole lines written at or after byte `offset` (from the start if the log is now shorter:
    it was rotated), at most `limit` bytes of them counted from the end; and the offset after them."""
    try:
        with log_path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if offset > size:
                offset = 0
            start = max(offset, size - limit)
            f.seek(start)
            data = f.read(size - start)
    except OSError:
        return [], offset
    end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
    text = data[:end].decode("utf-8", "replace").splitlines()
    if start > offset and text:
        text = text[1:]  # cut by the limit: its first line is partial
    return text, start + end


def rotate_if_large(log_path: Path, limit: int = LOG_LIMIT) -> None:
    """Keep a log bounded: past `limit`, its tail moves to `<log>.1` and the log is emptied.

    The engine appends (O_APPEND), so it carries on writing at the new end.
    """
    try:
        if log_path.stat().st_size <= limit:
            return
        keep = "\n".join(tail(log_path, 2000)) + "\n"
        log_path.with_suffix(log_path.suffix + ".1").write_text(keep)
        with contextlib.suppress(OSError), log_path.open("r+b") as f:
            f.truncate(0)
    except OSError:
        return
