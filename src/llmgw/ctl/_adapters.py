"""`llmgw ctl get adapters`, `describe adapter X`, `delete adapter X`.

An adapter is kept on its base profile (`Profile.adapters`, docs/adapters.md): listing reads
the catalog; deleting rewrites the base profile without it, compare-and-set at the revision
read, so an edit of the profile in between is a Conflict rather than lost.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from typing import NamedTuple

import msgspec

from llmgw_core.adapter_rules import all_adapters
from llmgw_core.adapters import Adapter
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, ReplicaRecord, ShardStatus
from llmgw_core.keys import UsageRecord

from . import _read as read
from . import _views as views
from ._errors import Conflict, NotFound
from ._keys import records as usage_records

# How far back `describe adapter` sums what the gateways served of it.
USED_S = 24 * 3600.0

HEADERS = ["NAME", "BASE", "SCALE", "LIMITS", "DEPLOYMENTS", "SOURCE"]


class AdapterView(msgspec.Struct, frozen=True, kw_only=True):
    """An adapter as `get`/`describe` show it: its desired state, the deployments of its base,
    the replicas whose engine loaded it (as their shard statuses say), those started before it
    was added (their profile fingerprint is not the base's now: the rolling update replaces
    them), and each node's refusal of it, in its words."""

    name: str
    base: str
    source: str
    scale: float
    sha256: str = ""
    # Per minute, across every key (0: none of its own).
    rpm: int = 0
    tpm: int = 0
    deployments: tuple[str, ...] = ()
    holding: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()


def adapter_view(
    adapter: Adapter,
    catalog: Mapping[str, Profile],
    deployments: Mapping[str, Deployment],
    replicas: Mapping[str, ReplicaRecord],
    shards: Mapping[str, ShardStatus],
) -> AdapterView:
    base = catalog.get(adapter.base)
    fp = base.fingerprint() if base is not None else ""
    using = tuple(sorted(n for n, d in deployments.items() if d.profile == adapter.base))
    mine = [r for r in replicas.values() if r.deployment in using]
    ours = [s for s in shards.values() if s.deployment in using and s.rank == 0]
    holding = tuple(
        sorted(
            views.replica_name(s.deployment, s.replica)
            for s in ours
            if any(a.name == adapter.name for a in s.adapters)
        )
    )
    said = f"adapter {adapter.name} refused: "
    refused = tuple(
        sorted(
            f"{views.shard_name(s.node, s.shard)}: {line.removeprefix(said)}"
            for s in ours
            for line in s.adapters_refused
            if line.startswith(said)
        )
    )
    waiting = tuple(sorted(views.replica_name(r.deployment, r.replica) for r in mine if r.profile_fp != fp))
    return AdapterView(
        name=adapter.name,
        base=adapter.base,
        source=adapter.source,
        scale=adapter.scale,
        sha256=adapter.sha256,
        rpm=adapter.rpm,
        tpm=adapter.tpm,
        deployments=using,
        holding=holding,
        waiting=waiting,
        refused=refused,
    )


def limits(v: AdapterView) -> str:
    """An adapter's limits as one table cell: `60rpm,20000tpm`, `-` where it has none."""
    said = [f"{n}{what}" for n, what in ((v.rpm, "rpm"), (v.tpm, "tpm")) if n]
    return ",".join(said) or "-"


def _row(v: AdapterView) -> list[str]:
    return [v.name, v.base, f"{v.scale:g}", limits(v), ",".join(v.deployments) or "-", v.source]


async def get(bus: Bus, name: str, output: str) -> str:
    c = await read.cluster(bus, what=frozenset({"catalog", "deployments", "replicas", "shards"}))
    adapters = all_adapters(c.catalog)
    if name and name not in adapters:
        raise NotFound(f"no adapter {name} (`llmgw ctl get adapters` lists them)")
    chosen = [adapters[name]] if name else [adapters[n] for n in sorted(adapters)]
    items = [adapter_view(a, c.catalog, c.deployments, c.replicas, c.shards) for a in chosen]
    if output == "name":
        return "\n".join(f"adapter/{v.name}" for v in items)
    if output in ("json", "yaml"):
        return views.render_data(items[0] if name else items, output)
    return views.table(HEADERS, [_row(v) for v in items])


class Loads(NamedTuple):
    """An adapter's loads into its replicas' engines and unloads from them, and its last load
    (when, and which replica), as the shards' statuses in the events stream say."""

    loads: int = 0
    unloads: int = 0
    last: tuple[float, str] | None = None


def loads_of(adapter: str, deployments: Collection[str], events: Iterable[read.Stamped]) -> Loads:
    """`adapter`'s loads and unloads on the replicas of `deployments`, from `events` (oldest
    first): a ready status of a replica's first shard holding it, after one that did not (or
    none), is a load; a ready one no longer holding it, an unload. An engine that stops or
    restarts holds nothing until it is ready again, which is no unload. Pure."""
    held: dict[str, bool] = {}
    loads = unloads = 0
    last = None
    for e in events:
        s = e.event
        if not isinstance(s, ShardStatus) or s.deployment not in deployments or s.rank != 0:
            continue
        key = f"{s.node}.{s.shard}"
        if s.state != "ready":
            held[key] = False
            continue
        holds = any(a.name == adapter for a in s.adapters)
        if holds and not held.get(key, False):
            loads += 1
            last = (e.time, views.replica_name(s.deployment, s.replica))
        elif not holds and held.get(key, False):
            unloads += 1
        held[key] = holds
    return Loads(loads, unloads, last)


def used_of(adapter: str, records: Iterable[UsageRecord]) -> tuple[int, int, float]:
    """Requests and tokens the gateways served for `adapter` in `records`, and the end of the
    last interval that served any (0: none). Pure."""
    requests = tokens = 0
    last = 0.0
    for r in records:
        if r.deployment == adapter and r.requests:
            requests += r.requests
            tokens += r.prompt_tokens + r.completion_tokens
            last = max(last, r.end)
    return requests, tokens, last


async def describe(bus: Bus, name: str) -> str:
    c = await read.cluster(bus, what=frozenset({"catalog", "deployments", "replicas", "shards"}))
    adapters = all_adapters(c.catalog)
    if name not in adapters:
        raise NotFound(f"no adapter {name} (`llmgw ctl get adapters` lists them)")
    v = adapter_view(adapters[name], c.catalog, c.deployments, c.replicas, c.shards)
    history: list[read.Stamped] = []
    await read.merged_events(bus, [bus.names.shard_events_all], history.append, follow=False)
    loaded = loads_of(name, v.deployments, history)
    requests, tokens, used_at = used_of(name, await usage_records(bus, USED_S))
    now = time.time()
    last_load = f"; the last {views.age(loaded.last[0], now)} ago on {loaded.last[1]}" if loaded.last else ""
    said_loads = f"{loaded.loads}, unloads {loaded.unloads}{last_load} (as the events stream holds them)"
    used = f"{requests} requests, {tokens} tokens in the last 24 h"
    used += f"; the last {views.age(used_at, now)} ago" if used_at else ""
    return "\n".join(
        [
            f"Name:         {v.name}",
            f"Base:         profile {v.base}",
            f"Source:       {v.source}" + (f" (sha256 {v.sha256})" if v.sha256 else ""),
            f"Scale:        {v.scale:g}",
            f"Limits:       {limit_words(v)}",
            f"Deployments:  {', '.join(v.deployments) or '(none: deploy the base profile to serve it)'}",
            f"Loaded by:    {', '.join(v.holding) or '-'}",
            f"Loads:        {said_loads}",
            f"Used:         {used}",
            f"Started before it (replaced by the rolling update):  {', '.join(v.waiting) or '-'}",
            *(f"Refused:      {line}" for line in v.refused),
        ]
    )


def limit_words(v: AdapterView) -> str:
    """An adapter's limits in words, as `describe adapter` says them."""
    said = [f"{n} {what} per minute" for n, what in ((v.rpm, "requests"), (v.tpm, "tokens")) if n]
    return ", ".join(said) + " (every key's together)" if said else "none of its own (each key's apply)"


async def delete(bus: Bus, name: str) -> str:
    bucket = bus.names.catalog_bucket
    entries = await bus.entries(bucket, Profile)
    for key, change in sorted(entries.items()):
        profile = change.value
        if profile is None or not any(a.name == name for a in profile.adapters):
            continue
        kept = tuple(a for a in profile.adapters if a.name != name)
        written = await bus.update(
            bucket, key, msgspec.structs.replace(profile, adapters=kept), last=change.revision
        )
        if written is None:
            raise Conflict(
                f"profile {key} was changed by another writer while adapter {name} was being deleted; "
                "nothing was written; run the delete again"
            )
        return (
            f"adapter {name} deleted from profile {key}: its replicas are replaced, one at a time, without it"
        )
    raise NotFound(f"no adapter {name} (`llmgw ctl get adapters` lists them)")
