"""The placement service: watch the cluster, hold the lease, run the control loop, serve the API.

Nothing the bus does ends this process. A control step that fails costs that
step and is retried with capped backoff; a lease that cannot be renewed is
retried; a lease taken by another process means standing by, then trying to
lead again. Faults are logged once per outage, not once per call.

A member per concern: `Mirror` (the buckets kept in memory, `mirror`), `Hearing`
(heartbeats, demand, whether placement is behind, `hearing`), `ServerFiles` (what each
placement's server.yaml would seed, `server_files`); each attempt retried by `Attempts`.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import uuid

import anyio
import anyio.abc
import msgspec
from opentelemetry import trace

from llmgw_core.bus import Bus, Lease, LeaseLost
from llmgw_core.claims import Claims
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import (
    Deployment,
    DesiredEngines,
    Liveness,
    NodeIntent,
    NodeStatus,
    ShardStatus,
    encode,
    now,
)
from llmgw_core.subjects import ENGINES_KEY
from llmgw_core.telemetry import current_traceparent
from llmgw_core.validate import check_deployment, check_profile

from . import judged
from .attempts import Attempts
from .config import ServerConfig
from .controller import ClusterState, Controller
from .demand import DemandBook
from .desired import placement_file
from .hearing import Hearing
from .judged import JudgedBook
from .metrics import PlacementMetrics
from .mirror import Mirror, check_intent, check_node, check_shard_status
from .server_files import ServerFiles
from .view import ClusterView

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

# How often a leader looks that every stream and bucket is still there (one request each).
STORE_LOOK_S = 5.0


class PlacementService:
    def __init__(self, config: ServerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.state = ClusterState.empty()
        self.state.heard_from = time.monotonic()
        self.state.claims = Claims(window=config.node_timeout_s)
        self.identity = config.identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.controller: Controller | None = None
        # What the API, the page and the metrics read: liveness, and what the leader holds.
        self.view = ClusterView(config, self.state, lambda: self.is_leader)
        # The lease this placement holds or waits for, and whether it took over with it.
        self.lease: Lease | None = None
        self._leading = False
        self.step_failures = 0
        self._wake = anyio.Event()
        # The gateways' demand, heard by every placement (a new leader has its history).
        self.demand = DemandBook(
            started=time.monotonic(), stale_intervals=config.autoscaler.demand_stale_intervals
        )
        # A member per concern: the buckets mirrored into `state` (and the values refused),
        # the heartbeats and demand heard (and whether this placement is behind), and what
        # each placement's server.yaml would seed.
        self.mirror = Mirror(bus, self.state, self.identity, self.wake)
        self.hearing = Hearing(config, bus, self.state, self.demand, self.identity, self.wake)
        # The gateways' judgements of replicas by their answers (`judged.py`), heard alike.
        self.judged = JudgedBook(stale_intervals=config.autoscaler.demand_stale_intervals)
        self.server_files = ServerFiles(bus, self.identity, placement_file(self.identity, config))
        # "<bucket>/<key>" -> why its stored value is refused and what placement keeps instead.
        self.held = self.mirror.held
        self.metrics = PlacementMetrics()
        self.metrics.watch(self)
        # When every stream was last seen there, and at which reconnect (`_rebuild`).
        self._store_seen_at = 0.0
        self._store_seen_epoch = -1

    def wake(self) -> None:
        self._wake.set()

    @property
    def behind(self) -> bool:
        """Whether this placement is behind now (its loop stalled lately): every node gets a
        full node_timeout until it catches up."""
        return self.hearing.behind

    @property
    def stalls(self) -> int:
        """How often this placement's loop stalled."""
        return self.hearing.stalls

    @property
    def invalid_inputs(self) -> int:
        """Bucket values refused (dead-lettered) since this placement started."""
        return self.mirror.invalid_inputs

    @property
    def is_leader(self) -> bool:
        """Whether this placement leads now: it took over, and it proved its lease within the
        last lease period. One cut off from NATS cannot know whether a standby took over
        since: once one may have, it stops saying it leads (its API, metrics, liveness)."""
        return self._leading and self.lease is not None and self.lease.proven()

    def leader(self) -> str:
        """Who leads, as far as this placement knows: itself, or who held the lease when it
        last read it ("" when nobody did)."""
        if self.is_leader:
            return self.identity
        return self.lease.seen_holder if self.lease is not None else ""

    def trouble(self) -> str:
        """Why this placement cannot do its work now ("" when it can): `/healthz` answers 503
        with it, so that a load balancer stops sending to this one."""
        if not self.bus.connected or self.bus.closed:
            return (
                f"placement {self.identity} cannot reach NATS at {self.bus.options.resolved_url()}: "
                "it can neither lead nor stand by until it does"
            )
        lease = self.lease
        if self._leading and lease is not None and not lease.proven():
            return (
                f"placement {self.identity} last renewed the placement lease "
                f"{time.monotonic() - lease.proved_at:.1f} s ago (lease period {lease.timeout:g} s): "
                "it does not lead until a renewal lands"
            )
        if not self._leading and lease is not None and lease.failing_for() > lease.timeout:
            # Connected to a server that cannot reach the majority: standing by in name only.
            return (
                f"placement {self.identity} has had no answer from NATS about the placement lease "
                f"for {lease.failing_for():.1f} s (lease period {lease.timeout:g} s): "
                "it can neither lead nor stand by until it does"
            )
        return ""

    def warnings(self) -> list[str]:
        """What an operator should know: a NATS store lost under the cluster, another placement
        with a different server.yaml, and keys whose stored value is refused."""
        lost = self.store_lost()
        out = [lost] if lost else []
        out += self.server_files.differences()
        out.extend(self.held[where] for where in sorted(self.held))
        return out

    async def seed(self) -> None:
        """server.yaml's engines, catalog and deployments, for keys that were never written.

        A key with any history is left alone, whichever placement's file names it:
        what a user changed at runtime (a scale, a profile edit) is never rewritten
        from a file, and what a user deleted stays deleted. (KV create succeeds over
        a delete marker: with it, a deleted deployment came back at the next take-over
        of any placement whose file named it.) `llmgw ctl apply -f server.yaml` writes
        the file on purpose.
        """
        names = self.bus.names
        with tracer.start_as_current_span("placement: desired engines"):
            desired = DesiredEngines(engines=self.config.engines, traceparent=current_traceparent())
            writes: list[tuple[str, str, msgspec.Struct]] = [(names.config_bucket, ENGINES_KEY, desired)]
        writes += [(names.catalog_bucket, p.name, p) for p in self.config.profiles().values()]
        writes += [(names.deployments_bucket, d.name, d.wire()) for d in self.config.deployments]
        seeded = []
        for bucket, key, value in writes:
            # Revision 0: only a key with no message at all, not even a delete marker.
            if await self.bus.update(bucket, key, value, last=0) is not None:
                seeded.append(f"{bucket}/{key}")
        if seeded:
            log.info("%s: seeded from server.yaml: %s", self.identity, ", ".join(seeded))

    def liveness(self) -> Liveness:
        """Every node as this placement judges it, for `llmgw ctl nodes` and the API."""
        at = time.monotonic()
        view = self.view
        state = self.state
        out = [view.liveness.judged(node, at) for node in sorted(state.nodes)]
        return Liveness(
            placement=self.identity,
            leader=self.is_leader,
            nodes=tuple(out),
            at=now(),
            cannot_write=self.cannot_write(),
        )

    def cannot_write(self) -> str:
        """Why this placement cannot act on what is written now, in one line; empty when it can.
        What it said when NATS refused its writes for space, until one lands again."""
        return self.bus.store.banner()

    async def _answer_liveness(self) -> None:
        async def answer(data: bytes) -> bytes:
            return encode(self.liveness())

        subject = self.bus.names.liveness_request
        listening = Attempts(self.identity, "answering liveness requests")
        while True:
            failed: BusError | None = None
            async with anyio.create_task_group() as tg:
                try:  # Bus.answer raises only before started, and then runs until cancelled
                    await tg.start(functools.partial(self.bus.answer, subject, answer, queue="placement"))
                except BusError as exc:
                    failed = exc
                else:
                    listening.succeeded()
            if failed is not None:
                await anyio.sleep(listening.failed(failed))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        names = self.bus.names
        max_replicas = self.config.max_replicas
        async with anyio.create_task_group() as tg:
            await tg.start(self.hearing.heartbeats)
            await tg.start(self.hearing.demand)
            await tg.start(judged.hear, self.bus, self.judged)
            tg.start_soon(self._answer_liveness)
            tg.start_soon(self.hearing.hearing)
            tg.start_soon(self.server_files.run)
            mirror = self.mirror.watch
            tg.start_soon(mirror, names.nodes_bucket, NodeStatus, self.state.nodes, check_node)
            tg.start_soon(mirror, names.catalog_bucket, Profile, self.state.catalog, check_profile)
            tg.start_soon(mirror, names.node_intent_bucket, NodeIntent, self.state.intents, check_intent)
            tg.start_soon(
                mirror,
                names.deployments_bucket,
                Deployment,
                self.state.deployments,
                lambda key, dep: check_deployment(key, dep, max_replicas=max_replicas),
            )
            tg.start_soon(
                mirror, names.shard_status_bucket, ShardStatus, self.state.shard_status, check_shard_status
            )
            task_status.started()
            while True:
                lease = Lease(
                    self.bus,
                    self.identity,
                    interval=self.config.heartbeat_interval_s,
                    timeout=self.config.node_timeout_s,
                )
                self.lease = lease
                await lease.acquire()
                try:
                    await self._lead(lease)
                except* LeaseLost as group:
                    log.error("%s; standing by", group.exceptions[0])
                finally:
                    self._leading = False

    async def _lead(self, lease: Lease) -> None:
        controller = Controller(
            self.config,
            self.bus,
            self.state,
            clock=time.monotonic,
            fence=lease.renew,
            metrics=self.metrics,
            demand=self.demand,
            judged=self.judged,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.hold)
            taking_over = Attempts(self.identity, "taking over")
            while not await taking_over.run(lambda: self._take_over(controller)):
                await anyio.sleep(taking_over.delay)
            self.controller = controller
            self.view.led(controller.held, controller.index)
            self._leading = True
            log.info("%s: active placement", self.identity)
            interval = min(self.config.heartbeat_interval_s, self.config.node_timeout_s / 4)
            steps = Attempts(self.identity, "control step")

            async def step() -> None:
                await self._rebuild()
                await controller.step()

            while True:
                self._wake = anyio.Event()
                with self.metrics.step_seconds.time():
                    stepped = await steps.run(step)
                if not stepped:
                    self._store_seen_at = 0.0  # a failed step looks at the store first
                    self.step_failures += 1
                    await anyio.sleep(steps.delay)
                    continue
                with anyio.move_on_after(interval):
                    await self._wake.wait()

    async def _rebuild(self, *, now: bool = False) -> None:
        """Make again every stream and bucket that is gone, with its configured limits, before
        this leader writes: after a reconnect (a server restarted on an emptied store), after a
        failed step, and every STORE_LOOK_S. A bucket made on first use took no atomic batch and
        no events stream came back: every commit failed while `/healthz` said leader."""
        epoch = self.bus.reconnects
        if (
            not now
            and epoch == self._store_seen_epoch
            and time.monotonic() - self._store_seen_at < STORE_LOOK_S
        ):
            return
        await self.bus.rebuild()
        self._store_seen_at = time.monotonic()
        self._store_seen_epoch = epoch

    def store_lost(self) -> str:
        """What this placement knows of a NATS store lost under it, in one line ("" if none)."""
        last = self.bus.losses.last
        return last.words() if last is not None else ""

    async def _take_over(self, controller: Controller) -> None:
        await self._rebuild(now=True)
        await self.seed()
        await controller.load()
