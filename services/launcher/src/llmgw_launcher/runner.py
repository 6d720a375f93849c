"""One shard's life: validate, start its commands, health-check, restart with backoff, stop.

The runner hands every state change to `Context.publish` (it queues, never
waits on the bus). Cancelling `run()` leaves the processes alone (the agent
is stopping, the engine is not); `terminate()` is what stops the engine.

All the shards of a node share one event loop, so nothing here blocks it:
processes are spawned, /proc is scanned and logs are read in worker threads,
records are written by the node's `RecordWriter`, a process's exit is a
pidfd becoming readable, and health probes go through the node's one
`HealthProber`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import msgspec
from opentelemetry import trace

from llmgw_core import failures, fit, staged
from llmgw_core.engines import (
    Address,
    Command,
    Engine,
    GPUInfo,
    Registry,
    ShardSpec,
    SourceError,
    UnknownEngineError,
    extra_ports_needed,
    parse_source,
)
from llmgw_core.events import EngineLoad, ShardFailure, ShardState, ShardStatus, now
from llmgw_core.redact import scrub, secret_values
from llmgw_core.retry import Backoff
from llmgw_core.telemetry import context_from

from . import oom, ports, procs
from .health import HealthProber
from .load import LOAD_METRICS, LoadMetrics, Scraper, changed, parse_load
from .records import ProcRecord, RecordError, RecordWriter, ShardRecord
from .weights import Weights, WeightsError
from .workers import Workers

log = logging.getLogger("llmgw.launcher")

# The most of a failure's reason a shard's status carries: its words come from outside (a
# model's header, an engine's log) and a status is read by every observer.
REASON_MAX = 1000


def _bounded(reason: str) -> str:
    return reason if len(reason) <= REASON_MAX else f"{reason[:REASON_MAX]}… ({len(reason):,} characters)"


tracer = trace.get_tracer("llmgw.launcher")

# Consecutive failed health checks, after a shard was ready, that fail it.
HEALTH_FAILURES_TO_FAIL = 3
LOG_LINES_IN_REASON = 10
# While an engine loads, its health is probed this often: the delay it adds to "ready".
LOADING_PROBE_S = 0.1
# Where pidfds are missing, process exits are polled this often.
EXIT_POLL_S = 0.5


@dataclass
class Context:
    """What every runner on a node shares."""

    node: str
    state_dir: Path
    registry: Registry
    gpus: list[GPUInfo]
    records: RecordWriter
    publish: Callable[[ShardStatus], None]
    prober: HealthProber
    allocate_port: Callable[[], int]
    release_port: Callable[[int], None]
    mgmt_addr: str = "127.0.0.1"
    stop_grace_s: float = 10.0
    wait_timeout_s: float = 600.0
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    health_interval_s: float = 1.0
    # Engines run this many nice steps below the launcher (see AgentConfig.engine_nice).
    engine_nice: int = 0
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # Points an adapter at the build the installer installed, if any.
    refresh_engine: Callable[[str], Awaitable[None]] = field(default=lambda _name: _nothing())
    # The threads that blocking work runs in (one for spawns, a few for files).
    workers: Workers = field(default_factory=Workers)
    # A ready engine's metrics are read this often for its load (0: never), through `scraper`;
    # a load that changed goes out by `publish_quietly` (the status bucket, no event).
    load_interval_s: float = 5.0
    scraper: Scraper | None = None
    publish_quietly: Callable[[ShardStatus], None] | None = None
    # Stages the weights a profile's `model` names (hf://, https://, file://) before its engine starts.
    weights: Weights | None = None
    # Told the path of a model file a shard found missing (see `modelfiles`).
    model_missing: Callable[[str], None] = field(default=lambda _path: None)
    # The host's memory in MB, what CPU profiles are fitted against (0: not known, not checked).
    memory_mb: int = 0


async def _nothing() -> None:
    return None


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


class ShardRunner:
    def __init__(self, key: str, spec: ShardSpec, ctx: Context, adopt: ShardRecord | None = None):
        self.key = key
        self.spec = spec
        self.ctx = ctx
        self.adopt = adopt
        # An adopted shard's processes are known from its record at once, so a
        # shard that is stopped before it is ever supervised (an orphan) is
        # still stopped for real.
        self.procs: list[Proc] = (
            [Proc(name=p.name, pid=p.pid, start_time=p.start_time, log=Path(p.log)) for p in adopt.procs]
            if adopt
            else []
        )
        self.restarts = adopt.restarts if adopt else 0
        # The wait before each restart grows with `restarts` (kept across a launcher's restart).
        self.restart_waits = Backoff(ctx.backoff_s, ctx.backoff_cap_s)
        self.port = adopt.port if adopt else 0
        self.state: ShardState = "pending"
        # The last failure (scrubbed of the shard's secrets), kept across restarts until the
        # shard is ready again.
        self.last_failure: ShardFailure | None = None
        self._owns_port = False
        # Ports the engine's own processes need beyond `port` (a Ray head's client
        # server): always this runner's, given back with every failed attempt.
        self.extra_ports: tuple[int, ...] = ()
        self._leader_url = ""
        self._secret_values: list[str] | None = None
        # The engine's load as last published; only while ready.
        self.load: EngineLoad | None = None
        self._state_at = 0.0
        # The last status this runner published (None before its first): what the status
        # bucket should hold for this shard.
        self.status: ShardStatus | None = None

    # --- publishing ----------------------------------------------------------

    def _secrets(self) -> list[str]:
        """The secret values of the shard's environment, found once: the spec and the launcher's
        environment do not change under a runner, and matching every variable against the
        secret patterns at each status was a tenth of the launcher's time in a burst."""
        if self._secret_values is None:
            self._secret_values = secret_values(self.spec.profile.env, self.ctx.environ)
        return self._secret_values

    def _set(self, state: ShardState, reason: str = "", retryable: bool = True) -> None:
        self.state = state
        if state != "ready":
            self.load = None
        status = self._status(state, reason, retryable)
        self._state_at = status.at
        log.info("shard %s: %s%s", self.key, state, f" ({status.reason})" if status.reason else "")
        self.status = status
        self.ctx.publish(status)

    def _publish_load(self, load: EngineLoad) -> None:
        """The ready status again with the engine's new load: in the status bucket, which ctl and
        the page read, but not as an event (a load is not a transition, and the events would
        bury the transitions that are)."""
        self.load = load
        # `at` stays when the shard became ready: it dates the state, which has not changed.
        status = msgspec.structs.replace(self._status("ready"), at=self._state_at)
        self.status = status
        (self.ctx.publish_quietly or self.ctx.publish)(status)

    def _status(self, state: ShardState, reason: str = "", retryable: bool = True) -> ShardStatus:
        if state == "ready":
            self.last_failure = None
        elif state in ("pending", "starting") and not reason and self.last_failure is not None:
            # While retrying, say which attempt this is and why the last one ended.
            reason = failures.retrying(self.restarts + 1, self.last_failure)
        # A reason may quote the engine's log, and an engine may print its environment.
        reason = scrub(reason, self._secrets())
        failure = self.last_failure
        status = ShardStatus(
            node=self.ctx.node,
            shard=self.spec.shard,
            replica=self.spec.replica,
            deployment=self.spec.deployment,
            state=state,
            reason=reason,
            retryable=retryable,
            pids=tuple(p.pid for p in self.procs),
            port=self.port,
            url=self._leader_url if state == "ready" else "",
            profile_fp=self.spec.profile_fp,
            pool=self.spec.pool,
            fabric=self.spec.fabric,
            restarts=self.restarts,
            rank=self.spec.rank,
            at=now(),
            last_failure=failures.text(failure),
            last_failure_at=failure.at if failure is not None else 0.0,
            load=self.load if state == "ready" else None,
            failure=failure,
        )
        return status

    async def _save(self, ready: bool = False) -> Failure | None:
        """Write the shard's record; a failed write fails the attempt (a successor could not adopt it)."""
        record = ShardRecord(
            key=self.key,
            spec=self.spec,
            port=self.port,
            procs=tuple(p.record() for p in self.procs),
            restarts=self.restarts,
            ready=ready,
        )
        try:
            await self.ctx.records.save(record)
        except RecordError as exc:
            return Failure(f"{exc}; a restarted launcher could not adopt this shard, so it is stopped")
        return None

    # --- the life ---------------------------------------------------------------

    async def run(self) -> None:
        """Keep the shard running until cancelled; cancellation leaves processes running."""
        if self.adopt is not None:
            failure = await self._guarded(self._adopt, self.adopt)
            self.adopt = None
        else:
            failure = await self._guarded(self._attempt)
        while True:
            await self._kill_all()
            self.last_failure = self._fields(failure)
            self._set("failed", failures.text(self.last_failure), failure.retryable)
            if not failure.retryable:
                # Not worth retrying until the spec changes; a changed spec
                # replaces this runner.
                await anyio.sleep_forever()
            if self._owns_port:
                # The port may be why it failed (another process took it): pick again.
                self._release_port()
            self._release_extra_ports()
            await anyio.sleep(self.restart_waits.wait(self.restarts + 1))
            self.restarts += 1
            failure = await self._guarded(self._attempt)

    def _fields(self, failure: Failure) -> ShardFailure:
        """The failure of this attempt as published: scrubbed once, since an engine may print
        its environment into its log, and the failure is sent with every status until ready."""
        secrets = self._secrets()
        return ShardFailure(
            reason=scrub(failure.reason, secrets),
            exit=failure.exit,
            log_tail=tuple(scrub(line, secrets) for line in failure.log_tail),
            attempt=self.restarts + 1,
            at=now(),
        )

    async def _guarded(self, step: Callable[..., Awaitable[Failure]], *args: object) -> Failure:
        """An attempt whose unexpected error is that attempt's failure, never the launcher's."""
        try:
            return await step(*args)
        except anyio.get_cancelled_exc_class():
            raise
        except Exception as exc:
            log.exception("shard %s: the attempt failed unexpectedly", self.key)
            return Failure(f"launcher error while running the shard: {type(exc).__name__}: {exc}")

    def _release_extra_ports(self) -> None:
        for port in self.extra_ports:
            self.ctx.release_port(port)
        self.extra_ports = ()

    def _release_port(self) -> None:
        self.ctx.release_port(self.port)
        self.port = 0
        self._owns_port = False

    async def _adopt(self, record: ShardRecord) -> Failure:
        self.port = record.port
        # A port the spec did not name was picked from the range (the launcher counts it in
        # use at its start): released when the shard fails, so that a port another process
        # took meanwhile is not tried again and again.
        self._owns_port = bool(record.port) and not self.spec.port
        engine, failure = await self._engine()
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        self._leader_url = self._url() if engine.serves_http(self.spec) else ""
        dead = [r for p in self.procs if (r := p.exit_reason())]
        if dead or not self.procs:
            return await self._exit_failure(dead[0] if dead else "no processes were recorded")
        log.info("shard %s: adopted pids %s", self.key, [p.pid for p in self.procs])
        if engine.serves_http(self._spec_with_port()):
            # Recorded as ready is not ready: it must answer again before we say so.
            failure = await self._await_health(engine)
            if failure is not None:
                return failure
        self._set("ready")
        failure = await self._save(ready=True)
        if failure is not None:
            return failure
        return await self._supervise(engine)

    async def _engine(self) -> tuple[Engine | None, Failure | None]:
        await self.ctx.refresh_engine(self.spec.profile.engine)
        try:
            return self.ctx.registry.get(self.spec.profile.engine), None
        except UnknownEngineError as exc:
            return None, Failure(str(exc), retryable=False)

    def _spec_with_port(self) -> ShardSpec:
        return msgspec.structs.replace(self.spec, port=self.port, extra_ports=self.extra_ports)

    def _url(self) -> str:
        host = self.spec.host
        if host in ("", "0.0.0.0", "::"):
            host = self.ctx.mgmt_addr
        return f"http://{host}:{self.port}"

    async def _attempt(self) -> Failure:
        # The span covers the way to ready (or failure) and joins the trace the
        # placement started; the supervision that follows is not part of it.
        with tracer.start_as_current_span(
            f"start shard {self.key}", context=context_from(self.spec.traceparent)
        ) as span:
            span.set_attribute("llmgw.restarts", self.restarts)
            outcome = await self._start_all()
        if isinstance(outcome, Failure):
            return outcome
        return await self._supervise(outcome)

    async def _start_all(self) -> Failure | Engine:
        """pending -> starting -> (waiting) -> (loading) -> ready; the engine, or why not."""
        self.procs = []
        self._set("pending")
        engine, failure = await self._engine()
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        problems = engine.validate(self.spec.profile, self.ctx.gpus, self.spec)
        if problems:
            return Failure("; ".join(problems), retryable=False)
        failure = await self._missing_model()
        if failure is not None:
            return failure
        model_path = await self._stage_weights()
        if isinstance(model_path, Failure):
            return model_path
        serves = engine.serves_http(self.spec)
        if not self.port and serves:
            self.port = self.spec.port or self.ctx.allocate_port()
            self._owns_port = not self.spec.port
        if not self.extra_ports:
            self.extra_ports = tuple(
                self.ctx.allocate_port() for _ in range(extra_ports_needed(engine, self.spec))
            )
        spec = self._spec_with_port()
        if model_path != spec.profile.model_path:
            spec = msgspec.structs.replace(
                spec, profile=msgspec.structs.replace(spec.profile, model_path=model_path)
            )
        self._leader_url = self._url() if serves else ""
        if serves:
            # An engine started on a port another process holds dies with "Address already in
            # use", and until it does the other process answers its health checks.
            held = await self.ctx.workers.files(ports.held, self.port, self.spec.host)
            if held is not None:
                return Failure(held)
        commands = engine.commands(spec, self.ctx.environ)
        self._set("starting")
        for i, cmd in enumerate(commands):
            if cmd.wait_for:
                self._set("waiting", f"waiting for {', '.join(map(str, cmd.wait_for))}")
                failure = await self._until_exit(self._wait_for, cmd)
                if failure is not None:
                    return failure
            failure = await self._start(cmd)
            if failure is None and i < len(commands) - 1:
                # A sidecar runs while the next command may wait: on disk first, so
                # that a launcher that dies meanwhile leaves it adoptable.
                failure = await self._save()
            if failure is not None:
                return failure
        if serves:
            self._set("loading")
            url = self._leader_url + engine.health_path
            failure = await self._until_exit(self._recorded_and_healthy, url)
            if failure is not None:
                return failure
        else:
            failure = await self._save()
            if failure is not None:
                return failure
            dead = self._first_exit()
            if dead:
                return await self._exit_failure(dead)
        await self._read_cgroups()
        self._set("ready")
        failure = await self._save(ready=True)
        if failure is not None:
            return failure
        return engine

    async def _missing_model(self) -> Failure | None:
        """The file the node must already hold for the profile, if it does not: found before any
        engine starts, since an engine that cannot open its model exits, is restarted, and exits
        again forever; and told to the node, whose heartbeats keep placement from sending the
        profile here again until the file is there."""
        path = self.spec.profile.node_file
        if not path or await self.ctx.workers.files(os.path.exists, path):
            return None
        self.ctx.model_missing(path)
        return Failure(f"model file not found: {path}", retryable=False)

    async def _stage_weights(self) -> Failure | str:
        """The path the engine reads the weights at: the node's staged copy when `model` names a
        source, waited for with its progress as the shard's status; else `model_path` as given."""
        profile = self.spec.profile
        try:
            source = parse_source(profile.model, profile.model_sha256, profile=profile.name)
        except SourceError as exc:
            return Failure(str(exc), retryable=False)
        if source is None:
            return profile.model_path
        if self.ctx.weights is None:
            return Failure(f"profile {profile.name}: this node stages no weights", retryable=False)
        first = True

        def report(words: str) -> None:
            nonlocal first
            if first:
                first = False
                self._set("waiting", words)
                return
            status = msgspec.structs.replace(self._status("waiting", words), at=self._state_at)
            (self.ctx.publish_quietly or self.ctx.publish)(status)

        try:
            path = await self.ctx.weights.stage(source, report)
        except WeightsError as exc:
            return Failure(exc.reason, retryable=exc.retryable)
        if source.kind != "file":
            too_big = await self.ctx.workers.files(self._too_big, path)
            if too_big:
                # Placement fits a model only once some node reported its shape, so the first
                # replica of a new model comes here unchecked: started, its engine would fail
                # to allocate in its own words (and be restarted). The node reports the shape
                # it just recorded, and placement refuses it for the profile in these words.
                # A hostile header fails here too: once, not retried, its words bounded.
                return Failure(_bounded(too_big), retryable=False)
        return str(path)

    def _too_big(self, view: Path) -> str | None:
        """Whether the staged model at `view` cannot fit the GPUs this shard is pinned to (or, for a
        CPU profile, the host's memory), by placement's own rule (`fit.check_shard`), or has a
        header that breaks its format or the bounds (`fit.HeaderError`); in a file thread, since
        it reads the shape kept beside the view (or, where none was kept, the header itself)."""
        profile = self.spec.profile
        try:
            # Where no shape was kept: a model whose counts are missing (started unchecked, as
            # before), or a header that is broken or hostile, which no engine is started on.
            shape = staged.recorded_shape(view) or fit.read_shape(view)
        except fit.HeaderError as exc:
            return (
                f"model {profile.weights_key}: {exc}; the file is broken or not a model: fix it at its source"
            )
        except fit.FitError:
            return None
        gpus = [g for g in self.ctx.gpus if g.index in self.spec.gpus]
        try:
            return fit.check_shard(shape, profile, gpus, self.ctx.memory_mb)
        except fit.FitError as exc:  # a figure no estimate can use (a context of 1e308 tokens)
            return f"model {profile.weights_key}: {exc}"

    async def _start(self, cmd: Command) -> Failure | None:
        log_path = self.ctx.state_dir / "logs" / self.key / f"{len(self.procs)}-{cmd.name}.log"
        workdir = self.ctx.state_dir / "run" / self.key
        attempt, nice = self.restarts + 1, self.ctx.engine_nice
        try:
            # All of it in the spawning thread, the directories and the log included: on a
            # node whose disk is busy, creating a file can wait for the filesystem's journal.
            child, started = await self.ctx.workers.spawn(
                lambda: procs.spawn(cmd, log_path, workdir, attempt, nice)
            )
        except OSError as exc:
            return Failure(f"cannot start {cmd.name} ({cmd.path}): {exc.strerror or exc}")
        memcg = await self.ctx.workers.files(oom.find, child.pid)
        self.procs.append(Proc(cmd.name, child.pid, started, log_path, child, memcg))
        return None

    async def _read_cgroups(self) -> None:
        """Each process's memory cgroup again, now that it runs: a wrapper (a script that enters
        a cgroup, `systemd-run --scope`, a container's shim) may have moved it since it started,
        and its OOM kills are counted where it is now."""
        for p in self.procs:
            if p.child is not None:
                p.memcg = await self.ctx.workers.files(oom.find, p.pid) or p.memcg

    def _first_exit(self) -> str | None:
        for p in self.procs:
            reason = p.exit_reason()
            if reason:
                return reason
        return None

    async def _exit_failure(self, reason: str, proc: Proc | None = None) -> Failure:
        """How a process ended, with the last lines of its log; `proc` is found by its reason if not given."""
        found = proc or next((p for p in self.procs if p.exit_reason() == reason), None)
        if found is None:
            return Failure(reason)
        lines = await self.ctx.workers.files(self._attempt_tail, found.log)
        code = found.child.returncode if found.child is not None else None
        if code == -signal.SIGKILL:
            # Whether the kernel's OOM killer sent it, in the kernel's words where it gives them.
            said = await self.ctx.workers.files(oom.explain, found.memcg, found.pid, found.start_time)
            if said:
                reason = f"{found.name} (pid {found.pid}) {said}"
        return Failure(reason, exit=code, log_tail=tuple(lines))

    @staticmethod
    def _attempt_tail(log: Path) -> list[str]:
        # Only the failing attempt's own lines: its exit is not explained by an earlier one's.
        return procs.tail(log, LOG_LINES_IN_REASON, this_attempt=True)

    # --- waiting on processes ---------------------------------------------------

    async def _until_exit(self, work: Callable[[Any], Awaitable[Failure | None]], arg: Any) -> Failure | None:
        """`work(arg)`'s outcome, unless one of the shard's processes exits first: then that exit's."""
        outcome: list[Failure | None] = []
        async with anyio.create_task_group() as tg:

            async def run_work() -> None:
                outcome.append(await work(arg))
                tg.cancel_scope.cancel()

            async def watch_exits() -> None:
                proc, reason = await self._any_exit()
                outcome.append(await self._exit_failure(reason, proc))
                tg.cancel_scope.cancel()

            tg.start_soon(watch_exits)
            tg.start_soon(run_work)
        return outcome[0]

    async def _any_exit(self) -> tuple[Proc, str]:
        """Wait until one of the shard's processes has exited: which, and how it ended."""
        exits: list[tuple[Proc, str]] = []
        async with anyio.create_task_group() as tg:
            for p in self.procs:

                async def wait_one(p: Proc = p) -> None:
                    exits.append((p, await _wait_exit(p)))
                    tg.cancel_scope.cancel()

                tg.start_soon(wait_one)
        if not exits:  # no processes: nothing can exit
            await anyio.sleep_forever()
        return exits[0]

    async def _wait_for(self, cmd: Command) -> Failure | None:
        deadline = time.monotonic() + self.ctx.wait_timeout_s
        pending = list(cmd.wait_for)
        while pending:
            pending = [a for a in pending if not await _accepts(a)]
            if not pending:
                return None
            if time.monotonic() > deadline:
                return Failure(
                    f"{cmd.name}: waited {self.ctx.wait_timeout_s:g}s for "
                    f"{', '.join(map(str, pending))} to accept connections; it never did"
                )
            await anyio.sleep(0.2)
        return None

    async def _await_health(self, engine: Engine) -> Failure | None:
        return await self._until_exit(self._poll_until_healthy, self._leader_url + engine.health_path)

    async def _recorded_and_healthy(self, url: str) -> Failure | None:
        """The record written while the engine loads, side by side: a record write is no reason to wait
        before the first probe, but a shard is not ready before it is on disk."""
        failures: list[Failure | None] = []
        async with anyio.create_task_group() as tg:

            async def record() -> None:
                failure = await self._save()
                if failure is not None:
                    failures.append(failure)
                    tg.cancel_scope.cancel()

            tg.start_soon(record)
            failures.append(await self._poll_until_healthy(url))
        return next((f for f in failures if f is not None), None)

    async def _poll_until_healthy(self, url: str) -> Failure | None:
        timeout = self.spec.profile.health_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            problem = await self.ctx.prober.check(url)
            if problem is None:
                return await self._port_owned()
            if time.monotonic() > deadline:
                return Failure(f"no health answer within {timeout:g} s from {url} (last: {problem})")
            await anyio.sleep(LOADING_PROBE_S)

    async def _port_owned(self) -> Failure | None:
        """None if the health answer came from the engine's own processes; else who answered.

        A process that held the port before the engine (or took it between the free-port check
        and the engine's bind) answers /health like an engine: without this check the shard was
        ready within 100 ms and the gateway sent users to the stranger."""
        host = urlsplit(self._leader_url).hostname or self.ctx.mgmt_addr
        pids = [p.pid for p in self.procs]
        held = await self.ctx.workers.files(ports.foreign, self.port, host, pids)
        return Failure(held) if held is not None else None

    async def _supervise(self, engine: Engine) -> Failure:
        url = self._leader_url + engine.health_path if engine.serves_http(self._spec_with_port()) else ""
        failure = await self._until_exit(self._watch, (engine, url))
        assert failure is not None
        return failure

    async def _watch(self, what: tuple[Engine, str]) -> Failure:
        """Health checks until they fail; meanwhile the engine's load, where it can be read."""
        engine, url = what
        metrics = LOAD_METRICS.get(engine.name)
        scraper = self.ctx.scraper
        if not url or metrics is None or scraper is None or self.ctx.load_interval_s <= 0:
            return await self._check_health(url)
        outcome: list[Failure] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_load, scraper, self._leader_url + engine.metrics_path, metrics)
            outcome.append(await self._check_health(url))
            tg.cancel_scope.cancel()
        return outcome[0]

    async def _read_load(self, scraper: Scraper, url: str, metrics: LoadMetrics) -> None:
        """Every load interval: the engine's load, published when it changed (so a shard's
        status is written at most once an interval, and not at all while its load holds)."""
        interval = self.ctx.load_interval_s
        next_read = next_tick(time.monotonic(), interval)
        while True:
            await anyio.sleep(max(0.0, next_read - time.monotonic()))
            next_read = next_tick(max(next_read, time.monotonic()), interval)
            text = await scraper.text(url)
            if text is None:
                continue
            load = await self.ctx.workers.files(parse_load, text, metrics, now())
            if load is not None and changed(self.load, load):
                self._publish_load(load)

    async def _check_health(self, url: str) -> Failure:
        """Every health interval: keep the logs bounded and (with a URL) probe; fails on repeated failures."""
        failures = 0
        interval = self.ctx.health_interval_s
        # Every shard of the node probes on the same beat (multiples of the interval on the
        # monotonic clock), not from the moment it went ready: the answers of a hundred
        # engines then come back in a few turns of the loop instead of a hundred wakes.
        next_check = next_tick(time.monotonic(), interval)
        while True:
            await anyio.sleep(max(0.0, next_check - time.monotonic()))
            next_check = next_tick(max(next_check, time.monotonic()), interval)
            await self._rotate_logs()
            if not url:
                continue
            problem = await self.ctx.prober.check(url)
            if problem is None:
                failures = 0
                continue
            failures += 1
            if failures >= HEALTH_FAILURES_TO_FAIL:
                return Failure(f"{url} failed {failures} health checks in a row (last: {problem})")

    async def _rotate_logs(self) -> None:
        for p in self.procs:
            try:
                size = p.log.stat().st_size  # a stat, not a read: cheap enough for the loop
            except OSError:
                continue
            if size > procs.LOG_LIMIT:
                await self.ctx.workers.files(procs.rotate_if_large, p.log)

    # --- stopping ------------------------------------------------------------------

    async def _kill_all(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period, reap."""
        with anyio.CancelScope(shield=True):
            live = await self.ctx.workers.files(_live, self.procs)
            for p in live:
                procs.signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.ctx.stop_grace_s
            while time.monotonic() < deadline and await self.ctx.workers.files(_any_lingers, live):
                await anyio.sleep(0.05)
            for p in await self.ctx.workers.files(_lingering, live):
                log.warning(
                    "shard %s: %s ignored SIGTERM for %gs; SIGKILL",
                    self.key,
                    p.name,
                    self.ctx.stop_grace_s,
                )
                procs.signal_group(p.pid, signal.SIGKILL)
            while await self.ctx.workers.files(_any_lingers, live):
                await anyio.sleep(0.05)
            if self._leader_url:
                await self.ctx.prober.forget(self._leader_url)

    async def terminate(self, publish: bool = True) -> None:
        """Stop the engine for good (the shard is no longer desired here)."""
        with anyio.CancelScope(shield=True):
            if publish:
                self._set("stopping")
            await self._kill_all()
            try:
                await self.ctx.records.remove(self.key)
            except RecordError as exc:
                # The engine is stopped; a stale record only makes a successor
                # find a dead process and drop it.
                log.warning("shard %s: %s", self.key, exc)
            if self._owns_port:
                self.ctx.release_port(self.port)
            self._release_extra_ports()
            if publish:
                self._set("stopped")


def next_tick(after: float, interval: float) -> float:
    """The first multiple of `interval` later than `after`."""
    return (math.floor(after / interval) + 1) * interval


async def _wait_exit(p: Proc) -> str:
    """Wait for `p` to end (a pidfd turning readable, or polling where there is none); how it ended."""
    try:
        fd = procs.pidfd(p.pid, 0 if p.child is not None else p.start_time)
    except procs.NoPidfd:
        while (reason := p.exit_reason()) is None:
            await anyio.sleep(EXIT_POLL_S)
        return reason
    if fd is not None:
        try:
            await anyio.wait_readable(fd)
        finally:
            os.close(fd)
    if p.child is None:
        # Adopted: not our child, so its exit status went to whoever reaped it.
        return f"{p.name} (pid {p.pid}) exited; an earlier launcher started it, so its exit status is unknown"
    # It has exited and is reaped here. The loop only guards against a kernel
    # that signals the pidfd a moment before waitpid can see the exit.
    while (reason := p.exit_reason()) is None:
        await anyio.sleep(0.01)
    return reason


def _live(ps: list[Proc]) -> list[Proc]:
    return [p for p in ps if p.exit_reason() is None or procs.group_alive(p.pid, p.start_time)]


def _lingering(ps: list[Proc]) -> list[Proc]:
    return [p for p in ps if _lingers(p)]


def _any_lingers(ps: list[Proc]) -> bool:
    return any(_lingers(p) for p in ps)


def _lingers(p: Proc) -> bool:
    if p.child is not None:
        p.child.poll()  # reap, so the group's leader is not a zombie forever
    return procs.group_alive(p.pid, p.start_time)


async def _accepts(addr: Address) -> bool:
    try:
        with anyio.fail_after(1):
            stream = await anyio.connect_tcp(addr.host, addr.port)
    except (OSError, TimeoutError):
        return False
    await stream.aclose()
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
