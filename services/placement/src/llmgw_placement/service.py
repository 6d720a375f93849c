"""The placement service: watch the cluster, hold the lease, run the control loop, serve the API.

Nothing the bus does ends this process. A control step that fails costs that
step and is retried with capped backoff; a lease that cannot be renewed is
retried; a lease taken by another process means standing by, then trying to
lead again. Faults are logged once per outage, not once per call.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import anyio
import anyio.abc
import msgspec
import nats.errors
from nats.aio.msg import Msg
from opentelemetry import trace

from llmgw_core.bus import Bus, KVChange
from llmgw_core.claims import Claims
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import (
    Demand,
    Deployment,
    DesiredEngines,
    Heartbeat,
    Liveness,
    NodeIntent,
    NodeStatus,
    ShardStatus,
    decoder,
    encode,
    now,
)
from llmgw_core.limits import key_problem
from llmgw_core.retry import Retry
from llmgw_core.subjects import ENGINES_KEY, ONE, Names
from llmgw_core.telemetry import current_traceparent
from llmgw_core.validate import check_deployment, check_profile

from .config import ServerConfig
from .controller import ClusterState, Controller
from .demand import DemandBook, engine_demand
from .desired import PlacementFile, file_difference, last_good, placement_file
from .lease import Lease, LeaseLost
from .liveness import clock_turn
from .metrics import PlacementMetrics
from .view import ClusterView

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

T = TypeVar("T", bound=msgspec.Struct)

# A control loop that waits longer than this past its deadline was stalled: the
# heartbeats it should have heard are still queued, so silence is not judged for it.
STALL_S = 0.5
# No stall for this long: placement has caught up.
CAUGHT_UP_S = 10.0
# The pause after a failed control step, growing to the cap.
BACKOFF_FIRST_S = 0.2
BACKOFF_CAP_S = 5.0
# How often each placement says what its server.yaml would seed, and after how long
# without a word another placement's file is forgotten (it left).
FILE_EVERY_S = 10.0
FILE_FORGOTTEN_S = 3.5 * FILE_EVERY_S


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
        # Overload: whether this placement is behind now, and how often its loop stalled.
        self.behind = False
        self.stalls = 0
        self._last_stall = 0.0
        self.invalid_inputs = 0
        # "<bucket>/<key>" -> why its stored value is refused and what placement keeps instead.
        self.held: dict[str, str] = {}
        # What this placement's server.yaml would seed, and other placements' files, as each
        # last said (and when, time.monotonic()).
        self.file = placement_file(self.identity, config)
        self.files: dict[str, tuple[PlacementFile, float]] = {}
        self._file_asked = anyio.Event()
        self._wake = anyio.Event()
        # The gateways' demand, heard by every placement (a new leader has its history).
        self.demand = DemandBook(
            started=time.monotonic(), stale_intervals=config.autoscaler.demand_stale_intervals
        )
        self.metrics = PlacementMetrics()
        self.metrics.watch(self)

    def wake(self) -> None:
        self._wake.set()

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
        if not self.bus.connected or self.bus.nc.is_closed:
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
        return ""

    def warnings(self) -> list[str]:
        """What an operator should know: another placement with a different server.yaml, and
        keys whose stored value is refused."""
        at = time.monotonic()
        out = []
        for name in sorted(self.files):
            theirs, heard = self.files[name]
            difference = file_difference(self.file, theirs) if at - heard < FILE_FORGOTTEN_S else None
            if difference:
                out.append(difference)
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
        writes += [(names.catalog_bucket, p.name, p.wire()) for p in self.config.catalog]
        writes += [(names.deployments_bucket, d.name, d.wire()) for d in self.config.deployments]
        seeded = []
        for bucket, key, value in writes:
            # Revision 0: only a key with no message at all, not even a delete marker.
            if await self.bus.update(bucket, key, value, last=0) is not None:
                seeded.append(f"{bucket}/{key}")
        if seeded:
            log.info("%s: seeded from server.yaml: %s", self.identity, ", ".join(seeded))

    async def _mirror(
        self,
        bucket: str,
        kind: type[T],
        target: dict[str, T],
        check: Callable[[str, T], str | None] | None = None,
    ) -> None:
        changes: AsyncIterator[KVChange[T]] = self.bus.watch(bucket, kind, undecodable=True)
        async for change in changes:
            problem: str | None = change.error or None  # one that does not decode: dead-lettered
            if problem is None and change.value is None:
                target.pop(change.key, None)
                if target is self.state.nodes:
                    # A node forgotten (`ctl delete node`): nothing of it is kept.
                    for heard in (
                        self.state.last_seen,
                        self.state.last_seen_wall,
                        self.state.installer_seen,
                        self.state.clock_offset,
                        self.state.clock_crossed,
                        self.state.first_known,
                    ):
                        heard.pop(change.key, None)
                    self.state.with_installer.discard(change.key)
                    self.state.clock_off.discard(change.key)
            elif problem is None and change.value is not None:
                problem = check(change.key, change.value) if check else None
                if problem is None:
                    target[change.key] = change.value
                    if target is self.state.nodes:
                        self.state.first_known.setdefault(change.key, time.monotonic())
                else:
                    await self.bus.dead_letter(
                        self.bus.names.kv_subject(bucket, change.key), encode(change.value), problem
                    )
            if self.held and problem is None:
                self.held.pop(f"{bucket}/{change.key}", None)  # a good value or a delete ends it
            if problem is not None:
                # The key keeps its last good value: a bad write changes nothing, and after a
                # restart (nothing in memory) that value is read from the key's history.
                self.invalid_inputs += 1
                restored = None
                if change.key not in target:
                    restored = await self._last_good(bucket, kind, change.key, change.revision, check)
                    if restored is not None:
                        target[change.key] = restored[1]
                if restored is not None:
                    kept = f"placement keeps revision {restored[0]}, the last good one"
                elif change.key in target:
                    kept = "placement keeps the value it had"
                else:
                    kept = "it has no earlier good value, so placement leaves the key out"
                where = f"{bucket}/{change.key}"
                self.held[where] = (
                    f"{where}: revision {change.revision} is refused ({problem[:300]}); {kept}; "
                    "write a good value or delete the key"
                )
                if restored is None:
                    continue
            if target is self.state.nodes or target is self.state.intents:
                self.state.nodes_version += 1
                self.state.dirty_nodes.add(change.key)
            self.wake()

    async def _last_good(
        self,
        bucket: str,
        kind: type[T],
        key: str,
        before: int,
        check: Callable[[str, T], str | None] | None,
    ) -> tuple[int, T] | None:
        """The newest revision of `key` older than `before` that decodes and passes `check`.
        Read again until NATS answers: leaving the key out would remove what ran."""
        dec = decoder(kind)

        def judge(data: bytes) -> T | str:
            try:
                value = dec.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return str(exc)
            problem = check(key, value) if check else None
            return value if problem is None else problem

        history: list[tuple[int, bytes | None]] = []

        async def read() -> None:
            history[:] = await self.bus.revisions(bucket, key)

        reading = Attempts(self.identity, f"reading the history of {bucket}/{key}")
        while not await reading.run(read):
            await anyio.sleep(reading.delay)
        return last_good([(rev, data) for rev, data in history if rev < before], judge)

    async def _files(self) -> None:
        """Say what this placement's server.yaml would seed, now and every FILE_EVERY_S (at
        once when another placement is first heard), and hear what the others say."""
        names = self.bus.names

        async def heard(theirs: PlacementFile, _subject: str) -> None:
            if theirs.placement == self.identity:
                return
            before = self.files.get(theirs.placement)
            self.files[theirs.placement] = (theirs, time.monotonic())
            if before is None:
                self._file_asked.set()  # so that it hears this one's without waiting
            if before is None or before[0].digest != theirs.digest:
                difference = file_difference(self.file, theirs)
                if difference:
                    log.warning("%s: %s", self.identity, difference)

        hearing = Attempts(self.identity, "hearing other placements' files")
        async with anyio.create_task_group() as tg:
            while True:
                try:
                    await tg.start(self.bus.subscribe_core, names.placement_file, PlacementFile, heard)
                    break
                except BusError as exc:
                    await anyio.sleep(hearing.failed(exc))
            hearing.succeeded()
            while True:
                self._file_asked = anyio.Event()
                try:
                    await self.bus.publish_core(
                        names.placement_file, msgspec.structs.replace(self.file, at=now())
                    )
                except BusError as exc:
                    log.debug("%s: could not say what its server.yaml seeds: %s", self.identity, exc)
                with anyio.move_on_after(FILE_EVERY_S):
                    await self._file_asked.wait()
                for name, (_, at) in list(self.files.items()):
                    if time.monotonic() - at > FILE_FORGOTTEN_S:
                        del self.files[name]

    async def _heartbeats(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        state = self.state

        async def seen(beat: Heartbeat, subject: str) -> None:
            # Only a time is recorded here, in the subscription's callback: no
            # queue to overflow, no log line per message. The node and the service
            # are the ones the subject names: nats-server lets each node's identity
            # publish only there, while the payload says whatever the sender wrote.
            _, _, node, service = subject.rsplit(".", 3)
            at = time.monotonic()
            if state.claims.beat(beat, node, service, at):
                # Two machines send this node's beats: said once per episode; `index` views
                # the node again, and nothing more is placed on it while it lasts.
                log.error(
                    "%s; nothing more is placed on it until one of them stops",
                    state.claims.claimed(node, at),
                )
                self.wake()
            if beat.standby:
                # An agent that waits while another instance works for the node runs
                # nothing: its beats say nothing about the node's engines.
                return
            wall = time.time()
            offset = beat.at - wall
            state.clock_offset[node] = offset
            was_off = node in state.clock_off
            off, crossed = clock_turn(
                offset, was_off, state.clock_crossed.get(node), at, 3 * self.config.heartbeat_interval_s
            )
            if crossed is None:
                state.clock_crossed.pop(node, None)
            else:
                state.clock_crossed[node] = crossed
            if off != was_off:
                # Said once when it starts and once when it ends: every time the node stamps
                # (its statuses, its probes) is off by this much.
                if was_off:
                    state.clock_off.discard(node)
                    log.warning("node %s: its clock agrees with placement's again (%+.1f s)", node, offset)
                else:
                    state.clock_off.add(node)
                    way = "ahead of" if offset > 0 else "behind"
                    log.warning(
                        "node %s: its clock is %.0f s %s placement's: the times it stamps are off by "
                        "as much (ages are computed from placement's clock); fix its time sync (NTP)",
                        node,
                        abs(offset),
                        way,
                    )
            if service == "installer":
                state.installer_seen[node] = at
                return
            if service == "launcher":
                state.with_installer.add(node)
            first = node not in state.last_seen
            state.last_seen[node] = at
            state.last_seen_wall[node] = wall
            missing = frozenset(beat.missing_models)
            if missing != state.missing_models.get(node, frozenset()):
                # The node lacks (or now has) a model file: its view changes, and a replica
                # that failed for want of it is placed elsewhere in the next step.
                state.missing_models[node] = missing
                state.dirty_nodes.add(node)
                first = True
            if first:
                self.wake()

        await self.bus.subscribe_core(self.bus.names.heartbeat_all, Heartbeat, seen, task_status=task_status)

    async def _demand(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hear every gateway's `Demand`. A report holding a request for a deployment wakes the
        control loop at once: a deployment at zero starts its first replica without waiting
        for the next step."""
        book, state = self.demand, self.state

        async def heard(report: Demand, subject: str) -> None:
            # The gateway is the one the subject names, whatever the payload says.
            gateway = subject.rsplit(".", 1)[-1]
            if report.gateway != gateway:
                report = msgspec.structs.replace(report, gateway=gateway)
            at = time.monotonic()
            book.heard(report, at)
            book.sample(at, engine_demand(state.shard_status))
            if any(d.queued for d in report.deployments):
                self.wake()

        await self.bus.subscribe_core(self.bus.names.demand(ONE), Demand, heard, task_status=task_status)

    async def _hearing(self) -> None:
        """Keep `state.heard_from`: since when this placement could hear every heartbeat.

        Reset by a reconnect (nothing was heard while away) and by a stall of
        this process's own loop (heartbeats queued unread); None while
        disconnected, so no node is declared lost for a silence that was ours.
        """
        tick = 0.1
        epoch = self.bus.reconnects
        expected = time.monotonic() + tick
        while True:
            await anyio.sleep(tick)
            at = time.monotonic()
            if not self.bus.connected:
                self.state.heard_from = None
            elif self.state.heard_from is None or self.bus.reconnects != epoch:
                epoch = self.bus.reconnects
                self.state.heard_from = at
                log.warning(
                    "%s: hearing the cluster again: every node gets a full node_timeout", self.identity
                )
            elif at - expected > STALL_S:
                self.state.heard_from = at
                self.stalls += 1
                if not self.behind:
                    log.warning(
                        "%s: placement is behind (its loop ran %.1f s late): every node gets a full "
                        "node_timeout until it catches up",
                        self.identity,
                        at - expected,
                    )
                self.behind = True
                self._last_stall = at
            elif self.behind and at - self._last_stall > CAUGHT_UP_S:
                self.behind = False
                log.warning("%s: placement caught up (%d stalls)", self.identity, self.stalls)
            expected = at + tick

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
        async def answer(msg: Msg) -> None:
            try:
                await msg.respond(encode(self.liveness()))
            except (nats.errors.Error, OSError) as exc:
                log.warning("%s: could not answer a liveness request: %s", self.identity, exc)

        listening = Attempts(self.identity, "answering liveness requests", known=(nats.errors.Error, OSError))
        while True:
            try:
                sub = await self.bus.nc.subscribe(
                    self.bus.names.liveness_request, queue="placement", cb=answer
                )
            except (nats.errors.Error, OSError) as exc:
                await anyio.sleep(listening.failed(exc))
                continue
            listening.succeeded()
            try:
                await anyio.sleep_forever()
            finally:
                with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        names = self.bus.names
        max_replicas = self.config.max_replicas
        async with anyio.create_task_group() as tg:
            await tg.start(self._heartbeats)
            await tg.start(self._demand)
            tg.start_soon(self._answer_liveness)
            tg.start_soon(self._hearing)
            tg.start_soon(self._files)
            tg.start_soon(self._mirror, names.nodes_bucket, NodeStatus, self.state.nodes, _check_node)
            tg.start_soon(self._mirror, names.catalog_bucket, Profile, self.state.catalog, check_profile)
            tg.start_soon(
                self._mirror, names.node_intent_bucket, NodeIntent, self.state.intents, _check_intent
            )
            tg.start_soon(
                self._mirror,
                names.deployments_bucket,
                Deployment,
                self.state.deployments,
                lambda key, dep: check_deployment(key, dep, max_replicas=max_replicas),
            )
            tg.start_soon(
                self._mirror,
                names.shard_status_bucket,
                ShardStatus,
                self.state.shard_status,
                _check_shard_status,
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
            while True:
                self._wake = anyio.Event()
                with self.metrics.step_seconds.time():
                    stepped = await steps.run(controller.step)
                if not stepped:
                    self.step_failures += 1
                    await anyio.sleep(steps.delay)
                    continue
                with anyio.move_on_after(interval):
                    await self._wake.wait()

    async def _take_over(self, controller: Controller) -> None:
        await self.seed()
        await controller.load()


class Attempts(Retry):
    """Runs one kind of attempt again and again: a failure costs that attempt, the delay
    before the next grows to a cap (llmgw_core.retry), and an outage is logged when it
    starts and ends, not at every try. A lost lease is no failure of the attempt: it
    ends leading, and propagates."""

    def __init__(self, who: str, what: str, known: tuple[type[BaseException], ...] = (BusError,)) -> None:
        super().__init__(log, f"{who}: {what}", base_s=BACKOFF_FIRST_S, cap_s=BACKOFF_CAP_S, known=known)

    async def run(self, call: Callable[[], Awaitable[None]]) -> bool:
        return await self.attempt(call, fatal=(LeaseLost,))


def _check_node(key: str, status: NodeStatus) -> str | None:
    problem = key_problem(key, "node")
    if problem is not None:
        return problem
    if status.node != key:
        return f"key {key} holds the status of node {status.node}: a node writes only its own key"
    return None


def _check_intent(key: str, intent: NodeIntent) -> str | None:
    if intent.node != key:
        return f"the key is {key} but the intent names node {intent.node}"
    return None


def _check_shard_status(key: str, status: ShardStatus) -> str | None:
    problem = key_problem(key, "node", "shard")
    if problem is not None:
        return problem
    if key != Names.shard_key(status.node, status.shard):
        return (
            f"key {key} holds the status of shard {status.node}.{status.shard}: "
            "a status is stored under its own key"
        )
    return None
