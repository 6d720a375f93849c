"""One attempt at running a shard: the processes it started and how it ended."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from . import oom, procs
from .records import ProcRecord

# The most of a failure's reason a shard's status carries: its words come from outside (a
# model's header, an engine's log) and a status is read by every observer.
REASON_MAX = 1000


def bounded(reason: str) -> str:
    return reason if len(reason) <= REASON_MAX else f"{reason[:REASON_MAX]}… ({len(reason):,} characters)"


@dataclass
class Failure:
    """Why an attempt ended: `reason` in one line; the exit status and the attempt's last log
    lines where a process's exit ended it (see `ShardFailure`)."""

    reason: str
    retryable: bool = True
    exit: int | None = None
    log_tail: tuple[str, ...] = ()


@dataclass
class Proc:
    name: str
    pid: int
    start_time: int
    log: Path
    child: procs.Child | None = None  # None: adopted, not started by this launcher
    # Its memory cgroup and the OOM kills counted there when it started (see `oom`).
    memcg: oom.MemCgroup | None = None

    def exit_reason(self) -> str | None:
        """None while running; else how it ended."""
        if self.child is not None:
            code = self.child.poll()
            if code is None:
                if not self.child.ended:
                    return None
                return f"{self.name} (pid {self.pid}) exited (its exit status was collected elsewhere)"
            if code < 0:
                return f"{self.name} (pid {self.pid}) killed by signal {signal.Signals(-code).name}"
            return f"{self.name} (pid {self.pid}) exited with code {code}"
        if procs.alive(self.pid, self.start_time):
            return None
        return f"{self.name} (pid {self.pid}) exited while the launcher was away (exit status unknown)"

    def record(self) -> ProcRecord:
        return ProcRecord(name=self.name, pid=self.pid, start_time=self.start_time, log=str(self.log))
