"""Running a check or a package manager with a deadline, and leaving nothing of it behind.

Each command runs in a session (and so a process group) of its own. When the
deadline passes, the whole group is killed, not just the child: a `--version`
that forks a helper and hangs would otherwise leave the helper running under
PID 1 after `subprocess.run` killed only the child it knew about. When the
command finishes, what is left of its group (a daemonised helper) is killed too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class TimedOut(Exception):
    """The command ran past its deadline; its whole process group was killed."""

    def __init__(self, argv: list[str], timeout: float, output: str) -> None:
        super().__init__(f"{' '.join(argv)} did not finish within {timeout:g}s")
        self.timeout = timeout
        self.output = output


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_bounded(argv: list[str], timeout: float, *, env: dict[str, str] | None = None) -> Finished:
    """Run `argv` (no shell) with stdin closed; its output, or TimedOut. FileNotFoundError and
    PermissionError come through as they are, for the caller to word."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
    )
    # The child's pid is its process group's id. While the child is unreaped, or
    # while anything of its group still lives, the kernel does not hand that id
    # to another process, so the kills below reach only what this call started
    # (once the group is gone, the id is free and the last kill finds nothing).
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        _kill_group(proc.pid)
        stdout, stderr = proc.communicate()  # the pipes close once the whole group is gone
        raise TimedOut(argv, timeout, (stdout or "") + (stderr or "")) from exc
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    _kill_group(proc.pid)
    return Finished(proc.returncode, stdout or "", stderr or "")
