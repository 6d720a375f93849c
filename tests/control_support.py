"""In-process placements and simulated fleets on a real NATS server, for control-plane fault tests.

Each placement and each fleet has a bus connection of its own, as separate
processes would; the tests break NATS itself (stop, restart, kill cluster
members), never a mock of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import msgspec
from nats.aio.msg import Msg

from llmgw.fleet import Fleet
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import ReplicaRecord
from llmgw_placement import PlacementService, ServerConfig
from tests.auth_support import session_for


def _insecure(url: str) -> bool:
    """A server a test started for itself has no identities; the session's has (its harness
    user's URL carries the password)."""
    return session_for(url.split(",")[0]) is None


TP1 = {"name": "tp1", "engine": "sim", "model_path": "sim://x", "gpu_class": "H100-80G", "tp": 1}


def server_config(url: str, prefix: str, **overrides: Any) -> ServerConfig:
    raw: dict[str, Any] = {
        "nats": {"url": url, "prefix": prefix, "insecure": _insecure(url)},
        "engines": [],
        "catalog": [TP1],
        "heartbeat_interval_s": 0.3,
        "node_timeout_s": 2.0,
    }
    raw.update(overrides)
    return msgspec.convert(raw, ServerConfig)


@dataclass
class Placement:
    """A placement service in its own cancel scope, so a test can stop it like a killed process."""

    service: PlacementService
    bus: Bus
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    crashed: BaseException | None = None

    def kill(self) -> None:
        self.scope.cancel()

    def steps(self) -> float:
        """Control steps this placement has finished, as its /metrics counts them (for `passes`)."""
        found = self.service.metrics.registry.get_sample_value("llmgw_placement_step_duration_seconds_count")
        return found or 0.0


@dataclass
class ControlPlane:
    tg: anyio.abc.TaskGroup
    url: str
    prefix: str
    placements: list[Placement] = field(default_factory=list)
    fleets: list[tuple[Fleet, anyio.CancelScope]] = field(default_factory=list)
    buses: list[Bus] = field(default_factory=list)

    async def connect(self, service: str, **options: Any) -> Bus:
        options.setdefault("insecure", _insecure(self.url))
        bus = await Bus.connect(BusOptions(url=self.url, prefix=self.prefix, **options), service=service)
        self.buses.append(bus)
        return bus

    async def start_placement(self, identity: str, **overrides: Any) -> Placement:
        config = server_config(self.url, self.prefix, identity=identity, **overrides)
        bus = await self.connect("placement", replicas=config.nats.replicas)
        p = Placement(PlacementService(config, bus), bus)

        async def run() -> None:
            try:
                with p.scope:
                    await p.service.run()
            except Exception as exc:  # recorded: a test asserts that no placement ever crashed
                p.crashed = exc
            finally:
                p.stopped.set()

        self.tg.start_soon(run)
        self.placements.append(p)
        return p

    async def start_fleet(
        self, nodes: list[str], gpus: int = 8, heartbeat_s: float = 0.3
    ) -> anyio.CancelScope:
        bus = await self.connect("fleet")
        fleet = Fleet(bus, nodes, gpus_per_node=gpus, heartbeat_interval_s=heartbeat_s)
        scope = anyio.CancelScope()

        async def run() -> None:
            with scope:
                await fleet.run()

        self.tg.start_soon(run)
        self.fleets.append((fleet, scope))
        return scope

    def leaders(self) -> list[Placement]:
        return [p for p in self.placements if p.service.is_leader and not p.stopped.is_set()]

    def crashes(self) -> list[BaseException]:
        return [p.crashed for p in self.placements if p.crashed is not None]


@contextlib.asynccontextmanager
async def control_plane(url: str, prefix: str) -> AsyncIterator[ControlPlane]:
    async with anyio.create_task_group() as tg:
        cp = ControlPlane(tg, url, prefix)
        try:
            yield cp
        finally:
            tg.cancel_scope.cancel()
            with anyio.CancelScope(shield=True):
                for bus in cp.buses:
                    with contextlib.suppress(Exception):
                        with anyio.move_on_after(5):
                            await bus.close()


async def replicas(bus: Bus) -> dict[str, ReplicaRecord]:
    found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
    return {k: c.value for k, c in found.items() if c.value is not None}


async def ready_replicas(bus: Bus, deployment: str) -> list[str]:
    return sorted(
        k for k, r in (await replicas(bus)).items() if r.deployment == deployment and r.state == "ready"
    )


async def all_ready(bus: Bus, n: int) -> dict[str, ReplicaRecord]:
    """Every replica record, asserting there are `n` and each is ready with a URL (for `eventually`)."""
    found = await replicas(bus)
    assert len(found) == n, sorted(found)
    assert all(r.state == "ready" and r.url for r in found.values()), found
    return found


async def dlq(bus: Bus, service: str = "placement") -> list[Msg]:
    """Every message in a service's DLQ so far."""
    sub = await bus.js.subscribe(bus.names.dlq(service), stream=bus.names.dlq_stream, ordered_consumer=True)
    out: list[Msg] = []
    try:
        while True:
            try:
                out.append(await sub.next_msg(timeout=0.5))
            except TimeoutError:
                return out
    finally:
        await sub.unsubscribe()
