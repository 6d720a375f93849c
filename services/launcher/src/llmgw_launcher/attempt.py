"""One attempt at running a shard: what its start hooks learn (`Attempt`), what they use of the
shard's runner (`Runner`), the processes it started and how it ended."""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVarTuple

from llmgw_core.adapters import Adapter, ServedAdapter
from llmgw_core.engines import Engine, ShardSpec
from llmgw_core.events import ShardState

from . import oom, procs
from .records import ProcRecord

if TYPE_CHECKING:
    from .context import Context

Args = TypeVarTuple("Args")

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


@dataclass
class Attempt:
    """What the hooks of one start have learnt, for the hooks after them."""

    engine: Engine | None = None
    # The path the engine reads the model at (the node's staged copy, or the profile's own).
    model_path: str = ""
    # The profile's adapters the engine loads, each at the path it reads (`adapters.AdaptersHook`);
    # None: the profile's as they are.
    adapters: tuple[Adapter, ...] | None = None

    def need_engine(self) -> Engine:
        assert self.engine is not None, "the validate hook runs first"
        return self.engine


class Runner(Protocol):
    """What the hooks use of the shard's runner (`runner.ShardRunner`): its shard and state,
    and the steps that publish, record and watch the shard's processes."""

    key: str
    spec: ShardSpec
    ctx: Context
    procs: list[Proc]
    restarts: int
    port: int
    owns_port: bool
    extra_ports: tuple[int, ...]
    leader_url: str
    adapters_refused: tuple[str, ...]
    adapters_served: tuple[ServedAdapter, ...]
    adapters_staged: dict[str, str]

    def set_state(self, state: ShardState, reason: str = "", retryable: bool = True) -> None: ...

    def progress(self, state: ShardState, words: str) -> None: ...

    async def save(self, ready: bool = False) -> Failure | None: ...

    async def until_exit(
        self, work: Callable[[*Args], Awaitable[Failure | None]], *args: *Args
    ) -> Failure | None: ...

    async def exit_failure(self, reason: str, proc: Proc | None = None) -> Failure: ...

    def first_exit(self) -> str | None: ...

    def spec_with_port(self) -> ShardSpec: ...

    def url(self) -> str: ...


class StartHook(Protocol):
    name: str

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None: ...
