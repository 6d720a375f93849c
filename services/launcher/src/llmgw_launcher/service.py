"""The launcher service: watch this node's shards in the bucket and keep them running.

One event loop serves every shard of the node, its heartbeat and its status
writes, so the node shares three things instead of each shard building its
own: one `HealthProber` (kept-alive connections), one `RecordWriter` (record
files written off the loop, coalesced) and one `StatusOutbox` (the statuses of
every shard that changed, coalesced and sent as one commit).

Each concern of the launcher is a member in a module named for it, started in
the launcher's task group: the status outbox (`outbox`), eviction notices
(`evictions`), the heartbeat claim, the weights peers (`peers`), the status audit
(`audit`), the metrics server (`metrics`) and the logs server (`logs`). The port
pool (`ports`), the installer's builds (`engines`) and the record writer
(`records`) are shared with every shard's runner through its `Context`; a
runner starts its shard with the hooks of `start`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc

from llmgw_core.bus import Bus, KVChange, require_streams
from llmgw_core.claims import Holder, hold
from llmgw_core.config import AgentConfig
from llmgw_core.engines import GPUInfo, ModelSource, Registry, ShardSpec, SourceError
from llmgw_core.errors import BusError
from llmgw_core.events import ShardStatus, encode
from llmgw_core.limits import key_problem
from llmgw_core.probe import Probe, with_mgmt_addr
from llmgw_core.subjects import ONE
from llmgw_core.topology import node_streams

from .adapter_loads import AdapterLoads
from .audit import StatusAudit
from .context import Context
from .desired import Desired
from .engines import InstalledBuilds, registry_for
from .evictions import Evictions
from .health import HealthProber
from .kv_relay import KVRelay
from .load import Scraper
from .logs import LogsServer
from .metrics import LauncherMetrics
from .modelfiles import MissingModels, existing
from .outbox import StatusOutbox
from .peers import Peers
from .ports import PortPool, ephemeral_overlap
from .reconcile import diff
from .records import Records, RecordWriter
from .runner import ShardRunner
from .weights import Weights
from .workers import Workers

log = logging.getLogger("llmgw.launcher")
# How long a fresh read's news is left to the watch before it counts as missed.
RESYNC_GRACE_S = 2.0

# A health probe that gets no answer in this long counts as failed.
PROBE_TIMEOUT_S = 2.0
# How long a launcher whose buckets came back after a lost store waits for the rest of them
# before saying again what runs here.
ANNOUNCE_WAIT_S = 30.0


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


@dataclass(frozen=True)
class EngineRelays:
    """What passes between its replicas' engines and the cluster besides health and load."""

    # LoRA adapters loaded into its replicas' engines when a gateway asks (vLLM, the sim).
    adapters: AdapterLoads
    # What its replicas' engines say they hold (vLLM's KV events), into the routing state.
    kv_events: KVRelay


class Launcher:
    """Keeps this node's shards as the shards bucket says: a runner per shard, reconciled as a
    diff (stop, replace, start), its members started in one task group (see the module)."""

    def __init__(
        self,
        config: AgentConfig,
        bus: Bus,
        *,
        registry: Registry | None = None,
        gpus: list[GPUInfo] | None = None,
    ) -> None:
        # Left out of agent.yaml, the node's address is found once, here: its engines, the
        # weights it serves and its port checks all use it (never loopback on a fleet).
        self.config = config = with_mgmt_addr(config)
        self.bus = bus
        state_dir = Path(config.state_dir).resolve()
        state_dir.mkdir(parents=True, exist_ok=True)
        self.records = Records(state_dir)
        self.workers = Workers()
        self.writer = RecordWriter(self.records, self.workers)
        self.outbox = StatusOutbox(bus, self.node)
        # The NATS store was lost and its buckets are back: say again at once what runs here.
        bus.losses.on_lost.append(self._announce)
        # Set while that is on its way: a spec gone with the store is acted on only after.
        self._announcing: anyio.Event | None = None
        self.prober = HealthProber(timeout_s=PROBE_TIMEOUT_S)
        self.handles: dict[str, Handle] = {}
        # Shards being stopped (no longer in `handles`): their statuses are theirs to remove.
        self._stopping: set[str] = set()
        self.desired = Desired()
        self.ports = PortPool(config.port_range, config.mgmt_addr, self.node)
        self.audit = StatusAudit(bus, self.node, self.outbox, self._mine, config.heartbeat_interval_s)
        self._tg: anyio.abc.TaskGroup | None = None
        self.evictions = Evictions(bus, self.node)
        self._lock = anyio.Lock()
        self._changed = anyio.Event()  # set when `desired` changed since the last reconcile
        # What this launcher's heartbeats say; the missing model files go out with each.
        self.holder: Holder | None = None
        self.missing_models = MissingModels(self._tell_missing)
        registry = registry or registry_for(config)
        self.engines = InstalledBuilds(registry, config.engines, config.state_dir, self.workers)
        self.ctx = Context(
            node=self.node,
            state_dir=state_dir,
            registry=registry,
            gpus=gpus if gpus is not None else node_gpus(config),
            records=self.writer,
            publish=self.outbox.push,
            prober=self.prober,
            ports=self.ports,
            mgmt_addr=config.mgmt_addr,
            stop_grace_s=config.stop_grace_s,
            wait_timeout_s=config.wait_timeout_s,
            backoff_s=config.restart_backoff_s,
            backoff_cap_s=config.restart_backoff_cap_s,
            health_interval_s=config.health_interval_s,
            engine_nice=config.engine_nice,
            refresh_engine=self.engines.refresh,
            workers=self.workers,
            load_interval_s=config.load_interval_s,
            scraper=Scraper(timeout_s=PROBE_TIMEOUT_S),
            publish_quietly=lambda status: self.outbox.push(status, event=False),
            weights=Weights(
                state_dir / "models",
                timeout_s=config.weights_timeout_s,
                budget_bytes=config.models_budget_bytes,
                in_use=self._sources_in_use,
                on_evict=self.evictions.tell,
            ),
            model_missing=self.missing_models.add,
            memory_mb=node_memory_mb(config),
        )
        self.logs = LogsServer(
            bus,
            self.node,
            state_dir / "logs",
            lambda: {k: h.spec for k, h in self.handles.items()},
            self.workers,
            self.ctx.environ,
        )
        self.relays = EngineRelays(
            AdapterLoads(bus, self.node, lambda: {k: h.runner for k, h in self.handles.items()}),
            KVRelay(
                bus,
                f"launcher-{self.node}",
                lambda: {k: h.runner.spec_with_port() for k, h in self.handles.items()},
            ),
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
        self.metrics = LauncherMetrics(
            bus,
            lambda: [h.runner for h in self.handles.values()],
            self.prober,
            self.writer,
            self.outbox,
            self.audit,
            self.peers,
        )

    @property
    def node(self) -> str:
        return self.config.node

    def _sources_in_use(self) -> list[ModelSource]:
        """The weights every shard of this node wants, running or yet to start: never evicted."""
        specs = [h.spec for h in self.handles.values()] + list(self.desired.specs.values())
        sources: list[ModelSource] = []
        for spec in specs:
            source = spec.profile.model_ref.source
            if source is not None:
                sources.append(source)
            # Its LoRA adapters' files too (one that cannot be staged is refused by its hook).
            for adapter in spec.profile.adapters:
                with contextlib.suppress(SourceError):
                    sources.append(adapter.model_source)
        return sources

    # --- reconcile ------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._run(task_status)
        finally:
            with anyio.CancelScope(shield=True):
                await self.prober.aclose()
                if self.ctx.scraper is not None:
                    await self.ctx.scraper.aclose()

    async def _run(self, task_status: anyio.abc.TaskStatus[None]) -> None:
        records, problems = await self.workers.files(self.records.load_all)
        for problem in problems:
            log.warning("%s", problem)
        overlap = ephemeral_overlap(self.config.port_range)
        if overlap:
            log.warning("%s", overlap)
        for key, record in records.items():
            self.ports.hold(record.port)
            self.handles[key] = Handle(key, record.spec, ShardRunner(key, record.spec, self.ctx, record))
        pattern = self.bus.names.shard_key(self.node, ONE)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.outbox.run)
            await tg.start(self.evictions.run)
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
            snapshot, _ = await self.bus.changes(self.bus.names.shards_bucket, ShardSpec, pattern)
            for change in snapshot.values():
                await self._take(change)
            await self.reconcile()
            tg.start_soon(self.audit.run)
            if self.config.launcher_metrics_port:
                await tg.start(self.metrics.run, self.config.mgmt_addr, self.config.launcher_metrics_port)
            await tg.start(self.logs.run)
            await tg.start(self.relays.adapters.run)
            await tg.start(self.relays.kv_events.run)
            tg.start_soon(self._reconcile_on_change)
            tg.start_soon(self._resync, pattern)
            task_status.started()
            # The watch only records what is desired and wakes the reconciler: specs that
            # arrive together are taken together, without a turn of the event loop between
            # them (on a saturated machine a turn takes a tenth of a second or more), and
            # are reconciled in one pass.
            async for change in self.bus.watch(self.bus.names.shards_bucket, ShardSpec, pattern):
                if change.value is None and change.revision == 0 and self._announcing is not None:
                    # Gone with the store, not deleted by placement: what runs is said first.
                    await self._announcing.wait()
                if await self._take(change):
                    self._changed.set()

    async def _take(self, change: KVChange[ShardSpec]) -> bool:
        """Record one change of a spec; whether what is desired changed (a spec that may not
        run here is dead-lettered and changes nothing, and one whose value did not decode keeps
        the key's last spec)."""
        if change.error:
            return False
        self.desired.heard(change.key, change.revision)
        if change.value is None:
            self.desired.specs.pop(change.key, None)
            return True
        if await self._acceptable(change.key, change.value):
            self.desired.specs[change.key] = change.value
            return True
        return False

    async def _resync(self, pattern: str) -> None:
        """Every `spec_resync_s` (jittered, so that a fleet's nodes do not read at once), this
        node's specs read afresh, and what the watch missed taken and said (`desired`)."""
        interval = self.config.spec_resync_s
        if not interval:
            return
        bucket = self.bus.names.shards_bucket
        while True:
            await anyio.sleep(interval * random.uniform(0.8, 1.2))
            try:
                fresh, through = await self.bus.changes(bucket, ShardSpec, pattern)
            except BusError as exc:
                log.warning(
                    "%s: reading its shard specs afresh failed (tried again in %.0f s): %s",
                    self.node,
                    interval,
                    exc,
                )
                continue
            if not self.desired.missed(fresh, through):
                continue
            # A change still on its way through the watch is no miss: what it has not brought
            # a moment later is.
            await anyio.sleep(RESYNC_GRACE_S)
            missed = self.desired.missed(fresh, through)
            if not missed:
                continue
            log.warning(
                "%s: the shard-spec watch missed %d change(s), taken from a fresh read of %s: %s",
                self.node,
                len(missed),
                bucket,
                ", ".join(
                    f"{c.key} {'deleted' if c.value is None else 'set'} at revision {c.revision}"
                    for c in missed
                ),
            )
            for change in missed:
                await self._take(change)
            self._changed.set()

    def _announce(self) -> None:
        """Each running shard's last status into the status bucket again (not as an event: no
        state changed), for a placement that read an emptied store and knew none of them."""
        if self._tg is None or self._announcing is not None:
            return  # not running yet (its first statuses are still to come), or on its way
        self._announcing = anyio.Event()
        self._tg.start_soon(self._announce_once_back, self._announcing)

    async def _announce_once_back(self, done: anyio.Event) -> None:
        """The hook fires when the first of this node's buckets is back; placement makes the
        others in turn, the status bucket perhaps a moment later. Said once they all are, and
        written before any spec gone with the store is acted on (the spec watch in `_run`): pushed while
        the bucket was still missing, `ready` was superseded by `stopping` and then the delete
        before either landed, and the rebuilt bucket's first word of the shard was its end."""
        try:
            try:
                await require_streams(self.bus, node_streams(self.bus.names), timeout=ANNOUNCE_WAIT_S)
            except BusError as exc:
                log.warning("%s: saying again what runs here anyway: %s", self.node, exc)
            for handle in list(self.handles.values()):
                status = handle.runner.status
                if status is not None and status.state != "stopped":
                    self.outbox.push(status, event=False)
            await self.outbox.flush()
        finally:
            self._announcing = None
            done.set()

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
            desired = dict(self.desired.specs)
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
            self.metrics.restarts_gone += handle.runner.restarts
            handle.scope.cancel()
            if handle.started:
                await handle.done.wait()
            await handle.runner.terminate()
        finally:
            self._stopping.discard(key)

    # --- missing model files, and what runs here --------------------------------------

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

    def _mine(self) -> dict[str, ShardStatus | None]:
        """Each shard this launcher runs, with the status its runner last published; each it is
        stopping, with None (its status is its own to remove)."""
        mine: dict[str, ShardStatus | None] = {k: h.runner.status for k, h in self.handles.items()}
        mine.update(dict.fromkeys(self._stopping))
        return mine

    async def stop_all(self) -> None:
        """Stop every engine on this node (not what stopping the agent does)."""
        async with self._lock, anyio.create_task_group() as tg:
            for key in sorted(self.handles):
                tg.start_soon(self._stop, key)
        await self.outbox.flush()
