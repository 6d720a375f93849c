"""The placement service: watch the cluster, hold the lease, run the control loop, serve the API."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from typing import TypeVar

import anyio
import anyio.abc
import msgspec
from opentelemetry import trace

from llmgw_core.bus import Bus, KVChange
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, DesiredEngines, Heartbeat, NodeStatus, ShardStatus
from llmgw_core.telemetry import current_traceparent

from .config import ServerConfig
from .controller import ClusterState, Controller
from .lease import Lease, LeaseLost

log = logging.getLogger("llmgw.placement")
tracer = trace.get_tracer("llmgw.placement")

T = TypeVar("T", bound=msgspec.Struct)


class PlacementService:
    def __init__(self, config: ServerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.state = ClusterState.empty()
        self.identity = config.identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.controller: Controller | None = None
        self.is_leader = False
        self._wake = anyio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def seed(self) -> None:
        """server.yaml's engines, catalog and deployments into their buckets."""
        names = self.bus.names
        with tracer.start_as_current_span("placement: desired engines"):
            desired = DesiredEngines(engines=self.config.engines, traceparent=current_traceparent())
            current = await self.bus.get(names.config_bucket, "engines", DesiredEngines)
            # Rewritten only when the list changes: every installer reconverges on a write.
            if current is None or current[0].engines != desired.engines:
                await self.bus.put(names.config_bucket, "engines", desired)
        for profile in self.config.catalog:
            await self.bus.put(names.catalog_bucket, profile.name, profile.wire())
        for dep in self.config.deployments:
            await self.bus.put(names.deployments_bucket, dep.name, dep.wire())

    async def _mirror(self, bucket: str, kind: type[T], target: dict[str, T]) -> None:
        changes: AsyncIterator[KVChange[T]] = self.bus.watch(bucket, kind)
        async for change in changes:
            if change.value is None:
                target.pop(change.key, None)
            else:
                target[change.key] = change.value
            if target is self.state.nodes:
                self.state.nodes_version += 1
            self.wake()

    async def _heartbeats(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        async def seen(beat: Heartbeat, subject: str) -> None:
            # The node is the one the subject names: nats-server lets each node's identity
            # publish only there, while the payload's `node` is whatever the sender wrote.
            node = subject.split(".")[-2]
            first = node not in self.state.last_seen
            self.state.last_seen[node] = anyio.current_time()
            if first:
                self.wake()

        await self.bus.subscribe_core(self.bus.names.heartbeat_all, Heartbeat, seen, task_status=task_status)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        names = self.bus.names
        async with anyio.create_task_group() as tg:
            await tg.start(self._heartbeats)
            tg.start_soon(self._mirror, names.nodes_bucket, NodeStatus, self.state.nodes)
            tg.start_soon(self._mirror, names.catalog_bucket, Profile, self.state.catalog)
            tg.start_soon(self._mirror, names.deployments_bucket, Deployment, self.state.deployments)
            tg.start_soon(self._mirror, names.shard_status_bucket, ShardStatus, self.state.shard_status)
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
        await self.seed()
        controller = Controller(
            self.config, self.bus, self.state, clock=anyio.current_time, fence=lease.renew
        )
        await controller.load()
        self.controller = controller
        self.is_leader = True
        log.info("%s: active placement", self.identity)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lease.hold)
            interval = min(self.config.heartbeat_interval_s, self.config.node_timeout_s / 4)
            while True:
                self._wake = anyio.Event()
                try:
                    await controller.step()
                except BusError as exc:
                    log.warning("control step failed, retrying: %s", exc)
                except LeaseLost:
                    tg.cancel_scope.cancel()
                    raise
                with anyio.move_on_after(interval):
                    await self._wake.wait()
