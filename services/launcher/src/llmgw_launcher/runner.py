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
from pathlib import Path
from typing import TypeVarTuple

import anyio
import msgspec
from opentelemetry import trace

from llmgw_core import failures
from llmgw_core.adapters import ServedAdapter
from llmgw_core.engines import Engine, ShardSpec
from llmgw_core.events import EngineLoad, ShardFailure, ShardState, ShardStatus, now
from llmgw_core.redact import scrub, secret_values
from llmgw_core.retry import Backoff
from llmgw_core.telemetry import context_from

from . import oom, procs
from .attempt import Attempt, Failure, Proc
from .context import Context
from .load import LOAD_METRICS, LoadMetrics, Scraper, changed, lora_in_use, parse_load
from .records import RecordError, ShardRecord
from .start import START, engine_for, healthy

Args = TypeVarTuple("Args")

log = logging.getLogger("llmgw.launcher")

tracer = trace.get_tracer("llmgw.launcher")

# Consecutive failed health checks, after a shard was ready, that fail it.
HEALTH_FAILURES_TO_FAIL = 3
LOG_LINES_IN_REASON = 10
# Where pidfds are missing, process exits are polled this often.
EXIT_POLL_S = 0.5


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
        self.owns_port = False
        # Ports the engine's own processes need beyond `port` (a Ray head's client
        # server): always this runner's, given back with every failed attempt.
        self.extra_ports: tuple[int, ...] = ()
        self.leader_url = ""
        self._secret_values: list[str] | None = None
        # The engine's load as last published; only while ready.
        self.load: EngineLoad | None = None
        self._state_at = 0.0
        # The last status this runner published (None before its first): what the status
        # bucket should hold for this shard.
        self.status: ShardStatus | None = None
        # The profile's adapters this node refused, in words (`adapters.AdaptersHook`).
        self.adapters_refused: tuple[str, ...] = ()
        self.adapters_served: tuple[ServedAdapter, ...] = ()
        # An engine that loads adapters at run time: each staged adapter's path, by name
        # (`adapter_loads`).
        self.adapters_staged: dict[str, str] = {}
        # The adapters the engine last said have requests running or waiting (its LoRA gauge,
        # read with its load): never unloaded to make room (`adapter_loads.victim`).
        self.adapters_in_use: frozenset[str] = frozenset()

    # --- publishing ----------------------------------------------------------

    def _secrets(self) -> list[str]:
        """The secret values of the shard's environment, found once: the spec and the launcher's
        environment do not change under a runner, and matching every variable against the
        secret patterns at each status was a tenth of the launcher's time in a burst."""
        if self._secret_values is None:
            self._secret_values = secret_values(self.spec.profile.env, self.ctx.environ)
        return self._secret_values

    def set_state(self, state: ShardState, reason: str = "", retryable: bool = True) -> None:
        self.state = state
        if state != "ready":
            self.load = None
            self.adapters_in_use = frozenset()
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

    def publish_adapters(self, words: str) -> None:
        """The ready status again with the adapters its engine holds now, as an event too: an
        adapter loaded or unloaded is a change the operator follows (`adapter_loads`)."""
        status = msgspec.structs.replace(self._status("ready", words), at=self._state_at)
        self.status = status
        self.ctx.publish(status)

    def progress(self, state: ShardState, words: str) -> None:
        """How a long step of the current state goes (weights staged so far), in the status bucket
        only: `at` still dates the state, and the events carry only transitions."""
        status = msgspec.structs.replace(self._status(state, words), at=self._state_at)
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
            url=self.leader_url if state == "ready" else "",
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
            adapters_refused=self.adapters_refused,
            adapters=self.adapters_served,
            adapters_loadable=tuple(sorted(self.adapters_staged)),
        )
        return status

    async def save(self, ready: bool = False) -> Failure | None:
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
            self.set_state("failed", failures.text(self.last_failure), failure.retryable)
            if not failure.retryable:
                # Not worth retrying until the spec changes; a changed spec
                # replaces this runner.
                await anyio.sleep_forever()
            if self.owns_port:
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
            self.ctx.ports.release(port)
        self.extra_ports = ()

    def _release_port(self) -> None:
        self.ctx.ports.release(self.port)
        self.port = 0
        self.owns_port = False

    async def _adopt(self, record: ShardRecord) -> Failure:
        self.port = record.port
        # A port the spec did not name was picked from the range (the launcher counts it in
        # use at its start): released when the shard fails, so that a port another process
        # took meanwhile is not tried again and again.
        self.owns_port = bool(record.port) and not self.spec.port
        engine, failure = await engine_for(self)
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        self.leader_url = self.url() if engine.serves_http(self.spec) else ""
        dead = [r for p in self.procs if (r := p.exit_reason())]
        if dead or not self.procs:
            return await self.exit_failure(dead[0] if dead else "no processes were recorded")
        log.info("shard %s: adopted pids %s", self.key, [p.pid for p in self.procs])
        if engine.serves_http(self.spec_with_port()):
            # Recorded as ready is not ready: it must answer again before we say so.
            failure = await self._await_health(engine)
            if failure is not None:
                return failure
        self.set_state("ready")
        failure = await self.save(ready=True)
        if failure is not None:
            return failure
        return await self._supervise(engine)

    def spec_with_port(self) -> ShardSpec:
        return msgspec.structs.replace(self.spec, port=self.port, extra_ports=self.extra_ports)

    def url(self) -> str:
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
        """pending -> starting -> (waiting) -> (loading) -> ready: the start's hooks in order
        (see `start`); the engine, or why not."""
        self.procs = []
        self.set_state("pending")
        attempt = Attempt()
        for hook in START:
            failure = await hook.run(self, attempt)
            if failure is not None:
                return failure
        self.set_state("ready")
        failure = await self.save(ready=True)
        if failure is not None:
            return failure
        return attempt.need_engine()

    def first_exit(self) -> str | None:
        for p in self.procs:
            reason = p.exit_reason()
            if reason:
                return reason
        return None

    async def exit_failure(self, reason: str, proc: Proc | None = None) -> Failure:
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

    async def until_exit(
        self, work: Callable[[*Args], Awaitable[Failure | None]], *args: *Args
    ) -> Failure | None:
        """`work(*args)`'s outcome, unless one of the shard's processes exits first: then that exit's."""
        outcome: list[Failure | None] = []
        async with anyio.create_task_group() as tg:

            async def run_work() -> None:
                outcome.append(await work(*args))
                tg.cancel_scope.cancel()

            async def watch_exits() -> None:
                proc, reason = await self._any_exit()
                outcome.append(await self.exit_failure(reason, proc))
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

    async def _await_health(self, engine: Engine) -> Failure | None:
        return await self.until_exit(healthy, self, self.leader_url + engine.health_path)

    async def _supervise(self, engine: Engine) -> Failure:
        url = self.leader_url + engine.health_path if engine.serves_http(self.spec_with_port()) else ""
        failure = await self.until_exit(self._watch, engine, url)
        assert failure is not None
        return failure

    async def _watch(self, engine: Engine, url: str) -> Failure:
        """Health checks until they fail; meanwhile the engine's load, where it can be read."""
        metrics = LOAD_METRICS.get(engine.name)
        scraper = self.ctx.scraper
        if not url or metrics is None or scraper is None or self.ctx.load_interval_s <= 0:
            return await self._check_health(url)
        outcome: list[Failure] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._read_load, scraper, self.leader_url + engine.metrics_path, metrics)
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
            if metrics.lora and self.adapters_staged:
                names = frozenset(self.adapters_staged)
                in_use = await self.ctx.workers.files(lora_in_use, text, metrics.lora, names)
                self.adapters_in_use = in_use or frozenset()
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
            if self.leader_url:
                await self.ctx.prober.forget(self.leader_url)

    async def terminate(self, publish: bool = True) -> None:
        """Stop the engine for good (the shard is no longer desired here)."""
        with anyio.CancelScope(shield=True):
            if publish:
                self.set_state("stopping")
            await self._kill_all()
            try:
                await self.ctx.records.remove(self.key)
            except RecordError as exc:
                # The engine is stopped; a stale record only makes a successor
                # find a dead process and drop it.
                log.warning("shard %s: %s", self.key, exc)
            if self.owns_port:
                self.ctx.ports.release(self.port)
            self._release_extra_ports()
            if publish:
                self.set_state("stopped")


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
