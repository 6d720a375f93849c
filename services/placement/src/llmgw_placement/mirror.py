"""`Mirror`: a bucket kept in placement's memory, key by key, and the values it refuses.

A value that does not decode or breaks a rule (`check`) is dead-lettered and changes
nothing: the key keeps its last good value, read from the key's history after a restart,
and an operator is told (`held`, shown as a warning) until a good value or a delete ends it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import anyio
import msgspec

from llmgw_core.access import SubjectTooLong
from llmgw_core.bus import Bus, KVChange
from llmgw_core.events import NodeIntent, NodeStatus, ShardStatus, decoder, encode
from llmgw_core.limits import key_problem
from llmgw_core.subjects import Names

from .attempts import Attempts
from .desired import last_good
from .state import ClusterState

T = TypeVar("T", bound=msgspec.Struct)


class Mirror:
    """Watches buckets into `state`; counts and says the values it refuses."""

    def __init__(self, bus: Bus, state: ClusterState, identity: str, wake: Callable[[], None]) -> None:
        self.bus = bus
        self.state = state
        self.identity = identity
        # Called when what the control loop acts on changed.
        self.wake = wake
        self.invalid_inputs = 0
        # "<bucket>/<key>" -> why its stored value is refused and what placement keeps instead.
        self.held: dict[str, str] = {}

    async def watch(
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
            try:
                history[:] = await self.bus.revisions(bucket, key)
            except SubjectTooLong:
                # A key too long for the bus to read by: none of its values is good (no name
                # is that long), and asking again cannot help.
                history.clear()

        reading = Attempts(self.identity, f"reading the history of {bucket}/{key}")
        while not await reading.run(read):
            await anyio.sleep(reading.delay)
        return last_good([(rev, data) for rev, data in history if rev < before], judge)


def check_node(key: str, status: NodeStatus) -> str | None:
    problem = key_problem(key, "node")
    if problem is not None:
        return problem
    if status.node != key:
        return f"key {key} holds the status of node {status.node}: a node writes only its own key"
    return None


def check_intent(key: str, intent: NodeIntent) -> str | None:
    if intent.node != key:
        return f"the key is {key} but the intent names node {intent.node}"
    return None


def check_shard_status(key: str, status: ShardStatus) -> str | None:
    problem = key_problem(key, "node", "shard")
    if problem is not None:
        return problem
    if key != Names.shard_key(status.node, status.shard):
        return (
            f"key {key} holds the status of shard {status.node}.{status.shard}: "
            "a status is stored under its own key"
        )
    return None
