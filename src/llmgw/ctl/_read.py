"""What `llmgw ctl` reads, from where the cluster keeps it (never recomputed here):
the buckets' current values, the last DeploymentStatus of a deployment, placement's
judgement of liveness, the events stream, and a launcher's answer for logs."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
import msgspec

from llmgw_core.bus import Bus, DecodeFailure, NoAnswer
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    EngineInventory,
    InstallProgress,
    Liveness,
    NodeFacts,
    NodeIntent,
    NodeLifecycle,
    NodeStatus,
    PlacementDecision,
    ReplicaRecord,
    ReplicaStatus,
    ScaleDecision,
    ShardLogs,
    ShardLogsRequest,
    ShardStatus,
)
from llmgw_core.subjects import ALL

from ._errors import NotFound, Unreachable

LIVENESS_TIMEOUT_S = 1.5
LOGS_TIMEOUT_S = 3.0
# History is read until a message says nothing is pending, or none has come for this long.
HISTORY_IDLE_S = 0.5

T = TypeVar("T", bound=msgspec.Struct)

Event = (
    NodeFacts
    | EngineInventory
    | InstallProgress
    | NodeLifecycle
    | ShardStatus
    | ReplicaStatus
    | PlacementDecision
    | DeploymentStatus
    | ScaleDecision
)


async def values(bus: Bus, bucket: str, kind: type[T], keys: str = ALL) -> dict[str, T]:
    found = await bus.entries(bucket, kind, keys)
    return {k: c.value for k, c in sorted(found.items()) if c.value is not None}


async def liveness(bus: Bus) -> Liveness | None:
    """Placement's own judgement of every node (the one that fails nodes over), or None
    when no placement answers."""
    try:
        return await bus.request(bus.names.liveness_request, None, Liveness, timeout=LIVENESS_TIMEOUT_S)
    except (BusError, DecodeFailure):  # an answer that is no judgement is dead-lettered
        return None


async def cannot_write(bus: Bus) -> str:
    """Why the leading placement cannot act on what is written now (`Liveness.cannot_write`);
    empty when it can, or when no placement answers. The request goes to any placement: a
    standby's answer is asked again, a few times, for the leader's."""
    said = ""
    for _ in range(4):
        judged = await liveness(bus)
        if judged is None:
            return said
        if judged.leader:
            return judged.cannot_write
        said = said or judged.cannot_write
    return said


async def last_on(bus: Bus, subject: str, kind: type[T]) -> T | None:
    """The last message on `subject` still in the events stream, or None (also when that
    one does not decode: it is dead-lettered)."""
    return await bus.last(bus.names.events_stream, subject, kind)


async def deployment_status(bus: Bus, name: str) -> DeploymentStatus | None:
    return await last_on(bus, bus.names.deployment_event(name), DeploymentStatus)


async def deployment_statuses(bus: Bus, names: list[str]) -> dict[str, DeploymentStatus]:
    found: dict[str, DeploymentStatus] = {}
    async with anyio.create_task_group() as tg:
        for name in names:

            async def one(name: str = name) -> None:
                status = await deployment_status(bus, name)
                if status is not None:
                    found[name] = status

            tg.start_soon(one)
    return found


@dataclass(frozen=True)
class Cluster:
    """One read of everything `get` and `describe` show."""

    nodes: dict[str, NodeStatus]
    judged: Liveness | None
    deployments: dict[str, Deployment]
    statuses: dict[str, DeploymentStatus]
    replicas: dict[str, ReplicaRecord]
    shards: dict[str, ShardStatus]
    catalog: dict[str, Profile]
    # The operator's cordons and drains, by node (read with the nodes).
    intents: dict[str, NodeIntent] = field(default_factory=dict)


async def cluster(bus: Bus, *, what: frozenset[str]) -> Cluster:
    """Read the parts named in `what` (nodes, deployments, replicas, shards, catalog, liveness:
    placement's judgement, read with the nodes too) side by side."""
    n = bus.names
    out: dict[str, object] = {}
    async with anyio.create_task_group() as tg:

        async def read(key: str, bucket: str, kind: type[msgspec.Struct]) -> None:
            out[key] = await values(bus, bucket, kind)

        async def judge() -> None:
            out["judged"] = await liveness(bus)

        if "nodes" in what:
            tg.start_soon(read, "nodes", n.nodes_bucket, NodeStatus)
            tg.start_soon(read, "intents", n.node_intent_bucket, NodeIntent)
        if "nodes" in what or "liveness" in what:
            # Placement's judgement: how a node stands, and how its shards read.
            tg.start_soon(judge)
        if "deployments" in what:
            tg.start_soon(read, "deployments", n.deployments_bucket, Deployment)
        if "replicas" in what:
            tg.start_soon(read, "replicas", n.replicas_bucket, ReplicaRecord)
        if "shards" in what:
            tg.start_soon(read, "shards", n.shard_status_bucket, ShardStatus)
        if "catalog" in what:
            tg.start_soon(read, "catalog", n.catalog_bucket, Profile)
    intents: dict[str, NodeIntent] = out.get("intents", {})  # type: ignore[assignment]
    if "replicas" not in out and any(i.drain for i in intents.values()):
        # A draining node says how many replicas it has left.
        out["replicas"] = await values(bus, n.replicas_bucket, ReplicaRecord)
    deployments: dict[str, Deployment] = out.get("deployments", {})  # type: ignore[assignment]
    statuses = await deployment_statuses(bus, list(deployments)) if "deployments" in what else {}
    return Cluster(
        nodes=out.get("nodes", {}),  # type: ignore[arg-type]
        judged=out.get("judged"),  # type: ignore[arg-type]
        deployments=deployments,
        statuses=statuses,
        replicas=out.get("replicas", {}),  # type: ignore[arg-type]
        shards=out.get("shards", {}),  # type: ignore[arg-type]
        catalog=out.get("catalog", {}),  # type: ignore[arg-type]
        intents=intents,
    )


# --- events -----------------------------------------------------------------------


@dataclass(frozen=True)
class Stamped:
    """An event with where and when the stream stored it."""

    subject: str
    time: float
    event: Event


async def events(bus: Bus, subject: str, *, follow: bool) -> AsyncIterator[Stamped | None]:
    """Every event on `subject` still in the stream, oldest first; with `follow`, then None
    (caught up) and each new event as it comes."""
    kind: type[Event] = Event  # type: ignore[assignment]
    replayed = bus.replay(subject, kind, stream=bus.names.events_stream, follow=follow, idle_s=HISTORY_IDLE_S)
    async with contextlib.aclosing(replayed):
        async for record in replayed:
            yield None if record is None else Stamped(record.subject, record.time, record.value)


async def merged_events(
    bus: Bus, subjects: list[str], emit: Callable[[Stamped], None], *, follow: bool
) -> None:
    """Hand the history of several subjects to `emit` in time order; with `follow`, then each
    new event as it comes, until cancelled."""
    history: list[Stamped] = []
    waiting = len(subjects)
    caught_up = anyio.Event()
    live: list[Stamped] = []

    def one_caught_up() -> None:
        nonlocal waiting
        waiting -= 1
        if waiting == 0:
            for e in sorted(history, key=lambda s: s.time):
                emit(e)
            for e in live:  # what came live while another subject's history was still read
                emit(e)
            caught_up.set()

    async def read(subject: str) -> None:
        mine = True  # still this subject's history
        async for e in events(bus, subject, follow=follow):
            if e is None:
                mine = False
                one_caught_up()
            elif mine:
                history.append(e)
            elif caught_up.is_set():
                emit(e)
            else:
                live.append(e)
        if mine:
            one_caught_up()

    async with anyio.create_task_group() as tg:
        for subject in subjects:
            tg.start_soon(read, subject)


# --- logs -----------------------------------------------------------------------


async def shard_logs(bus: Bus, node: str, request: ShardLogsRequest) -> ShardLogs:
    subject = bus.names.launcher_logs(node)
    try:
        logs = await bus.request(subject, request, ShardLogs, timeout=LOGS_TIMEOUT_S)
    except NoAnswer as exc:
        if not exc.responders:
            raise Unreachable(
                f"the launcher of node {node} does not answer on {subject}: is it running?"
            ) from exc
        raise Unreachable(
            f"the launcher of node {node} did not answer on {subject} within {LOGS_TIMEOUT_S:g} s"
        ) from exc
    except DecodeFailure as exc:
        raise Unreachable(
            f"the launcher of node {node} answered on {subject} with no logs reply ({exc.error}); "
            "is its llmgw the same version as this one?"
        ) from exc
    if logs.error:
        raise NotFound(logs.error)
    return logs
