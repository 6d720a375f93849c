"""Replica ids, never used twice in a deployment: numbers reserved in blocks in the leases bucket.

A block is reserved by compare-and-set under `replica-ids.<deployment>`, so a late write
of an ex-leader fails rather than moving the counter back; it is as large as the
replicas still to place (ID_BLOCK to ID_BLOCK_MAX), so a large deployment costs a few
reservations, not one per replica.
"""

from __future__ import annotations

import msgspec

from llmgw_core.bus import Bus

from .held import REPLICA_NUMBER, Held


class ReplicaIds(msgspec.Struct, frozen=True, kw_only=True):
    """`replica-ids.<deployment>` in the leases bucket: replica numbers below `next` were handed out."""

    deployment: str
    next: int


# Replica numbers are reserved this many at a time: one write per block, not per replica.
ID_BLOCK = 64
ID_BLOCK_MAX = 4096


async def next_replica_id(bus: Bus, held: Held, dep: str, wanted: int = 1) -> str:
    """A replica id never used before in this deployment, across failovers, restarts and
    leaders: numbers are reserved in the leases bucket by compare-and-set, a block at a
    time, the block as big as the `wanted` replicas still to place (up to ID_BLOCK_MAX):
    10,000 new replicas cost a few reservations, not one per 64. The id is handed out
    (`held.ids` moves past it) when the caller builds its placement."""
    number, end = held.ids.get(dep, (0, 0))
    if number >= end:
        number, end = await _reserve(bus, held, dep, min(max(ID_BLOCK, wanted), ID_BLOCK_MAX))
    held.ids[dep] = (number, end)
    return f"r{number}"


async def _reserve(bus: Bus, held: Held, dep: str, size: int) -> tuple[int, int]:
    bucket, k = bus.names.leases_bucket, f"replica-ids.{dep}"
    ids = held.ids
    if dep in ids:
        used = ids[dep][0]  # every replica held was numbered below it
    else:  # the first block of this leader: the replicas it loaded
        used = max(
            (
                int(m.group(1)) + 1
                for r in held.replicas.values()
                if r.deployment == dep
                if (m := REPLICA_NUMBER.match(r.replica))
            ),
            default=0,
        )
    while True:
        current = await bus.get(bucket, k, ReplicaIds)
        start = max(used, current[0].next if current else 0, ids.get(dep, (0, 0))[0])
        block = ReplicaIds(deployment=dep, next=start + size)
        if current is None:
            written = await bus.create(bucket, k, block)
        else:
            written = await bus.update(bucket, k, block, last=current[1])
        if written is not None:
            return start, start + size
