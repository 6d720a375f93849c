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
import ctypes
import errno
import os
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from llmgw_core.engines import Command

LOG_LIMIT = 4 << 20  # bytes per process log before it is rotated
# Every attempt of a shard appends to the same log; this line starts each one, so that a
# failure quotes only the failing attempt's own lines (an earlier attempt's last words
# would otherwise be read as the cause of this one's exit).
ATTEMPT_MARK = "--- llmgw: attempt "


def attempt_mark(attempt: int, at: float) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{ATTEMPT_MARK}{attempt} started {stamp} ---"


def lower_priority(pid: int, steps: int) -> None:
    """Raise the nice value of `pid` by `steps` (lowering a priority needs no privilege).

    Called as soon as the exec succeeded, before the engine has started any
    thread of its own, so every thread and child process it makes inherits the value.
    A process already gone is left alone.

    Where Linux schedules by autogroup (`/proc/sys/kernel/sched_autogroup_enabled`,
    on by default in most distributions for processes outside a cpu cgroup), the
    CPU is shared between sessions first, and a nice value only orders the threads
    within a session. An engine leads a session of its own, so its session's nice
    is raised too: without it, every engine would weigh as much as the whole launcher.
    """
    if steps <= 0:
        return
    with contextlib.suppress(ProcessLookupError):
        current = os.getpriority(os.PRIO_PROCESS, pid)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, current + steps))
    mine, theirs = autogroup("self"), autogroup(str(pid))
    if mine is None or theirs is None or theirs[0] == mine[0]:
        return  # no autogroups here, or the same session as the launcher's: its own nice is not touched
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(f"{min(19, mine[1] + steps)}\n")


def autogroup(pid: str) -> tuple[str, int] | None:
    """The autogroup of `pid` (a number or "self") and its nice value, None where there is none."""
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


class Child:
    """A process this launcher started, and its exit status once it has ended (reaped here)."""

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None  # as subprocess has it: -N for a signal
        self.ended = False
        self._popen = popen  # where subprocess started it: it reaps

    def poll(self) -> int | None:
        """The exit status if the process has ended (it is reaped then), else None."""
        if self._popen is not None:
            self.returncode = self._popen.poll()
            self.ended = self.returncode is not None
        elif not self.ended:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                # Reaped by someone else: it has ended, its status went with them.
                self.ended = True
            else:
                if pid:
                    self.ended = True
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


class Spawn:
    """One process to start: `cmd` in a new session (its own process group) in `cwd`, stdin from
    /dev/null, output appended to `log_path` after a line that marks the start of `attempt`
    (none when 0), no descriptor of the launcher's, SIGPIPE and SIGXFSZ at their defaults.

    Making it prepares everything; `run()` starts the process with libc's posix_spawn, called
    through ctypes.CDLL, which lets go of the GIL while the kernel makes the child and the
    child execs. On a machine whose cores are busy that takes tens of milliseconds, and
    subprocess (like os.posix_spawn) holds the GIL all along, so every other task of the
    launcher would wait. The quick libc calls around it go through ctypes.PyDLL, which keeps
    the GIL: each release would be a hand-off to wait for. Where libc lacks what is needed
    (glibc before 2.34), `run()` starts it with subprocess instead.
    """

    def __init__(self, cmd: Command, log_path: Path, cwd: Path, attempt: int = 0) -> None:
        self.cmd = cmd
        self.cwd = cwd
        self.env = cmd.env_dict()
        cwd.mkdir(parents=True, exist_ok=True)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("ab")
        self._actions: ctypes.Array[ctypes.c_char] | None = None
        try:
            if attempt:
                self.log.write(f"{attempt_mark(attempt, time.time())}\n".encode())
                self.log.flush()
            self._libc = _spawn_libc()
            if self._libc is not None:
                self._path = os.fsencode(_executable(cmd.argv[0], self.env))
                self._argv = _c_strings([os.fsencode(a) for a in cmd.argv])
                self._envp = _c_strings([os.fsencode(k) + b"=" + os.fsencode(v) for k, v in self.env.items()])
                self._actions = _file_actions(self._libc, self.log.fileno(), cwd)
        except BaseException:
            self.close()
            raise

    def run(self) -> Child:
        """Start it (blocking); OSError if it cannot be (a missing program, say)."""
        if self._libc is None or self._actions is None:
            return _popen(self.cmd.argv, self.env, self.log, self.cwd)
        pid = ctypes.c_int()
        # Called through ctypes.CDLL: the GIL is let go for the call.
        code = self._libc.cdll.posix_spawn(
            ctypes.byref(pid), self._path, self._actions, self._libc.attr, self._argv, self._envp
        )
        if code:
            raise OSError(code, os.strerror(code), os.fsdecode(self._path))
        return Child(pid.value)

    def close(self) -> None:
        if self._actions is not None and self._libc is not None:
            self._libc.pydll.posix_spawn_file_actions_destroy(self._actions)
            self._actions = None
        self.log.close()

    def __enter__(self) -> Spawn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn(cmd: Command, log_path: Path, cwd: Path, attempt: int = 0, nice: int = 0) -> tuple[Child, int]:
    """`Spawn` all in one call, the child then `nice` steps below the launcher's own CPU
    priority: the child and its start time (0 if it is already gone)."""
    with Spawn(cmd, log_path, cwd, attempt) as s:
        child = s.run()
    lower_priority(child.pid, nice)
    return child, start_time(child.pid) or 0


def _executable(name: str, env: dict[str, str]) -> str:
    """`name` as exec will find it: as given if it has a slash, else on the PATH of `env` (as
    subprocess looks for it)."""
    if os.sep in name:
        return name
    found = shutil.which(name, path=os.pathsep.join(os.get_exec_path(env)))
    if found is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    return found


def _popen(argv: Sequence[str], env: dict[str, str], log: IO[bytes], cwd: Path) -> Child:
    popen = subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
        close_fds=True,
    )
    return Child(popen.pid, popen)


# posix_spawn through libc. Flags and the sizes that hold glibc's and musl's opaque types.
_SETSIGDEF = 0x04
_SETSIGMASK = 0x08
_SETSID = 0x80
_OPAQUE = 1024  # posix_spawnattr_t is 336 bytes in glibc, posix_spawn_file_actions_t 80
_SIGSET = 128  # sigset_t
_NEEDED = (
    "posix_spawn",
    "posix_spawnattr_init",
    "posix_spawnattr_setflags",
    "posix_spawnattr_setsigmask",
    "posix_spawnattr_setsigdefault",
    "posix_spawn_file_actions_init",
    "posix_spawn_file_actions_destroy",
    "posix_spawn_file_actions_addopen",
    "posix_spawn_file_actions_adddup2",
    "posix_spawn_file_actions_addchdir_np",
    "posix_spawn_file_actions_addclosefrom_np",
    "sigemptyset",
    "sigaddset",
)
# Tests set this to take the subprocess path.
USE_POSIX_SPAWN = True


class _Libc:
    """libc twice: `cdll` lets go of the GIL during a call (for posix_spawn), `pydll` keeps it
    (for the quick calls around it, so that none of them is a GIL hand-off). And the spawn
    attributes every start shares, made once."""

    def __init__(self) -> None:
        self.cdll = ctypes.CDLL(None, use_errno=True)
        self.pydll = ctypes.PyDLL(None, use_errno=True)
        for name in _NEEDED:
            getattr(self.pydll, name)
        self.cdll.posix_spawn.argtypes = [
            ctypes.POINTER(ctypes.c_int),
            ctypes.c_char_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_char_p),
        ]
        self.pydll.posix_spawnattr_setflags.argtypes = [ctypes.c_void_p, ctypes.c_short]
        self.pydll.posix_spawn_file_actions_addopen.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
            ctypes.c_uint,
        ]
        libc = self.pydll
        self.attr = ctypes.create_string_buffer(_OPAQUE)
        empty = ctypes.create_string_buffer(_SIGSET)
        defaults = ctypes.create_string_buffer(_SIGSET)
        _check(libc.posix_spawnattr_init(self.attr), "posix_spawnattr_init")
        libc.sigemptyset(empty)
        libc.sigemptyset(defaults)
        # Python ignores SIGPIPE and SIGXFSZ; an engine gets them back as they are by default.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            libc.sigaddset(defaults, int(sig))
        _check(libc.posix_spawnattr_setsigmask(self.attr, empty), "posix_spawnattr_setsigmask")
        _check(libc.posix_spawnattr_setsigdefault(self.attr, defaults), "posix_spawnattr_setsigdefault")
        _check(
            libc.posix_spawnattr_setflags(self.attr, _SETSID | _SETSIGMASK | _SETSIGDEF),
            "posix_spawnattr_setflags",
        )


_libc: _Libc | None = None
_libc_missing = False


def _spawn_libc() -> _Libc | None:
    global _libc, _libc_missing
    if not USE_POSIX_SPAWN or _libc_missing:
        return None
    if _libc is None:
        try:
            _libc = _Libc()
        except (OSError, AttributeError):
            _libc_missing = True
            return None
    return _libc


def _c_strings(items: list[bytes]) -> ctypes.Array[ctypes.c_char_p]:
    """A NULL-terminated array of C strings (argv, envp)."""
    return (ctypes.c_char_p * (len(items) + 1))(*items, None)


def _file_actions(libc: _Libc, log_fd: int, cwd: Path) -> ctypes.Array[ctypes.c_char]:
    """stdin from /dev/null, stdout and stderr to `log_fd`, every other descriptor closed (those
    this process inherited without close-on-exec too), then `cwd`."""
    c = libc.pydll
    actions = ctypes.create_string_buffer(_OPAQUE)
    _check(c.posix_spawn_file_actions_init(actions), "posix_spawn_file_actions_init")
    try:
        _check(
            c.posix_spawn_file_actions_addopen(actions, 0, b"/dev/null", os.O_RDONLY, 0),
            "posix_spawn_file_actions_addopen",
        )
        for fd in (1, 2):
            _check(
                c.posix_spawn_file_actions_adddup2(actions, log_fd, fd), "posix_spawn_file_actions_adddup2"
            )
        _check(
            c.posix_spawn_file_actions_addclosefrom_np(actions, 3), "posix_spawn_file_actions_addclosefrom_np"
        )
        _check(
            c.posix_spawn_file_actions_addchdir_np(actions, os.fsencode(cwd)),
            "posix_spawn_file_actions_addchdir_np",
        )
    except BaseException:
        c.posix_spawn_file_actions_destroy(actions)
        raise
    return actions


def _check(code: int, what: str) -> None:
    if code:
        raise OSError(code, f"{what}: {os.strerror(code)}")


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
