"""A shard's start as hooks, run in order: validate, model, weights, adapters, ports, spawn, health.

Each hook has one job and one method: `run(runner, attempt)` returns None to go on, or
the `Failure` that ends the attempt (the runner then stops what was started and retries
with backoff where the failure allows). What a hook learns for the hooks after it (the
engine, the model's path) goes on the `Attempt`. The runner owns the shard's state (its
port, processes, statuses, record); the hooks act through it.

    validate -> model -> weights -> adapters -> ports -> spawn -> health    (then ready)
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import msgspec

from llmgw_core import fit, staged
from llmgw_core.engines import (
    Address,
    Command,
    Engine,
    SourceError,
    UnknownEngineError,
    extra_ports_needed,
)

from . import oom, ports, procs
from .adapters import AdaptersHook
from .attempt import Attempt, Failure, Proc, Runner, StartHook, bounded
from .weights import WeightsError

# While an engine loads, its health is probed this often: the delay it adds to "ready".
LOADING_PROBE_S = 0.1
# While a command waits for an address to accept connections, it is tried this often.
WAIT_FOR_PROBE_S = 0.2


async def engine_for(runner: Runner) -> tuple[Engine | None, Failure | None]:
    """The adapter of the shard's engine (pointed at the installer's build, if any)."""
    await runner.ctx.refresh_engine(runner.spec.profile.engine)
    try:
        return runner.ctx.registry.get(runner.spec.profile.engine), None
    except UnknownEngineError as exc:
        return None, Failure(str(exc), retryable=False)


class ValidateHook:
    """The engine exists here and accepts the profile on these GPUs; else not worth retrying."""

    name = "validate"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        engine, failure = await engine_for(runner)
        if failure is not None or engine is None:
            return failure or Failure("no engine")
        attempt.engine = engine
        problems = engine.validate(runner.spec.profile, runner.ctx.gpus, runner.spec)
        if problems:
            return Failure("; ".join(problems), retryable=False)
        return None


class ModelHook:
    """The file the node must already hold for the profile, if it does not: found before any
    engine starts, since an engine that cannot open its model exits, is restarted, and exits
    again forever; and told to the node, whose heartbeats keep placement from sending the
    profile here again until the file is there."""

    name = "model"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        path = runner.spec.profile.node_file
        if not path or await runner.ctx.workers.files(os.path.exists, path):
            return None
        runner.ctx.model_missing(path)
        return Failure(f"model file not found: {path}", retryable=False)


class WeightsHook:
    """The path the engine reads the weights at: the node's staged copy when `model` names a
    source, waited for with its progress as the shard's status; else `model_path` as given."""

    name = "weights"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        profile = runner.spec.profile
        attempt.model_path = profile.model_path
        try:
            source = profile.source
        except SourceError as exc:
            return Failure(str(exc), retryable=False)
        if source is None:
            return None
        if runner.ctx.weights is None:
            return Failure(f"profile {profile.name}: this node stages no weights", retryable=False)
        first = True

        def report(words: str) -> None:
            nonlocal first
            if first:
                first = False
                runner.set_state("waiting", words)
            else:
                runner.progress("waiting", words)

        try:
            path = await runner.ctx.weights.stage(source, report)
        except WeightsError as exc:
            return Failure(exc.reason, retryable=exc.retryable)
        if source.kind != "file":
            too_big = await runner.ctx.workers.files(fits, runner, path)
            if too_big:
                # Placement fits a model only once some node reported its shape, so the first
                # replica of a new model comes here unchecked: started, its engine would fail
                # to allocate in its own words (and be restarted). The node reports the shape
                # it just recorded, and placement refuses it for the profile in these words.
                # A hostile header fails here too: once, not retried, its words bounded.
                return Failure(bounded(too_big), retryable=False)
        attempt.model_path = str(path)
        return None


def fits(runner: Runner, view: Path) -> str | None:
    """Whether the staged model at `view` cannot fit the GPUs this shard is pinned to (or, for a
    CPU profile, the host's memory), by placement's own rule (`fit.check_shard`), or has a
    header that breaks its format or the bounds (`fit.HeaderError`); in a file thread, since
    it reads the shape kept beside the view (or, where none was kept, the header itself)."""
    profile = runner.spec.profile
    try:
        # Where no shape was kept: a model whose counts are missing (started unchecked, as
        # before), or a header that is broken or hostile, which no engine is started on.
        shape = staged.recorded_shape(view) or fit.read_shape(view)
    except fit.HeaderError as exc:
        return f"model {profile.weights_key}: {exc}; the file is broken or not a model: fix it at its source"
    except fit.FitError:
        return None
    gpus = [g for g in runner.ctx.gpus if g.index in runner.spec.gpus]
    try:
        return fit.check_shard(shape, profile, gpus, runner.ctx.memory_mb)
    except fit.FitError as exc:  # a figure no estimate can use (a context of 1e308 tokens)
        return f"model {profile.weights_key}: {exc}"


class PortsHook:
    """The shard's port (the spec's, or one of the range) and the extra ports its engine needs;
    refused while another process holds the port."""

    name = "ports"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        engine = attempt.need_engine()
        serves = engine.serves_http(runner.spec)
        if not runner.port and serves:
            runner.port = runner.spec.port or runner.ctx.ports.allocate()
            runner.owns_port = not runner.spec.port
        if not runner.extra_ports:
            runner.extra_ports = tuple(
                runner.ctx.ports.allocate() for _ in range(extra_ports_needed(engine, runner.spec))
            )
        runner.leader_url = runner.url() if serves else ""
        if serves:
            # An engine started on a port another process holds dies with "Address already in
            # use", and until it does the other process answers its health checks.
            held = await runner.ctx.workers.files(ports.held, runner.port, runner.spec.host)
            if held is not None:
                return Failure(held)
        return None


class SpawnHook:
    """The engine's commands, started in order; a command that waits for an address (a head
    node's) waits for it first, and a sidecar is on record before the next command starts."""

    name = "spawn"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        engine = attempt.need_engine()
        spec = runner.spec_with_port()
        if attempt.model_path != spec.profile.model_path:
            spec = msgspec.structs.replace(
                spec, profile=msgspec.structs.replace(spec.profile, model_path=attempt.model_path)
            )
        if attempt.adapters is not None:
            spec = msgspec.structs.replace(
                spec, profile=msgspec.structs.replace(spec.profile, adapters=attempt.adapters)
            )
        commands = engine.commands(spec, runner.ctx.environ)
        runner.set_state("starting")
        for i, cmd in enumerate(commands):
            if cmd.wait_for:
                runner.set_state("waiting", f"waiting for {', '.join(map(str, cmd.wait_for))}")
                failure = await runner.until_exit(wait_for, runner, cmd)
                if failure is not None:
                    return failure
            failure = await start(runner, cmd)
            if failure is None and i < len(commands) - 1:
                # A sidecar runs while the next command may wait: on disk first, so
                # that a launcher that dies meanwhile leaves it adoptable.
                failure = await runner.save()
            if failure is not None:
                return failure
        return None


async def start(runner: Runner, cmd: Command) -> Failure | None:
    """One of the engine's commands started, its log under the shard's log directory."""
    ctx = runner.ctx
    log_path = ctx.state_dir / "logs" / runner.key / f"{len(runner.procs)}-{cmd.name}.log"
    workdir = ctx.state_dir / "run" / runner.key
    attempt, nice = runner.restarts + 1, ctx.engine_nice
    try:
        # All of it in the spawning thread, the directories and the log included: on a
        # node whose disk is busy, creating a file can wait for the filesystem's journal.
        child, started = await ctx.workers.spawn(lambda: procs.spawn(cmd, log_path, workdir, attempt, nice))
    except OSError as exc:
        return Failure(f"cannot start {cmd.name} ({cmd.path}): {exc.strerror or exc}")
    memcg = await ctx.workers.files(oom.find, child.pid)
    runner.procs.append(Proc(cmd.name, child.pid, started, log_path, child, memcg))
    return None


async def wait_for(runner: Runner, cmd: Command) -> Failure | None:
    """None once every address `cmd` waits for accepts connections; a failure at the wait timeout."""
    timeout = runner.ctx.wait_timeout_s
    deadline = time.monotonic() + timeout
    pending = list(cmd.wait_for)
    while pending:
        pending = [a for a in pending if not await _accepts(a)]
        if not pending:
            return None
        if time.monotonic() > deadline:
            return Failure(
                f"{cmd.name}: waited {timeout:g}s for "
                f"{', '.join(map(str, pending))} to accept connections; it never did"
            )
        await anyio.sleep(WAIT_FOR_PROBE_S)
    return None


async def _accepts(addr: Address) -> bool:
    try:
        with anyio.fail_after(1):
            stream = await anyio.connect_tcp(addr.host, addr.port)
    except (OSError, TimeoutError):
        return False
    await stream.aclose()
    return True


class HealthHook:
    """An engine that serves HTTP is ready once it answers its health check from a socket of its
    own (its record written meanwhile); one that does not, once it is on record and still runs."""

    name = "health"

    async def run(self, runner: Runner, attempt: Attempt) -> Failure | None:
        engine = attempt.need_engine()
        if engine.serves_http(runner.spec):
            runner.set_state("loading")
            url = runner.leader_url + engine.health_path
            failure = await runner.until_exit(recorded_and_healthy, runner, url)
            if failure is not None:
                return failure
        else:
            failure = await runner.save()
            if failure is not None:
                return failure
            dead = runner.first_exit()
            if dead:
                return await runner.exit_failure(dead)
        await read_cgroups(runner)
        return None


async def recorded_and_healthy(runner: Runner, url: str) -> Failure | None:
    """The record written while the engine loads, side by side: a record write is no reason to wait
    before the first probe, but a shard is not ready before it is on disk."""
    failures: list[Failure | None] = []
    async with anyio.create_task_group() as tg:

        async def record() -> None:
            failure = await runner.save()
            if failure is not None:
                failures.append(failure)
                tg.cancel_scope.cancel()

        tg.start_soon(record)
        failures.append(await healthy(runner, url))
    return next((f for f in failures if f is not None), None)


async def healthy(runner: Runner, url: str) -> Failure | None:
    """None once `url` answers its health check from the engine's own socket; else why not, at the
    profile's health timeout."""
    timeout = runner.spec.profile.health_timeout_s
    deadline = time.monotonic() + timeout
    while True:
        problem = await runner.ctx.prober.check(url)
        if problem is None:
            return await port_owned(runner)
        if time.monotonic() > deadline:
            return Failure(f"no health answer within {timeout:g} s from {url} (last: {problem})")
        await anyio.sleep(LOADING_PROBE_S)


async def port_owned(runner: Runner) -> Failure | None:
    """None if the health answer came from the engine's own processes; else who answered.

    A process that held the port before the engine (or took it between the free-port check
    and the engine's bind) answers /health like an engine: without this check the shard was
    ready within 100 ms and the gateway sent users to the stranger."""
    host = urlsplit(runner.leader_url).hostname or runner.ctx.mgmt_addr
    pids = [p.pid for p in runner.procs]
    held = await runner.ctx.workers.files(ports.foreign, runner.port, host, pids)
    return Failure(held) if held is not None else None


async def read_cgroups(runner: Runner) -> None:
    """Each process's memory cgroup again, now that it runs: a wrapper (a script that enters
    a cgroup, `systemd-run --scope`, a container's shim) may have moved it since it started,
    and its OOM kills are counted where it is now."""
    for p in runner.procs:
        if p.child is not None:
            p.memcg = await runner.ctx.workers.files(oom.find, p.pid) or p.memcg


# The start, in order. A hook reads only what the hooks before it set on the `Attempt`.
START: tuple[StartHook, ...] = (
    ValidateHook(),
    ModelHook(),
    WeightsHook(),
    AdaptersHook(),
    PortsHook(),
    SpawnHook(),
    HealthHook(),
)
