"""The launcher service: watch this node's shards in the bucket and keep them running.

One event loop serves every shard of the node, its heartbeat and its status
writes, so the node shares three things instead of each shard building its
own: one `HealthProber` (kept-alive connections), one `RecordWriter` (record
files written off the loop, coalesced) and one `StatusOutbox` (the statuses of
every shard that changed, coalesced and sent as one commit).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import anyio
import anyio.abc
import msgspec
import nats.errors
from nats.aio.msg import Msg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from llmgw_core.bus import Bus
from llmgw_core.claims import Holder, hold
from llmgw_core.config import AgentConfig
from llmgw_core.engines import (
    GPUInfo,
    ModelSource,
    Registry,
    ShardSpec,
    SourceError,
    default_registry,
    parse_source,
)
from llmgw_core.errors import BusError
from llmgw_core.events import (
    ShardLogs,
    ShardLogsRequest,
    ShardState,
    ShardStatus,
    WeightsEvicted,
    decoder,
    encode,
    now,
)
from llmgw_core.installed import installed
from llmgw_core.limits import key_problem
from llmgw_core.metrics import Collect, add_bus, counter, new_registry, serve_metrics
from llmgw_core.probe import Probe
from llmgw_core.redact import scrub, secret_values
from llmgw_core.retry import Retry
from llmgw_core.subjects import ONE

from . import procs
from .audit import Suspects, audit
from .health import HealthProber
from .load import Scraper
from .modelfiles import MissingModels, existing
from .outbox import StatusOutbox
from .peers import Peers
from .reconcile import diff
from .records import Records, RecordWriter
from .runner import Context, ShardRunner
from .weights import Eviction, Weights
from .workers import Workers

log = logging.getLogger("llmgw.launcher")

SHARD_STATES: tuple[str, ...] = get_args(ShardState)
# A health probe that gets no answer in this long counts as failed.
PROBE_TIMEOUT_S = 2.0
ENGINE_REFRESH_S = 5.0
# A logs reply stays under NATS's default max_payload (1 MiB), JSON escaping included.
LOGS_REPLY_BYTES = 900 * 1024
# This node's shard statuses are checked against what runs every this many heartbeat
# intervals (at least a second apart).
AUDIT_BEATS = 3
# The pause before watching the status bucket again after a failure, growing to the cap.
WATCH_RETRY_FIRST_S = 1.0
WATCH_RETRY_CAP_S = 30.0


@dataclass
class Handle:
    key: str
    spec: ShardSpec
    runner: ShardRunner
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    done: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False


def node_gpus(config: AgentConfig) -> list[GPUInfo]:
    if config.simulate is not None:
        return list(config.simulate.gpu_list())
    gpus, _, _ = Probe(config.node).gpus()
    return list(gpus)


def node_memory_mb(config: AgentConfig) -> int:
    """The host's memory as the node reports it (the simulated figure where one is set), what the
    launcher fits CPU profiles against, as placement does."""
    if config.simulate is not None and config.simulate.memory_mb:
        return config.simulate.memory_mb
    return Probe(config.node).memory_mb()


def registry_for(config: AgentConfig) -> Registry:
    """The adapters, pointed at the engines the operator configured on this node."""
    from llmgw_core.engines import VLLM, LlamaCpp, LlamaCppConfig, SGLang, SGLangConfig, VLLMConfig

    registry = default_registry()
    for name, engine in config.engines.items():
        if name == "vllm":
            # Ray's sessions under the node's own state dir, one directory per replica.
            ray_temp_root = os.path.join(os.path.abspath(config.state_dir), "ray")
            registry.add(
                VLLM(VLLMConfig(bin_dir=engine.path, multinode=engine.multinode, ray_temp_root=ray_temp_root))
            )
        elif name == "sglang":
            registry.add(SGLang(SGLangConfig(python=os.path.join(engine.path, "python"))))
        elif name == "llamacpp":
            adapter = LlamaCpp(LlamaCppConfig(bin_dir=engine.path))
            adapter.use_installed(engine.path)
            registry.add(adapter)
    return registry


def _process_logs(directory: Path) -> dict[str, Path]:
    """A shard's process logs by process name, in start order (`<index>-<name>.log`)."""
    found: list[tuple[int, str, Path]] = []
    with contextlib.suppress(OSError):
        for path in directory.glob("*.log"):
            index, _, name = path.stem.partition("-")
            if index.isdigit() and name:
                found.append((int(index), name, path))
    return {name: path for _, name, path in sorted(found)}


class Launcher:
    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        *,
        registry: Registry | None = None,
        gpus: list[GPUInfo] | None = None,
    ) -> None:
        self.config = config
        self.bus = bus
        self.node = config.node
        state_dir = Path(config.state_dir).resolve()
        state_dir.mkdir(parents=True, exist_ok=True)
        self.records = Records(state_dir)
        self.workers = Workers()
        self.writer = RecordWriter(self.records, self.workers)
        self.outbox = StatusOutbox(bus, self.node)
        self.prober = HealthProber(timeout_s=PROBE_TIMEOUT_S)
        self.scraper = Scraper(timeout_s=PROBE_TIMEOUT_S)
        self.handles: dict[str, Handle] = {}
        # Shards being stopped (no longer in `handles`): their statuses are theirs to remove.
        self._stopping: set[str] = set()
        self.desired: dict[str, ShardSpec] = {}
        # The status bucket's statuses of this node's shards, as its watch last said.
        self.stored: dict[str, ShardStatus] = {}
        # Statuses this launcher wrote again, or removed, because they were not what it runs.
        self.corrected = 0
        self._ports_in_use: set[int] = set()
        self._port_cursor: int | None = None  # where the next search for a free port starts
        self._tg: anyio.abc.TaskGroup | None = None
        self.metrics_port = 0
        # Restarts of shards that are no longer on this node: with those still here, a counter.
        self._restarts_gone = 0
        self.metrics_registry = new_registry("launcher")
        self.metrics_registry.register(Collect(self._metrics))
        add_bus(self.metrics_registry, bus)
        self._lock = anyio.Lock()
        self._changed = anyio.Event()  # set when `desired` changed since the last reconcile
        self._refreshed: dict[str, float] = {}
        # What this launcher's heartbeats say; the missing model files go out with each.
        self.holder: Holder | None = None
        self.missing_models = MissingModels(self._tell_missing)
        self.ctx = Context(
            node=self.node,
            state_dir=state_dir,
            registry=registry or registry_for(config),
            gpus=gpus if gpus is not None else node_gpus(config),
            records=self.writer,
            publish=self.outbox.push,
            prober=self.prober,
            allocate_port=self._allocate_port,
            release_port=self._ports_in_use.discard,
            mgmt_addr=config.mgmt_addr,
            stop_grace_s=config.stop_grace_s,
            wait_timeout_s=config.wait_timeout_s,
            backoff_s=config.restart_backoff_s,
            backoff_cap_s=config.restart_backoff_cap_s,
            health_interval_s=config.health_interval_s,
            engine_nice=config.engine_nice,
            refresh_engine=self._refresh_engine,
            workers=self.workers,
            load_interval_s=config.load_interval_s,
            scraper=self.scraper,
            publish_quietly=lambda status: self.outbox.push(status, event=False),
            weights=Weights(
                state_dir / "models",
                timeout_s=config.weights_timeout_s,
                budget_bytes=config.models_budget_bytes,
                in_use=self._sources_in_use,
                on_evict=self._evicted,
            ),
            model_missing=self.missing_models.add,
            memory_mb=node_memory_mb(config),
        )

        self.peers: Peers | None = None
        if config.weights_peers and self.ctx.weights is not None:
            self.peers = Peers(
                bus,
                self.node,
                state_dir / "models" / "blobs",
                config.mgmt_addr,
                port=config.weights_port,
                window_s=config.weights_peer_window_s,
                timeout_s=config.weights_timeout_s,
                rate_bytes_s=config.weights_serve_bytes_s,
            )
            self.ctx.weights.peers = self.peers

    def _sources_in_use(self) -> list[ModelSource]:
        """The weights every shard of this node wants, running or yet to start: never evicted."""
        specs = [h.spec for h in self.handles.values()] + list(self.desired.values())
        sources: list[ModelSource] = []
        for spec in specs:
            with contextlib.suppress(SourceError):
                source = parse_source(spec.profile.model, spec.profile.model_sha256)
                if source is not None:
                    sources.append(source)
        return sources

    def _evicted(self, eviction: Eviction) -> None:
        """A model evicted to make room, as a node event (the log said it already)."""
        event = WeightsEvicted(
            node=self.node,
            key=eviction.key,
            path=str(eviction.path),
            freed_bytes=eviction.freed,
            last_used_at=eviction.used_at,
            reason=eviction.words,
            at=now(),
        )

        async def send() -> None:
            try:
                await self.bus.publish(self.bus.names.node_weights(self.node), event)
            except BusError as exc:
                log.warning("cannot publish the eviction of %s: %s", eviction.key, exc)

        if self._tg is not None:
            self._tg.start_soon(send)

    async def _refresh_engine(self, name: str) -> None:
        """An engine the operator did not configure runs from the installer's build, once there is one.

        The installer's markers are files, read in a worker thread, at most once
        per ENGINE_REFRESH_S for each engine: fifty shards placed at once need
        one look, not fifty, and a build installed a moment ago is picked up by
        the next attempt at the latest.
        """
        if name in self.config.engines:
            return
        now = time.monotonic()
        if now - self._refreshed.get(name, -ENGINE_REFRESH_S) < ENGINE_REFRESH_S:
            return
        self._refreshed[name] = now
        build = (await self.workers.files(installed, self.config.state_dir)).get(name)
        if build is not None:
            self.ctx.registry.use_installed(name, build.bin_dir)

    # --- ports ---------------------------------------------------------------------

    def _allocate_port(self) -> int:
        """A port of the range that nothing listens on now. The search goes round the range
        from where the last one ended (first from a random place): a port just released is
        not handed out again at once, and launchers sharing one host (a test cluster, a
        simulated fleet) seldom race another process for the same port between this check
        and the engine's own bind."""
        low, high = self.config.port_range
        size = high - low + 1
        if self._port_cursor is None:
            self._port_cursor = random.randrange(size)
        for i in range(size):
            port = low + (self._port_cursor + i) % size
            if port in self._ports_in_use:
                continue
            with socket.socket() as s:
                # As every engine's server binds: a port whose last connections are in
                # TIME_WAIT is free to listen on, and without SO_REUSEADDR churn (engines
                # stopped and started again) made whole ranges look taken.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.config.mgmt_addr, port))
                except OSError:
                    continue
            self._ports_in_use.add(port)
            self._port_cursor = (port - low + 1) % size
            return port
        raise RuntimeError(f"no free port in {low}-{high} on {self.node}")

    # --- reconcile ------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await self.prober.aclose()
                await self.scraper.aclose()

    async def _run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        records, problems = await self.workers.files(self.records.load_all)
        for problem in problems:
            log.warning("%s", problem)
        overlap = ephemeral_overlap(self.config.port_range)
        if overlap:
            log.warning("%s", overlap)
        for key, record in records.items():
            self._ports_in_use.add(record.port)
            self.handles[key] = Handle(key, record.spec, ShardRunner(key, record.spec, self.ctx, record))
        pattern = self.bus.names.shard_key(self.node, ONE)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.outbox.run)
            # Heartbeats first; and while another launcher works for this node id (a second
            # machine given the same id), this one stands by here and runs nothing.
            self.holder = await tg.start(
                hold, self.bus, self.node, "launcher", self.config.heartbeat_interval_s
            )
            self._tell_missing(self.missing_models.paths())
            tg.start_soon(self._recheck_models)
            if self.peers is not None:
                # After the claim: a second machine given this id serves nothing in its name.
                await tg.start(self.peers.run)
            snapshot = await self.bus.entries(self.bus.names.shards_bucket, ShardSpec, pattern)
            self.desired = {
                k: c.value
                for k, c in snapshot.items()
                if c.value is not None and await self._acceptable(k, c.value)
            }
            await self.reconcile()
            tg.start_soon(self._audit_statuses)
            if self.config.launcher_metrics_port:
                self.metrics_port = await tg.start(
                    serve_metrics,
                    self.metrics_registry,
                    self.config.mgmt_addr,
                    self.config.launcher_metrics_port,
                )
            await tg.start(self._serve_logs)
            tg.start_soon(self._reconcile_on_change)
            task_status.started()
            # The watch only records what is desired and wakes the reconciler: specs that
            # arrive together are taken together, without a turn of the event loop between
            # them (on a saturated machine a turn takes a tenth of a second or more), and
            # are reconciled in one pass.
            async for change in self.bus.watch(self.bus.names.shards_bucket, ShardSpec, pattern):
                if change.value is None:
                    self.desired.pop(change.key, None)
                elif await self._acceptable(change.key, change.value):
                    self.desired[change.key] = change.value
                else:
                    continue
                self._changed.set()

    async def _acceptable(self, key: str, spec: ShardSpec) -> bool:
        """Whether a spec may run under `key`; one that may not is dead-lettered. The key names
        the shard's log and run directories and its record: one over the name limits (or not the
        spec's own NODE.SHARD) is never run, so it never reaches a path or a subject."""
        problem = key_problem(key, "node", "shard")
        if problem is None and key != self.bus.names.shard_key(spec.node, spec.shard):
            problem = (
                f"key {key} holds the spec of shard {spec.node}.{spec.shard}: "
                "a spec is stored under its own key"
            )
        if problem is None:
            return True
        await self.bus.dead_letter(
            self.bus.names.kv_subject(self.bus.names.shards_bucket, key), encode(spec), problem
        )
        return False

    async def _reconcile_on_change(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = anyio.Event()
            await self.reconcile()

    async def reconcile(self) -> None:
        async with self._lock:
            # A snapshot: the watch goes on changing `desired` while a stop is awaited here.
            desired = dict(self.desired)
            observed = {k: h.spec for k, h in self.handles.items()}
            d = diff(desired, observed)
            if d:
                log.info(
                    "reconcile %s: +%s -%s ~%s",
                    self.node,
                    list(d.added),
                    list(d.removed),
                    list(d.changed),
                )
            for key in d.removed:
                await self._stop(key)
            for key in d.changed:
                await self._stop(key)
                self._start(key, desired[key])
            for key in d.added:
                self._start(key, desired[key])
            # Adopted shards that are still desired as they are: supervise them.
            for handle in self.handles.values():
                if not handle.started:
                    self._launch(handle)

    def _start(self, key: str, spec: ShardSpec) -> None:
        handle = Handle(key, spec, ShardRunner(key, spec, self.ctx))
        self.handles[key] = handle
        self._launch(handle)

    def _launch(self, handle: Handle) -> None:
        assert self._tg is not None
        handle.started = True

        async def run() -> None:
            try:
                with handle.scope:
                    await handle.runner.run()
            except Exception:
                # The runner contains its own faults; this is a last line, so
                # that one shard's bug can never take the node's others with it.
                log.exception("shard %s: its runner stopped with an error", handle.key)
            finally:
                handle.done.set()

        self._tg.start_soon(run, name=f"shard {handle.key}")

    async def _stop(self, key: str) -> None:
        handle = self.handles.pop(key)
        self._stopping.add(key)
        try:
            self._restarts_gone += handle.runner.restarts
            handle.scope.cancel()
            if handle.started:
                await handle.done.wait()
            await handle.runner.terminate()
        finally:
            self._stopping.discard(key)

    # --- the status bucket against what runs --------------------------------------------

    async def _follow_statuses(self) -> None:
        """Keep `stored` as the status bucket says, for this node's keys; a failure to watch
        (an auth.conf older than this rule refuses it) is said and retried with backoff."""
        retry = Retry(
            log,
            f"{self.node}: reading back this node's shard statuses",
            base_s=WATCH_RETRY_FIRST_S,
            cap_s=WATCH_RETRY_CAP_S,
            known=(BusError,),
        )
        while True:
            try:
                async for change in self.bus.watch(
                    self.bus.names.shard_status_bucket, ShardStatus, self.bus.names.shard_key(self.node, ONE)
                ):
                    retry.succeeded()
                    if change.value is None:
                        self.stored.pop(change.key, None)
                    else:
                        self.stored[change.key] = change.value
            except BusError as exc:
                retry.failed(
                    f"{exc}; statuses another machine wrote are not corrected until it can "
                    "(`llmgw auth init` writes the rule)"
                )
            except Exception as exc:  # a fault costs this watch, never the launcher
                retry.failed(exc)
            # A watch that ended on its own (it is not meant to) is started again after a pause.
            await anyio.sleep(retry.delay or WATCH_RETRY_FIRST_S)

    def _tell_missing(self, paths: tuple[str, ...]) -> None:
        if paths:
            log.warning("%s: model files missing here: %s", self.node, ", ".join(paths))
        if self.holder is not None:
            self.holder.missing_models = paths

    async def _recheck_models(self) -> None:
        """Every heartbeat interval: forget the missing model files that are there now."""
        while True:
            await anyio.sleep(self.config.heartbeat_interval_s)
            paths = self.missing_models.paths()
            if not paths:
                continue
            try:
                present = await self.workers.files(existing, paths)
            except Exception:  # a fault costs this pass, never the launcher
                log.exception("%s: checking the missing model files failed; trying again", self.node)
                continue
            self.missing_models.found(present)

    async def _audit_statuses(self) -> None:
        """Every few heartbeats: write again each status the bucket holds that this launcher's
        runner did not last publish, and remove those of shards it does not run (see `audit`)."""
        interval = max(1.0, AUDIT_BEATS * self.config.heartbeat_interval_s)
        suspects: Suspects = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow_statuses)
            while True:
                await anyio.sleep(interval)
                try:
                    suspects = self._correct(suspects)
                except Exception:  # a fault costs this pass, never the launcher
                    log.exception("%s: checking the shard statuses failed; trying again", self.node)
                    suspects = {}

    def _correct(self, suspects: Suspects) -> Suspects:
        """One audit: queue the corrections it confirms; returns what the next one checks again."""
        mine: dict[str, ShardStatus | None] = {k: h.runner.status for k, h in self.handles.items()}
        mine.update(dict.fromkeys(self._stopping))
        fix, suspects = audit(self.stored, mine, suspects)
        for key in fix.rewrite:
            status = mine[key]
            assert status is not None
            had = self.stored.get(key)
            log.warning(
                "shard %s: the status bucket says %s; writing what this launcher runs: %s%s",
                key,
                _said(had),
                status.state,
                f" at port {status.port}" if status.port else "",
            )
            self.outbox.push(status)
        for key in fix.remove:
            had = self.stored[key]
            log.warning(
                "shard %s: the status bucket says %s, but this launcher does not run it; removing it",
                key,
                _said(had),
            )
            self.outbox.push(
                msgspec.structs.replace(
                    had,
                    state="stopped",
                    reason=f"not run by the launcher of {self.node}",
                    pids=(),
                    url="",
                    at=now(),
                )
            )
        self.corrected += len(fix.rewrite) + len(fix.remove)
        return suspects

    async def stop_all(self) -> None:
        """Stop every engine on this node (not what stopping the agent does)."""
        async with self._lock, anyio.create_task_group() as tg:
            for key in sorted(self.handles):
                tg.start_soon(self._stop, key)
        await self.outbox.flush()

    # --- logs on request ------------------------------------------------------------

    async def _serve_logs(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Answer `<prefix>.launcher.<node>.logs` requests until cancelled; a fault costs one reply."""
        subject = self.bus.names.launcher_logs(self.node)

        async def on_request(msg: Msg) -> None:
            try:
                reply = await self.shard_logs(msg.data)
            except Exception as exc:  # one bad request must not end the subscription
                log.exception("%s: cannot answer a logs request", subject)
                reply = ShardLogs(
                    node=self.node, shard="", error=f"launcher error: {type(exc).__name__}: {exc}"
                )
            try:
                await msg.respond(self._fit(reply))
            except (nats.errors.Error, OSError) as exc:
                log.warning("%s: cannot reply: %s", subject, exc)

        try:
            sub = await self.bus.nc.subscribe(subject, cb=on_request)
        except (nats.errors.Error, OSError) as exc:
            log.error("%s: cannot answer logs requests: %s", subject, exc)
            task_status.started()
            return
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()

    def _fit(self, reply: ShardLogs) -> bytes:
        """The reply encoded, its oldest lines dropped until it fits one NATS message."""
        limit = min(LOGS_REPLY_BYTES, int(self.bus.nc.max_payload or LOGS_REPLY_BYTES) - 4096)
        data = encode(reply)
        while len(data) > limit and reply.lines:
            reply = msgspec.structs.replace(reply, lines=reply.lines[max(1, len(reply.lines) // 10) :])
            data = encode(reply)
        return data

    async def shard_logs(self, data: bytes) -> ShardLogs:
        """The reply to one logs request: the lines of one of a shard's processes on this node."""
        try:
            request = decoder(ShardLogsRequest).decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return ShardLogs(node=self.node, shard="", error=f"not a logs request: {exc}")
        key = self.bus.names.shard_key(self.node, request.shard)
        handle = self.handles.get(key)
        if handle is None:
            here = sorted(h.spec.shard for h in self.handles.values())
            return ShardLogs(
                node=self.node,
                shard=request.shard,
                error=f"no shard {request.shard} on node {self.node} "
                f"(its shards: {', '.join(here) or 'none'})",
            )
        logs = await self.workers.files(_process_logs, self.ctx.state_dir / "logs" / key)
        names = tuple(logs)
        if not names:
            return ShardLogs(
                node=self.node, shard=request.shard, error=f"shard {request.shard} has no logs yet"
            )
        process = request.process or names[-1]
        path = logs.get(process)
        if path is None:
            return ShardLogs(
                node=self.node,
                shard=request.shard,
                processes=names,
                error=f"shard {request.shard} has no process {process!r} (its processes: {', '.join(names)})",
            )
        start = request.offset if request.offset >= 0 else 0
        lines, offset = await self.workers.files(procs.read_from, path, start, LOGS_REPLY_BYTES)
        if request.offset < 0 and request.tail:
            lines = lines[-request.tail :]
        # An engine may print its environment: the secrets in it are not for the reader.
        secrets = secret_values(handle.spec.profile.env, self.ctx.environ)
        return ShardLogs(
            node=self.node,
            shard=request.shard,
            process=process,
            processes=names,
            lines=tuple(scrub(line, secrets) for line in lines),
            offset=offset,
        )

    def _metrics(self) -> Iterator[Metric]:
        states: Counter[str] = Counter(h.runner.state for h in self.handles.values())
        shards = GaugeMetricFamily(
            "llmgw_launcher_shards",
            "Shards on this node by state (every state, 0 included).",
            labels=["state"],
        )
        for state in SHARD_STATES:
            shards.add_metric([state], states[state])
        yield shards
        yield counter(
            "llmgw_launcher_restarts",
            "Restarts of shards by this launcher (an adopted shard brings the restarts it had).",
            self._restarts_gone + sum(h.runner.restarts for h in self.handles.values()),
        )
        yield counter("llmgw_launcher_health_probes", "Health probes sent to engines.", self.prober.probes)
        yield counter(
            "llmgw_launcher_health_probe_failures",
            "Health probes that got no 200 in time.",
            self.prober.failures,
        )
        yield counter(
            "llmgw_launcher_health_connections_opened",
            "Connections the health prober opened (kept alive between probes).",
            self.prober.connections_opened,
        )
        yield counter(
            "llmgw_launcher_record_writes",
            "Shard record writes that reached the disk (after coalescing).",
            self.writer.writes,
        )
        yield counter(
            "llmgw_launcher_status_batches", "Batches of shard statuses sent to the bus.", self.outbox.batches
        )
        yield counter("llmgw_launcher_statuses", "Shard statuses sent to the bus.", self.outbox.sent)
        yield counter(
            "llmgw_launcher_weights_served_bytes",
            "Bytes of staged weights this node sent to the cluster's other nodes.",
            self.peers.served_bytes if self.peers is not None else 0,
        )
        closed = CounterMetricFamily(
            "llmgw_launcher_weights_connections_closed",
            "Connections to the blob server this node closed: evicted (at the cap, the one that had "
            "waited longest for its request), refused (at the cap, every one sending: 503), "
            "timed_out (no whole request within the header timeout).",
            labels=["reason"],
        )
        for reason, n in sorted(self.peers.closed.items() if self.peers is not None else ()):
            closed.add_metric([reason], n)
        yield closed
        yield counter(
            "llmgw_launcher_statuses_corrected",
            "Shard statuses in the bucket written again or removed because they were not what this "
            "launcher runs (another machine with this node id wrote them, say).",
            self.corrected,
        )


def _said(status: ShardStatus | None) -> str:
    if status is None:
        return "nothing"
    port = f" at port {status.port}" if status.port else ""
    pids = f" (pids {', '.join(map(str, status.pids))})" if status.pids else ""
    return f"{status.state}{port}{pids}"


EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_overlap(port_range: tuple[int, int], source: Path = EPHEMERAL_PORTS) -> str | None:
    """Why engine ports from `port_range` may be found taken: the kernel hands the same ports to
    outgoing connections (a health probe's, a client's) as their local ends. None if they are apart."""
    try:
        low, high = map(int, source.read_text().split())
    except (OSError, ValueError):
        return None
    first, last = port_range
    if last < low or first > high:
        return None
    return (
        f"port_range {first}-{last} overlaps the ports the kernel gives outgoing connections "
        f"({low}-{high}, net.ipv4.ip_local_port_range): an engine can find its port held by one "
        "and fail to start; set a port_range outside it"
    )
