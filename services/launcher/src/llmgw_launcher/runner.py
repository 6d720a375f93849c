"""One shard's life: validate, start its commands, health-check, restart with backoff, stop.

The runner publishes every state change through `Context.publish`. Cancelling
`run()` leaves the processes alone (the agent is stopping, the engine is not);
`terminate()` is what stops the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import msgspec
from opentelemetry import trace

from llmgw_core.engines import (
    Address,
    Command,
    Engine,
    GPUInfo,
    Registry,
    ShardSpec,
    UnknownEngineError,
)
from llmgw_core.events import ShardState, ShardStatus, now
from llmgw_core.redact import scrub, secret_values
from llmgw_core.telemetry import context_from

from . import procs
from .records import ProcRecord, Records, ShardRecord

log = logging.getLogger("llmgw.launcher")
tracer = trace.get_tracer("llmgw.launcher")

# Consecutive failed health checks, after a shard was ready, that fail it.
HEALTH_FAILURES_TO_FAIL = 3
LOG_LINES_IN_REASON = 10


@dataclass
class Context:
    """What every runner on a node shares."""

    node: str
    state_dir: Path
    registry: Registry
    gpus: list[GPUInfo]
    records: Records
    publish: Callable[[ShardStatus], Awaitable[None]]
    allocate_port: Callable[[], int]
    release_port: Callable[[int], None]
    mgmt_addr: str = "127.0.0.1"
    stop_grace_s: float = 10.0
    wait_timeout_s: float = 600.0
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    health_interval_s: float = 1.0
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # Points an adapter at the build the installer installed, if any.
    refresh_engine: Callable[[str], None] = lambda _name: None


@dataclass
class Failure:
    reason: str
    retryable: bool = True


@dataclass
class Proc:
    name: str
    pid: int
    start_time: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def exit_reason(self) -> str | None:
        """None while running; else how it ended."""
        if self.popen is not None:
            code = self.popen.poll()
            if code is None:
                return None
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
        self.port = adopt.port if adopt else 0
        self.state: ShardState = "pending"
        self._owns_port = False
        self._leader_url = ""

    # --- publishing ----------------------------------------------------------

    async def _set(self, state: ShardState, reason: str = "", retryable: bool = True) -> None:
        self.state = state
        # A reason may quote the engine's log, and an engine may print its environment.
        reason = scrub(reason, secret_values(self.spec.profile.env, self.ctx.environ))
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
        )
        log.info("shard %s: %s%s", self.key, state, f" ({reason})" if reason else "")
        await self.ctx.publish(status)

    def _save(self, ready: bool = False) -> None:
        self.ctx.records.save(
            ShardRecord(
                key=self.key,
                spec=self.spec,
                port=self.port,
                procs=tuple(p.record() for p in self.procs),
                restarts=self.restarts,
                ready=ready,
            )
        )

    # --- the life ---------------------------------------------------------------

    async def run(self) -> None:
        """Keep the shard running until cancelled; cancellation leaves processes running."""
        failure: Failure | None
        if self.adopt is not None:
            failure = await self._adopt(self.adopt)
            self.adopt = None
        else:
            failure = await self._attempt()
        while True:
            assert failure is not None
            await self._kill_all()
            await self._set("failed", failure.reason, failure.retryable)
            if not failure.retryable:
                # Not worth retrying until the spec changes; a changed spec
                # replaces this runner.
                await anyio.sleep_forever()
            if self._owns_port:
                # The port may be why it failed (another process took it): pick again.
                self.ctx.release_port(self.port)
                self.port = 0
                self._owns_port = False
            delay = min(self.ctx.backoff_cap_s, self.ctx.backoff_s * 2 ** min(self.restarts, 16))
            await anyio.sleep(delay)
            self.restarts += 1
            failure = await self._attempt()

    async def _adopt(self, record: ShardRecord) -> Failure:
        self.port = record.port
        engine, failure = self._engine()
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        self._leader_url = self._url() if engine.serves_http(self.spec) else ""
        dead = [r for p in self.procs if (r := p.exit_reason())]
        if dead or not self.procs:
            return self._exit_failure(dead[0] if dead else "no processes were recorded")
        log.info("shard %s: adopted pids %s", self.key, [p.pid for p in self.procs])
        if engine.serves_http(self._spec_with_port()):
            # Recorded as ready is not ready: it must answer again before we say so.
            failure = await self._await_health(engine)
            if failure is not None:
                return failure
        await self._set("ready")
        self._save(ready=True)
        return await self._supervise(engine)

    def _engine(self) -> tuple[Engine | None, Failure | None]:
        self.ctx.refresh_engine(self.spec.profile.engine)
        try:
            return self.ctx.registry.get(self.spec.profile.engine), None
        except UnknownEngineError as exc:
            return None, Failure(str(exc), retryable=False)

    def _spec_with_port(self) -> ShardSpec:
        return msgspec.structs.replace(self.spec, port=self.port)

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
        await self._set("pending")
        engine, failure = self._engine()
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        problems = engine.validate(self.spec.profile, self.ctx.gpus, self.spec)
        if problems:
            return Failure("; ".join(problems), retryable=False)
        serves = engine.serves_http(self.spec)
        if not self.port and serves:
            self.port = self.spec.port or self.ctx.allocate_port()
            self._owns_port = not self.spec.port
        spec = self._spec_with_port()
        self._leader_url = self._url() if serves else ""
        commands = engine.commands(spec, self.ctx.environ)
        await self._set("starting")
        for cmd in commands:
            if cmd.wait_for:
                await self._set("waiting", f"waiting for {', '.join(map(str, cmd.wait_for))}")
                failure = await self._wait_for(cmd)
                if failure is not None:
                    return failure
            failure = self._start(cmd)
            if failure is not None:
                return failure
        if serves:
            await self._set("loading")
            failure = await self._await_health(engine)
            if failure is not None:
                return failure
        else:
            dead = self._first_exit()
            if dead:
                return self._exit_failure(dead)
        await self._set("ready")
        self._save(ready=True)
        return engine

    def _start(self, cmd: Command) -> Failure | None:
        log_path = self.ctx.state_dir / "logs" / self.key / f"{len(self.procs)}-{cmd.name}.log"
        workdir = self.ctx.state_dir / "run" / self.key
        workdir.mkdir(parents=True, exist_ok=True)
        try:
            popen = procs.start(cmd, log_path, workdir)
        except OSError as exc:
            return Failure(f"cannot start {cmd.name} ({cmd.path}): {exc.strerror or exc}")
        started = procs.start_time(popen.pid) or 0
        self.procs.append(Proc(cmd.name, popen.pid, started, log_path, popen))
        self._save()
        return None

    def _first_exit(self) -> str | None:
        for p in self.procs:
            reason = p.exit_reason()
            if reason:
                return reason
        return None

    def _exit_failure(self, reason: str) -> Failure:
        for p in self.procs:
            if p.exit_reason() == reason:
                lines = procs.tail(p.log, LOG_LINES_IN_REASON)
                if lines:
                    return Failure(f"{reason}; last log lines:\n" + "\n".join(lines))
        return Failure(reason)

    async def _wait_for(self, cmd: Command) -> Failure | None:
        deadline = time.monotonic() + self.ctx.wait_timeout_s
        pending = list(cmd.wait_for)
        while pending:
            dead = self._first_exit()
            if dead:
                return self._exit_failure(dead)
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
        timeout = self.spec.profile.health_timeout_s
        deadline = time.monotonic() + timeout
        url = self._leader_url + engine.health_path
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            while True:
                dead = self._first_exit()
                if dead:
                    return self._exit_failure(dead)
                if await _healthy(client, url):
                    return None
                if time.monotonic() > deadline:
                    return Failure(f"{url} did not answer 200 within the {timeout:g}s health timeout")
                await anyio.sleep(0.1)

    async def _supervise(self, engine: Engine) -> Failure:
        serves = engine.serves_http(self._spec_with_port())
        url = self._leader_url + engine.health_path
        failures = 0
        next_check = time.monotonic() + self.ctx.health_interval_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as client:
            while True:
                dead = self._first_exit()
                if dead:
                    return self._exit_failure(dead)
                for p in self.procs:
                    procs.rotate_if_large(p.log)
                if serves and time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.ctx.health_interval_s
                    if await _healthy(client, url):
                        failures = 0
                    else:
                        failures += 1
                        if failures >= HEALTH_FAILURES_TO_FAIL:
                            return Failure(f"{url} failed {failures} health checks in a row")
                await anyio.sleep(0.1)

    async def _kill_all(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period, reap."""
        with anyio.CancelScope(shield=True):
            live = [p for p in self.procs if p.exit_reason() is None or procs.group_alive(p.pid)]
            for p in live:
                procs.signal_group(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.ctx.stop_grace_s
            while time.monotonic() < deadline and any(_lingers(p) for p in live):
                await anyio.sleep(0.05)
            for p in live:
                if _lingers(p):
                    log.warning(
                        "shard %s: %s ignored SIGTERM for %gs; SIGKILL",
                        self.key,
                        p.name,
                        self.ctx.stop_grace_s,
                    )
                    procs.signal_group(p.pid, signal.SIGKILL)
            while any(_lingers(p) for p in live):
                await anyio.sleep(0.05)

    async def terminate(self, publish: bool = True) -> None:
        """Stop the engine for good (the shard is no longer desired here)."""
        with anyio.CancelScope(shield=True):
            if publish:
                await self._set("stopping")
            await self._kill_all()
            self.ctx.records.remove(self.key)
            if self._owns_port:
                self.ctx.release_port(self.port)
            if publish:
                await self._set("stopped")


def _lingers(p: Proc) -> bool:
    if p.popen is not None:
        p.popen.poll()  # reap, so the group's leader is not a zombie forever
    return procs.group_alive(p.pid)


async def _accepts(addr: Address) -> bool:
    try:
        with anyio.fail_after(1):
            stream = await anyio.connect_tcp(addr.host, addr.port)
    except (OSError, TimeoutError):
        return False
    await stream.aclose()
    return True


async def _healthy(client: httpx.AsyncClient, url: str) -> bool:
    # vLLM binds its port before the model is loaded: a connection that
    # gets no answer is still loading, not ready.
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return False
    return response.status_code == 200


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
