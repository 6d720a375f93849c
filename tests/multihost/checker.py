"""After a run: did llmgw lose or double anything? Pure functions over a `History`
(`history.py` reads one from any cluster, one host or many).

Invariants, each a function returning the `Violation`s that break it, with the records that
show them:

    placed_twice      a replica id live in two places at once: one shard name under two
                      node keys at one revision of the shards bucket, a replica record whose
                      nodes change or that comes back after it was removed, two `placed`
                      decisions of one replica id on different nodes
    gpus_held_twice   at some revision of the shards bucket, a GPU of a node in the specs of
                      two replicas
    acks_lost         a write the test saw acknowledged, neither in the bucket's history nor
                      superseded by a later revision of its key
    terms_shared      a lease term (the run of lease revisions one holder wrote) in which
                      replica or placement events of two writers landed, or one writer whose
                      events landed in the terms of two holders
    engines_left      an engine still running for a shard whose spec is gone
    not_converged     the deployments' ready replicas not == wanted within `within_s` of the heal,
                      or not at the end

A record that does not decode is a violation of its own (`unreadable`): llmgw never writes
one, and the checker cannot prove anything of it. Nothing but `CheckerError` (a history the
checker was handed wrong) escapes `check`, whatever the bytes.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from llmgw_core.events import PlacementDecision, ReplicaRecord, ReplicaStatus, ShardSpec, decoder

from .history import Event, History, Revision

LEASE_KEY = "placement"


class CheckerError(Exception):
    """The checker was handed something it cannot judge (a convergence with no deployment)."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    what: str
    records: tuple[str, ...] = ()

    def __str__(self) -> str:
        shown = "".join(f"\n    {r}" for r in self.records)
        return f"{self.invariant}: {self.what}{shown}"


@dataclass(frozen=True)
class Ack:
    """A KV write the test saw acknowledged: a delete, or a put of `value` (any value if None)."""

    bucket: str  # its role (history.ROLES)
    key: str
    revision: int
    value: bytes | None = None
    deleted: bool = False

    def matches(self, r: Revision) -> bool:
        if r.key != self.key:
            return False
        if self.deleted:
            return r.value is None
        return r.value is not None and self.value in (None, r.value)


@dataclass(frozen=True)
class Convergence:
    wanted: Mapping[str, int]  # deployment -> replicas wanted ready
    healed_at: float  # Unix time the last fault ended
    within_s: float


def _show(r: Revision) -> str:
    value = "deleted" if r.value is None else r.value[:160].decode(errors="replace")
    return f"{r.bucket} rev {r.revision} {r.key} @{r.time:.3f}: {value}"


def _show_event(e: Event) -> str:
    return f"event seq {e.seq} {e.subject} @{e.time:.3f} writer {e.writer[:8] or '?'}: {e.data[:160]!r}"


def _decode(kind: type, r: Revision, bad: list[Violation]) -> object | None:
    assert r.value is not None
    try:
        return decoder(kind).decode(r.value)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        bad.append(Violation("unreadable", f"a {kind.__name__} that does not decode: {exc}", (_show(r),)))
        return None


def _specs(history: History, bad: list[Violation]) -> Iterable[tuple[Revision, dict[str, ShardSpec]]]:
    """The shards bucket after each of its revisions: key -> spec live then."""
    live: dict[str, ShardSpec] = {}
    for r in history.of("shards"):
        if r.value is None:
            live.pop(r.key, None)
        else:
            spec = _decode(ShardSpec, r, bad)
            if isinstance(spec, ShardSpec):
                live[r.key] = spec
            else:
                live.pop(r.key, None)
        yield r, live


def placed_twice(history: History) -> list[Violation]:
    bad: list[Violation] = []
    # One shard name live under two keys (two nodes) at once.
    where: dict[str, Revision] = {}
    said: set[tuple[str, ...]] = set()
    for r, live in _specs(history, bad):
        if r.value is not None:
            where[r.key] = r
        by_shard: dict[str, list[str]] = defaultdict(list)
        for k, spec in live.items():
            by_shard[f"{spec.deployment}/{spec.shard}"].append(k)
        for shard, keys in sorted(by_shard.items()):
            if len(keys) > 1 and tuple(sorted(keys)) not in said:
                said.add(tuple(sorted(keys)))
                bad.append(
                    Violation(
                        "placed twice",
                        f"shard {shard} is live on {len(keys)} nodes at once (shards revision {r.revision})",
                        tuple(_show(where[k]) for k in sorted(keys)),
                    )
                )
    # A replica record whose nodes change, or that comes back once removed.
    seen: dict[str, tuple[Revision, tuple[str, ...]]] = {}
    removed: dict[str, Revision] = {}
    for r in history.of("replicas"):
        if r.value is None:
            if r.key in seen:
                removed[r.key] = r
            continue
        record = _decode(ReplicaRecord, r, bad)
        if not isinstance(record, ReplicaRecord):
            continue
        nodes = tuple(m.node for m in record.members)
        if r.key in removed:
            bad.append(
                Violation(
                    "placed twice",
                    f"replica {r.key} was written again after it was removed: a replica id used twice",
                    (_show(removed[r.key]), _show(r)),
                )
            )
            removed.pop(r.key)
        elif r.key in seen and seen[r.key][1] != nodes:
            bad.append(
                Violation(
                    "placed twice",
                    f"replica {r.key} moved from {seen[r.key][1]} to {nodes} under one id",
                    (_show(seen[r.key][0]), _show(r)),
                )
            )
        seen[r.key] = (r, nodes)
    # Two `placed` decisions of one replica id on different nodes.
    decided: dict[tuple[str, str], tuple[Event, tuple[str, ...]]] = {}
    for e in history.events:
        if not e.subject.startswith("placement."):
            continue
        try:
            decision = decoder(PlacementDecision).decode(e.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            what = f"a PlacementDecision event that does not decode: {exc}"
            bad.append(Violation("unreadable", what, (_show_event(e),)))
            continue
        if decision.outcome != "placed":
            continue
        rid = (decision.deployment, decision.replica)
        if rid in decided and decided[rid][1] != decision.nodes:
            bad.append(
                Violation(
                    "placed twice",
                    f"replica {rid[0]}/{rid[1]} was placed on {decided[rid][1]} and on {decision.nodes}",
                    (_show_event(decided[rid][0]), _show_event(e)),
                )
            )
        decided.setdefault(rid, (e, decision.nodes))
    return bad


def gpus_held_twice(history: History) -> list[Violation]:
    bad: list[Violation] = []
    where: dict[str, Revision] = {}
    said: set[tuple[str, int, tuple[str, ...]]] = set()
    for r, live in _specs(history, bad):
        if r.value is not None:
            where[r.key] = r
        holders: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
        for k, spec in live.items():
            for gpu in spec.gpus:
                holders[(spec.node, gpu)][f"{spec.deployment}/{spec.replica}"] = k
        for (node, gpu), replicas in sorted(holders.items()):
            keys = tuple(sorted(replicas.values()))
            if len(replicas) > 1 and (node, gpu, keys) not in said:
                said.add((node, gpu, keys))
                bad.append(
                    Violation(
                        "GPU held twice",
                        f"GPU {gpu} of {node} is held by {', '.join(sorted(replicas))} at shards revision "
                        f"{r.revision}",
                        tuple(_show(where[k]) for k in keys),
                    )
                )
    return bad


def acks_lost(history: History, acks: Iterable[Ack]) -> list[Violation]:
    bad: list[Violation] = []
    by_key: dict[tuple[str, str], list[Revision]] = defaultdict(list)
    at: dict[tuple[str, int], Revision] = {}
    for r in history.revisions:
        by_key[(r.bucket, r.key)].append(r)
        at[(r.bucket, r.revision)] = r
    for ack in acks:
        found = at.get((ack.bucket, ack.revision))
        later = [r for r in by_key[(ack.bucket, ack.key)] if r.revision > ack.revision]
        if found is not None and ack.matches(found):
            continue
        if later:
            continue  # superseded: a later revision of the key
        shown = (_show(found),) if found is not None else ()
        what = (
            f"{ack.bucket}/{ack.key} revision {ack.revision} was acknowledged but the bucket holds "
            + ("another message at that revision" if found is not None else "no such revision")
            + " and no later revision of the key"
        )
        bad.append(Violation("acknowledged write lost", what, shown))
    return bad


def _terms(history: History) -> list[tuple[float, str, Revision]]:
    """(start, holder, first revision) of each lease term, oldest first."""
    terms: list[tuple[float, str, Revision]] = []
    for r in history.of("leases"):
        if r.key != LEASE_KEY or r.value is None:
            continue  # a release does not end a term: the next holder's take does
        holder = r.value.decode(errors="replace")
        if not terms or terms[-1][1] != holder:
            terms.append((r.time, holder, r))
    return terms


def _fenced(e: Event, bad: list[Violation]) -> bool:
    """Whether `e` tells of a write placement makes only under the lease: a replica placed,
    or a replica's change of state. A refusal writes nothing, and goes out by another door
    (its writer prefix is the connection's, not the batches')."""
    kind: type[msgspec.Struct]
    if e.subject.startswith("placement."):
        kind = PlacementDecision
    elif e.subject.startswith("replica."):
        kind = ReplicaStatus
    else:
        return False
    try:
        value = decoder(kind).decode(e.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        bad.append(
            Violation("unreadable", f"a {kind.__name__} event that does not decode: {exc}", (_show_event(e),))
        )
        return False
    if isinstance(value, PlacementDecision):
        return value.outcome == "placed"
    return isinstance(value, ReplicaStatus) and value.state != "unplaceable"


def terms_shared(history: History) -> list[Violation]:
    bad: list[Violation] = []
    terms = _terms(history)
    starts = [t[0] for t in terms]
    writers: dict[int, dict[str, Event]] = defaultdict(dict)
    holders: dict[str, dict[str, tuple[Event, int]]] = defaultdict(dict)
    for e in history.events:
        if not e.writer or not _fenced(e, bad):
            continue
        i = bisect.bisect_right(starts, e.time) - 1
        if i < 0:
            continue  # before the first term the history holds (its lease revisions are gone)
        writers[i].setdefault(e.writer, e)
        holders[e.writer].setdefault(terms[i][1], (e, i))
    for i, found in sorted(writers.items()):
        if len(found) > 1:
            bad.append(
                Violation(
                    "two placements in one term",
                    f"{len(found)} writers wrote placement's events in the term of {terms[i][1]!r} "
                    f"(lease revision {terms[i][2].revision})",
                    (_show(terms[i][2]), *(_show_event(e) for e in found.values())),
                )
            )
    for writer, terms_of in sorted(holders.items()):
        if len(terms_of) > 1:
            bad.append(
                Violation(
                    "two placements in one term",
                    f"writer {writer[:8]} wrote in the terms of {len(terms_of)} holders: "
                    f"{', '.join(sorted(terms_of))}",
                    tuple(f"{_show(terms[i][2])}\n    {_show_event(e)}" for e, i in terms_of.values()),
                )
            )
    return bad


def engines_left(history: History) -> list[Violation]:
    bad: list[Violation] = []
    live: dict[str, ShardSpec] = {}
    for _, specs in _specs(history, []):
        live = specs
    for engine in history.engines:
        if engine.running and engine.key not in live:
            bad.append(
                Violation(
                    "engine left running",
                    f"{engine.node} still runs {engine.key} (pids {', '.join(map(str, engine.running))}) "
                    "whose shard spec is gone",
                )
            )
    return bad


def not_converged(history: History, converge: Convergence) -> list[Violation]:
    if not converge.wanted:
        raise CheckerError("a convergence names no deployment")
    bad: list[Violation] = []
    ready: dict[str, str] = {}  # key -> deployment, of the records ready now
    first: float | None = None  # since when the ready replicas are those wanted, to the end
    last: Revision | None = None

    def holds() -> bool:
        counts = _count(ready)
        return all(counts.get(d, 0) == n for d, n in converge.wanted.items())

    healed = False
    for r in history.of("replicas"):
        if not healed and r.time > converge.healed_at:
            healed = True
            first = converge.healed_at if holds() else None
        record = None if r.value is None else _decode(ReplicaRecord, r, bad)
        if isinstance(record, ReplicaRecord) and record.state == "ready":
            ready[r.key] = record.deployment
        else:
            ready.pop(r.key, None)
        last = r
        if healed:
            # The run that holds to the end counts: a moment that held before it does not.
            first = (r.time if first is None else first) if holds() else None
    if not healed:
        first = converge.healed_at if holds() else None
    now = ", ".join(f"{d}: {n}" for d, n in sorted(_count(ready).items())) or "none"
    wanted = ", ".join(f"{d}: {n}" for d, n in sorted(converge.wanted.items()))
    if not holds():
        bad.append(
            Violation(
                "not converged",
                f"ready replicas at the end of the history ({now}) are not those wanted ({wanted})",
                (_show(last),) if last else (),
            )
        )
    elif first is not None and first - converge.healed_at > converge.within_s:
        bad.append(
            Violation(
                "not converged",
                f"ready replicas reached those wanted ({wanted}) {first - converge.healed_at:.1f} s after "
                f"the heal, over {converge.within_s:g} s",
            )
        )
    return bad


def _count(ready: Mapping[str, str]) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for dep in ready.values():
        counts[dep] += 1
    return dict(counts)


def check(
    history: History, *, acks: Iterable[Ack] = (), converge: Convergence | None = None
) -> list[Violation]:
    """Every invariant over `history`; [] when all hold."""
    found = [
        *placed_twice(history),
        *gpus_held_twice(history),
        *acks_lost(history, acks),
        *terms_shared(history),
        *engines_left(history),
        *(not_converged(history, converge) if converge is not None else []),
    ]
    found += [Violation("unreadable", line) for line in history.unreadable]
    # A record that does not decode is said once, however many invariants read it.
    unique: dict[str, Violation] = {}
    for v in found:
        unique.setdefault(str(v), v)
    return list(unique.values())


def report(violations: Iterable[Violation]) -> str:
    return "\n".join(str(v) for v in violations)


def assert_holds(history: History, *, acks: Iterable[Ack] = (), converge: Convergence | None = None) -> None:
    """AssertionError naming every violation, with its records."""
    found = check(history, acks=acks, converge=converge)
    assert not found, f"{len(found)} violation(s):\n{report(found)}"
