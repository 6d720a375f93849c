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
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import (
    Deployment,
    DesiredEngines,
    Heartbeat,
    Liveness,
    NodeLiveness,
    NodeStatus,
    ShardStatus,
    encode,
    now,
)
from llmgw_core.telemetry import current_traceparent

from .checks import check_deployment, check_profile
from .config import ServerConfig
from .controller import ClusterState, Controller
from .lease import Lease, LeaseLost
from .metrics import PlacementMetrics

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

T = TypeVar("T", bound=msgspec.Struct)

# A control loop that waits longer than this past its deadline was stalled: the
# heartbeats it should have heard are still queued, so silence is not judged for it.
STALL_S = 0.5
# No stall for this long: placement has caught up.
CAUGHT_UP_S = 10.0
# The longest pause between failed control steps.
BACKOFF_CAP_S = 5.0


class PlacementService:
    def __init__(self, config: ServerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.state = ClusterState.empty()
        self.state.heard_from = time.monotonic()
        self.identity = config.identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.controller: Controller | None = None
        self.is_leader = False
        self.step_failures = 0
        # Overload: whether this placement is behind now, and how often its loop stalled.
        self.behind = False
        self.stalls = 0
        self._last_stall = 0.0
        self.invalid_inputs = 0
        self._wake = anyio.Event()
        self.metrics = PlacementMetrics()
        self.metrics.watch(self)

    def wake(self) -> None:
        self._wake.set()

    async def seed(self) -> None:
        """server.yaml's engines, catalog and deployments, for keys that have no value yet.

        What a user changed at runtime (a scale, a profile edit, a deletion
        followed by a re-create) is never rewritten from the file by a restart
        or a change of leader; `llmgw ctl apply -f server.yaml` writes the file
        on purpose.
        """
        names = self.bus.names
        with tracer.start_as_current_span("placement: desired engines"):
            desired = DesiredEngines(engines=self.config.engines, traceparent=current_traceparent())
            await self.bus.create(names.config_bucket, "engines", desired)
        for profile in self.config.catalog:
            await self.bus.create(names.catalog_bucket, profile.name, profile.wire())
        for dep in self.config.deployments:
            await self.bus.create(names.deployments_bucket, dep.name, dep.wire())

    async def _mirror(
        self,
        bucket: str,
        kind: type[T],
        target: dict[str, T],
        check: Callable[[str, T], str | None] | None = None,
    ) -> None:
        changes: AsyncIterator[KVChange[T]] = self.bus.watch(bucket, kind)
        async for change in changes:
            if change.value is None:
                target.pop(change.key, None)
            else:
                problem = check(change.key, change.value) if check else None
                if problem is not None:
                    # The key keeps its last good value: a bad write changes nothing.
                    self.invalid_inputs += 1
                    await self.bus.dead_letter(f"$KV.{bucket}.{change.key}", encode(change.value), problem)
                    continue
                target[change.key] = change.value
            if target is self.state.nodes:
                self.state.nodes_version += 1
                self.state.dirty_nodes.add(change.key)
            self.wake()

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
            if service == "installer":
                state.installer_seen[node] = time.monotonic()
                return
            first = node not in state.last_seen
            state.last_seen[node] = time.monotonic()
            state.last_seen_wall[node] = beat.at
            if first:
                self.wake()

        await self.bus.subscribe_core(self.bus.names.heartbeat_all, Heartbeat, seen, task_status=task_status)

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
        controller = self.controller or Controller(self.config, self.bus, self.state)
        state = self.state
        out = []
        for node in sorted(state.nodes):
            alive, silent = controller.alive(node, at)
            installer = state.installer_seen.get(node)
            out.append(
                NodeLiveness(
                    node=node,
                    alive=alive,
                    silent_s=round(silent, 1) if silent != float("inf") else -1.0,
                    installer_silent_s=round(at - installer, 1) if installer is not None else -1.0,
                )
            )
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

        while True:
            try:
                sub = await self.bus.nc.subscribe(
                    self.bus.names.liveness_request, queue="placement", cb=answer
                )
            except (nats.errors.Error, OSError) as exc:
                log.warning("%s: cannot answer liveness requests yet: %s", self.identity, exc)
                await anyio.sleep(1.0)
                continue
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
            tg.start_soon(self._answer_liveness)
            tg.start_soon(self._hearing)
            tg.start_soon(self._mirror, names.nodes_bucket, NodeStatus, self.state.nodes, _check_node)
            tg.start_soon(self._mirror, names.catalog_bucket, Profile, self.state.catalog, check_profile)
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
                await lease.acquire()
                try:
                    await self._lead(lease)
                except* LeaseLost as group:
                    log.error("%s; standing by", group.exceptions[0])
                finally:
                    self.is_leader = False

    async def _lead(self, lease: Lease) -> None:
        controller = Controller(
            self.config, self.bus, self.state, clock=time.monotonic, fence=lease.renew, metrics=self.metrics
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.hold)
            taking_over = Attempts(self.identity, "taking over")
            while not await taking_over.run(lambda: self._take_over(controller)):
                await anyio.sleep(taking_over.delay)
            self.controller = controller
            self.is_leader = True
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


class Attempts:
    """Runs one kind of attempt again and again: a failure costs that attempt, the delay
    before the next grows to a cap, and an outage is logged when it starts and ends,
    not at every try."""

    def __init__(self, who: str, what: str) -> None:
        self.who = who
        self.what = what
        self.delay = 0.0
        self.failing_since: float | None = None

    async def run(self, call: Callable[[], Awaitable[None]]) -> bool:
        try:
            await call()
        except (LeaseLost, anyio.get_cancelled_exc_class()):
            raise
        except Exception as exc:
            if self.failing_since is None:
                self.failing_since = time.monotonic()
                if isinstance(exc, BusError):
                    log.warning("%s: %s failed, retrying with backoff: %s", self.who, self.what, exc)
                else:
                    log.exception("%s: %s failed, retrying with backoff", self.who, self.what)
            self.delay = min(BACKOFF_CAP_S, max(0.2, self.delay * 2))
            return False
        if self.failing_since is not None:
            log.warning(
                "%s: %s works again after %.1f s", self.who, self.what, time.monotonic() - self.failing_since
            )
            self.failing_since = None
        self.delay = 0.0
        return True


def _check_node(key: str, status: NodeStatus) -> str | None:
    if status.node != key:
        return f"key {key} holds the status of node {status.node}: a node writes only its own key"
    return None


def _check_shard_status(key: str, status: ShardStatus) -> str | None:
    if key != f"{status.node}.{status.shard}":
        return (
            f"key {key} holds the status of shard {status.node}.{status.shard}: "
            "a status is stored under its own key"
        )
    return None
