"""LoRA adapters as the gateway routes them (docs/adapters.md): which replicas' engines hold each
adapter, in the order they number them, as their shard statuses say (`ShardStatus.adapters`).

`model: <adapter>` goes to the adapter's base deployment, to a replica that holds it, with the
adapter applied: llama.cpp's `lora` field names every adapter the engine loaded, the one asked
for at its scale and the others at 0. A request for the base names them all at 0: llama-server
applies its adapters to a request that names none (whatever `--lora-init-without-apply` says),
so a base request sent without the field would be answered by the adapters.

vLLM (and the simulator) load adapters at run time: a replica's status lists those it may be
asked to load (`ShardStatus.adapters_loadable`) beside those it holds. A request for one that no
ready replica holds is held while a replica loads it (`adapter_loads`); a request for one it holds
keeps `model: <adapter>` (vLLM selects the adapter by that name) and no `lora` field. The index
keeps, per replica, the order the gateway last sent its adapters requests in: the least recently
used is what its launcher unloads for room.

Pure: the index is fed the statuses; nothing here does I/O.
"""

from __future__ import annotations

import time
from typing import Any

from llmgw_core.adapters import ADAPTERS_MAX, ServedAdapter
from llmgw_core.events import ShardStatus
from llmgw_core.subjects import Names


class AdapterIndex:
    """Shard-status key -> (replica key, the adapters its engine loaded); and by adapter name,
    the deployment and the replica keys holding it."""

    __slots__ = ("_by_name", "_by_replica", "_loadable", "_recent", "_shards")

    def __init__(self) -> None:
        self._shards: dict[str, tuple[str, str, tuple[ServedAdapter, ...]]] = {}
        # Replicas of a runtime engine: replica key -> (deployment, node, shard, adapters it may
        # be asked to load).
        self._loadable: dict[str, tuple[str, str, str, tuple[str, ...]]] = {}
        # Replica key -> its adapters in the order requests were last sent to them (latest last),
        # each with when (the monotonic clock).
        self._recent: dict[str, dict[str, float]] = {}
        # Made again from `_shards` at the first read after a change.
        self._by_name: dict[str, dict[str, str]] | None = None
        self._by_replica: dict[str, tuple[ServedAdapter, ...]] = {}

    def observe(self, key: str, status: ShardStatus | None) -> None:
        """A shard's status changed (None: it is gone). Only a leader's counts: it runs the server."""
        replica = Names.replica_key(status.deployment, status.replica) if status is not None else ""
        if status is not None and status.rank == 0 and status.adapters_loadable and status.state == "ready":
            where = (status.deployment, status.node, status.shard, status.adapters_loadable)
            self._loadable[replica] = where
        elif status is not None and status.rank == 0:
            self._loadable.pop(replica, None)
        elif status is None:
            for r, (_, node, shard, _) in list(self._loadable.items()):
                if Names.shard_key(node, shard) == key:
                    del self._loadable[r]
                    self._recent.pop(r, None)
        before = self._shards.get(key)
        if status is None or status.rank != 0 or not status.adapters:
            if before is not None:
                del self._shards[key]
                self._by_name = None
            return
        entry = (status.deployment, Names.replica_key(status.deployment, status.replica), status.adapters)
        if entry != before:
            self._shards[key] = entry
            self._by_name = None

    def _names(self) -> dict[str, dict[str, str]]:
        """adapter -> replica key -> deployment."""
        if self._by_name is None:
            by_name: dict[str, dict[str, str]] = {}
            by_replica: dict[str, tuple[ServedAdapter, ...]] = {}
            for deployment, replica, adapters in (self._shards[k] for k in sorted(self._shards)):
                by_replica[replica] = adapters
                for adapter in adapters:
                    by_name.setdefault(adapter.name, {})[replica] = deployment
            self._by_name, self._by_replica = by_name, by_replica
        return self._by_name

    def names(self) -> list[str]:
        """Every adapter some replica holds or may be asked to load, sorted."""
        loadable = {a for _, _, _, names in self._loadable.values() for a in names}
        return sorted(loadable.union(self._names()))

    def loaders(self, adapter: str) -> tuple[str, dict[str, tuple[str, str]]] | None:
        """The deployment whose ready replicas may be asked to load `adapter`, and those
        replicas (key -> node, shard); None where none may."""
        found = {r: v for r, v in self._loadable.items() if adapter in v[3]}
        if not found:
            return None
        deployment = min(v[0] for v in found.values())
        return deployment, {r: (v[1], v[2]) for r, v in sorted(found.items()) if v[0] == deployment}

    def runtime(self, replica: str) -> bool:
        """Whether `replica`'s engine loads adapters at run time (and selects one by `model`)."""
        return replica in self._loadable

    def used(self, replica: str, adapter: str, now: float | None = None) -> None:
        """A request for `adapter` was sent to `replica`."""
        recent = self._recent.setdefault(replica, {})
        recent.pop(adapter, None)
        recent[adapter] = time.monotonic() if now is None else now
        if len(recent) > 4 * ADAPTERS_MAX:
            del recent[next(iter(recent))]

    def recent(self, replica: str) -> tuple[str, ...]:
        """`replica`'s adapters that requests were sent to, most recent first, those it holds
        only (what a load request names)."""
        self._names()
        held = {a.name for a in self._by_replica.get(replica, ())}
        return tuple(a for a in reversed(self._recent.get(replica, {})) if a in held)

    def sent_within(self, replica: str, seconds: float, now: float | None = None) -> tuple[str, ...]:
        """`replica`'s adapters that a request was sent to in the last `seconds`, most recent
        first, those it holds only: such a request may not be in the engine's own count yet."""
        since = (time.monotonic() if now is None else now) - seconds
        recent = self._recent.get(replica, {})
        return tuple(a for a in self.recent(replica) if recent[a] >= since)

    def holders(self, adapter: str) -> tuple[str, frozenset[str]] | None:
        """The deployment serving `adapter` and its replica keys that hold it; None where no
        replica holds it. Where two deployments hold one name (written around the checks), the
        first by name serves it."""
        found = self._names().get(adapter)
        if not found:
            return None
        deployment = min(found.values())
        return deployment, frozenset(r for r, d in found.items() if d == deployment)

    def lora(self, replica: str, adapter: str) -> list[dict[str, Any]] | None:
        """The `lora` field for a request to `replica`: every adapter its engine loaded, `adapter`
        at its scale and the others at 0 ("" for the base: all at 0); None where its engine
        loaded none."""
        self._names()
        adapters = self._by_replica.get(replica)
        if not adapters or replica in self._loadable:
            return None
        return [{"id": i, "scale": a.scale if a.name == adapter else 0.0} for i, a in enumerate(adapters)]

    def any_on(self, deployment: str) -> bool:
        """Whether a replica of `deployment` has adapters loaded (its requests name their scales)."""
        return any(d == deployment for d, r, _ in self._shards.values() if r not in self._loadable)
