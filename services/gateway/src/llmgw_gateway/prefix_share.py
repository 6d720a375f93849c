"""One routing state for every gateway: what each replica is believed to hold, shared through
the routing bucket.

Each gateway's prefix index (`prefix_index.py`) learns from its own routing. Behind a load
balancer each gateway would see half of a conversation and a gateway that restarts would
start blind; so every gateway writes, per replica it routed to, what it believes that
replica holds, and reads what the others write:

- **A KV bucket, one key per replica** (`<deployment>.<replica>`, as in the replicas bucket),
  **one revision per key**: each value is a whole snapshot of that replica's most recent
  `replica_blocks` block hashes (`RoutingHeld`), so the bucket is its own compaction: a
  gateway that starts reads one value per replica, at most `replica_blocks` hashes each,
  whatever the traffic before. A stream of changes would need a snapshot beside it, or a
  replay of everything since its limits; a key per replica needs neither.
- **Merged, then written, compare-and-set**: a gateway's snapshot of a replica is its whole
  index of it, which holds what it read of the others' too. Each write is a compare-and-set
  against the key's revision this gateway last heard (its watch, or its own write): where
  another gateway wrote in between, the write is refused, and the gateway reads that value,
  learns it, and writes its merged snapshot again (WRITE_TRIES in all). A plain put let
  the later of two gateways writing one replica in one interval overwrite the other's
  newest blocks, and a gateway started then read less than the two knew. Tries used up (the
  key kept moving) or a value there that does not decode cost that interval's write alone:
  it is tried again at the next, against what the watch heard meanwhile.
- **Batched**: routing marks a replica dirty (`Table.recorded`); every `share_interval_s`
  the dirty ones are written, one compare-and-set each (more only where refused). Nothing
  on a request's path waits on the bus.
- **Dropped with the replica**: a replica gone from the replicas bucket is forgotten by every
  gateway's table, and its key is deleted by each (idempotent). A value for a replica this
  gateway does not know yet is kept aside (at most PENDING_MAX, newest kept) until its record
  comes, and deleted from the bucket after STALE_S if it never does: its replica went while
  no gateway ran.

Every value read is another process's bytes: decoded by the bus's bounded decode (a bad one
goes to the DLQ and the watch goes on; its revision is kept, so the next write replaces it),
its hashes at most `MAX_HELD_BLOCKS`, and only the newest `replica_blocks` of them learned.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import anyio
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.prefixes import RoutingHeld, pack
from llmgw_core.retry import Retry

from .engine_view import EngineHeld
from .routing import Table

log = logging.getLogger("llmgw.gateway")

# Values held for replicas not (yet) in the table, and how long before such a key is deleted.
PENDING_MAX = 1024
STALE_S = 60.0
# Compare-and-set tries of one key's write in one interval: each refused try costs a read and
# a write more. Three let a gateway settle after two others wrote between its tries; a key
# moving faster than that is written at the next interval, from what the watch heard.
WRITE_TRIES = 3


@dataclass
class Sharing:
    """The plain state of the sharing: what to write and what was read ahead of its replica.
    Pure: the service's loops (`PrefixShare`) feed it and carry out what it says."""

    table: Table
    writer: str
    # Replica keys whose blocks this gateway routed since the last write, and keys to delete.
    dirty: set[str] = field(default_factory=set)
    gone: set[str] = field(default_factory=set)
    # The `at` of each value this gateway wrote, to know its own value when it comes back.
    written: dict[str, float] = field(default_factory=dict)
    # Values for replicas the table does not know: (when read, the value), oldest first.
    pending: OrderedDict[str, tuple[float, RoutingHeld]] = field(default_factory=OrderedDict)
    # What each replica's engine says it holds (source `engine`, from its launcher's relay of
    # its KV events): token-block hashes, least recently stored first. Such a replica's key
    # is its launcher's to write: no gateway writes its routed blocks over it.
    engine: dict[str, RoutingHeld] = field(default_factory=dict)
    # The revision of each key's value as this gateway last heard it (its watch, its own write,
    # or a read after a refused write): what its next write of the key is compare-and-set
    # against (none: a create, which only an absent or deleted key takes).
    revisions: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.table.recorded = self.routed
        self.table.gone = self.forget

    def routed(self, key: str) -> None:
        self.dirty.add(key)

    def forget(self, key: str) -> None:
        self.dirty.discard(key)
        self.written.pop(key, None)
        self.revisions.pop(key, None)
        self.pending.pop(key, None)
        self.engine.pop(key, None)
        self.table.engine.pop(key, None)
        self.gone.add(key)

    def heard(self, key: str, revision: int) -> None:
        """The watch came to `revision` of `key` (0: the bucket was made anew, its revisions
        start again). Only a newer one counts: the watch may still be delivering a revision
        older than this gateway's own write that it already knows of. Kept for the replicas
        in the table alone (what this gateway writes): the keys of the bucket are anyone's, and
        a revision kept for each would grow with them."""
        if revision == 0:
            self.revisions.pop(key, None)
        elif key in self.table.replicas and revision > self.revisions.get(key, 0):
            self.revisions[key] = revision

    def read(self, key: str, value: RoutingHeld | None, now: float, revision: int | None = None) -> str:
        """A value of the routing bucket read (None: deleted), at `revision` where the watch
        said it: learned into the index where its replica is known and it is not this
        gateway's own, else kept aside. What was done."""
        if revision is not None:
            self.heard(key, revision)
        if value is None:
            self.pending.pop(key, None)
            self.engine.pop(key, None)
            self.table.engine.pop(key, None)
            return "deleted"
        if value.gateway == self.writer and self.written.get(key) == value.at:
            return "own"
        if key not in self.table.replicas:
            self.pending[key] = (now, value)
            self.pending.move_to_end(key)
            while len(self.pending) > PENDING_MAX:
                self.pending.popitem(last=False)
            return "pending"
        self.learn(key, value)
        return "learned"

    def learn(self, key: str, value: RoutingHeld) -> None:
        if value.source == "engine":
            # The engine's word replaces the routed guess, whole (a removal or a clear
            # included): bounded as a value is, the newest `replica_blocks` kept.
            held = value.hashes()[-self.table.prefixes.per_replica :]
            self.engine[key] = RoutingHeld(
                gateway=value.gateway,
                blocks=pack(held),
                at=value.at,
                source="engine",
                block_tokens=value.block_tokens,
            )
            # What routing matches the request's token blocks against (engine_view.py).
            self.table.engine[key] = EngineHeld(value.block_tokens, frozenset(held))
            self.dirty.discard(key)
            return
        if key in self.engine:
            # A gateway's routed value written before the engine's came: the engine's holds.
            return
        per_replica = self.table.prefixes.per_replica
        self.table.prefixes.learn(key, value.hashes()[-per_replica:])

    def known(self, key: str) -> None:
        """Replica `key` entered the table: what was read of it ahead is learned now."""
        held = self.pending.pop(key, None)
        if held is not None:
            self.learn(key, held[1])

    def writes(self, now: float) -> tuple[list[tuple[str, RoutingHeld]], list[str]]:
        """What to write now: each dirty replica's snapshot, and the keys to delete (replicas
        gone, and values read for replicas never known within STALE_S). Taken: a write that
        fails is handed back with `failed`."""
        dirty, self.dirty = self.dirty, set()
        gone, self.gone = self.gone, set()
        for key, (since, _) in list(self.pending.items()):
            if now - since >= STALE_S:
                del self.pending[key]
                gone.add(key)
        puts = []
        for key in sorted(dirty):
            value = self.snapshot(key, now)
            if value is not None:
                puts.append((key, value))
        return puts, sorted(gone)

    def snapshot(self, key: str, now: float) -> RoutingHeld | None:
        """This gateway's value of replica `key` to write now: its newest blocks as its index
        holds them (what it read of the others included); None where it writes none (the
        replica is gone, or its key is its launcher's)."""
        if key not in self.table.replicas or key in self.engine:
            return None
        self.written[key] = now
        return RoutingHeld(gateway=self.writer, blocks=pack(self.table.prefixes.recent(key)), at=now)

    def wrote(self, key: str, revision: int) -> None:
        """This gateway's value of `key` is the bucket's, at `revision`."""
        if key in self.table.replicas:  # not forgotten while the write was under way
            self.revisions[key] = revision

    def refused(self, key: str, found: tuple[RoutingHeld, int] | None, now: float) -> None:
        """A write of `key` was refused: another's value came between, read now (None: the key
        was deleted). That value's revision is the one to write against next, whatever the
        watch said (a bucket made anew starts its revisions again); it is learned as the
        watch would learn it."""
        if found is None:
            self.revisions.pop(key, None)
            return
        value, revision = found
        if key in self.table.replicas:
            self.revisions[key] = revision
        self.read(key, value, now)

    def failed(self, puts: list[str], deletes: list[str]) -> None:
        """Writes the bus refused, or that did not settle within WRITE_TRIES: tried again at
        the next interval."""
        self.dirty.update(k for k in puts if k in self.table.replicas)
        self.gone.update(deletes)


class PrefixShare:
    """The routing bucket's reader and batched writer, for one gateway."""

    def __init__(self, bus: Bus, table: Table, writer: str) -> None:
        self.bus = bus
        self.state = Sharing(table, writer)
        self.interval_s = table.routing.share_interval_s
        self._failing = False

    async def follow(self, retry: Retry) -> None:
        """Every value of the routing bucket, then each change. A value that does not decode
        (dead-lettered by the bus) teaches nothing, but its revision is heard: this gateway's
        next write of the key replaces it rather than being refused by it."""
        async for change in self.bus.watch(self.bus.names.routing_bucket, RoutingHeld, undecodable=True):
            retry.succeeded()
            if change.error:
                self.state.heard(change.key, change.revision)
            else:
                self.state.read(change.key, change.value, time.time(), change.revision)

    async def write_forever(self) -> None:
        """Every interval, the replicas routed to since the last write, one compare-and-set each."""
        while True:
            await anyio.sleep(self.interval_s)
            await self.write()

    async def write(self) -> None:
        now = time.time()
        puts, deletes = self.state.writes(now)
        bucket = self.bus.names.routing_bucket
        failed_puts: list[str] = []
        failed_deletes: list[str] = []
        error: BusError | None = None
        for key in deletes:
            try:
                await self.bus.delete(bucket, key)
            except BusError as exc:
                failed_deletes.append(key)
                error = exc
        for key, value in puts:
            try:
                settled = await self._settle(key, value, now)
            except BusError as exc:
                failed_puts.append(key)
                error = exc
            else:
                if not settled:
                    failed_puts.append(key)
        if failed_puts or failed_deletes:
            self.state.failed(failed_puts, failed_deletes)
        if error is not None:
            if not self._failing:
                log.warning(
                    "cannot write the routing bucket %s (what each replica holds; retrying each "
                    "interval, routing goes on by this gateway's own index): %s",
                    bucket,
                    error,
                )
            self._failing = True
        elif self._failing:
            log.info("the routing bucket %s is written again", bucket)
            self._failing = False

    async def _settle(self, key: str, value: RoutingHeld, now: float) -> bool:
        """Write `value` as `key`'s next revision, compare-and-set against the revision this
        gateway last heard; where another's value came between, learn it and write the merged
        snapshot again, at most WRITE_TRIES in all. False: not written this interval (the key
        kept moving, or the value there does not decode: the watch dead-letters it and hears
        its revision, and the next interval's write replaces it)."""
        bucket = self.bus.names.routing_bucket
        for _ in range(WRITE_TRIES):
            last = self.state.revisions.get(key)
            if last is None:
                revision = await self.bus.create(bucket, key, value)
            else:
                revision = await self.bus.update(bucket, key, value, last=last)
            if revision is not None:
                self.state.wrote(key, revision)
                return True
            try:
                found = await self.bus.get(bucket, key, RoutingHeld)
            except msgspec.DecodeError as exc:  # ValidationError is one
                log.debug("%s/%s does not decode (%s): written at the next interval", bucket, key, exc)
                return False
            self.state.refused(key, found, now)
            again = self.state.snapshot(key, now)
            if again is None:
                return True  # the key is its launcher's now, or its replica is gone
            value = again
        log.debug("%s/%s moved at each of %d tries: written at the next interval", bucket, key, WRITE_TRIES)
        return False
