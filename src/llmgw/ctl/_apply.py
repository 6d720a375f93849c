"""`llmgw ctl apply -f FILE`, as pure functions: which sections a file names, what it would
change against the live state, and which of its references point at nothing.

A file writes only what it names, as `kubectl apply` does: a section it omits
(`engines:`, `catalog:`, `deployments:`) is left as the cluster has it. Without
this, a file with no `engines:` took the default (llama.cpp) for the cluster's
desired engines, and every node started an install. What the live state holds
and a named section omits is deleted only with `--prune`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import msgspec

from llmgw_core.adapter_rules import adapters_problem, all_adapters, deployment_meets_adapters, folded
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, EngineSpec
from llmgw_core.limits import engine_problem, profile_problem
from llmgw_core.validate import names_problems
from llmgw_placement.config import ServerConfig

SECTIONS = ("engines", "catalog", "deployments", "adapters")
# Fields that say who wrote a value, not what it asks for.
_BOOKKEEPING = frozenset({"traceparent"})


@dataclass(frozen=True)
class Live:
    """The desired state as the buckets hold it now (`engines` None: never written), and the
    revision each key was read at ((kind, name) as in `Change`; absent: no value)."""

    engines: tuple[EngineSpec, ...] | None
    catalog: dict[str, Profile]
    deployments: dict[str, Deployment]
    revisions: dict[tuple[str, str], int] = field(default_factory=dict)

    def value(self, kind: str, name: str) -> Any:
        if kind == "engines":
            return self.engines
        if kind == "adapter":
            return all_adapters(self.catalog).get(name)
        return (self.catalog if kind == "profile" else self.deployments).get(name)


@dataclass(frozen=True)
class Change:
    # "engines", "profile", "deployment" or "adapter" (said; written as its base profile).
    kind: str
    name: str
    # "added", "changed", "unchanged", "deleted" (with --prune) or "kept" (live, not in the
    # file, no --prune).
    action: str
    # "replicas: 1 -> 2", for a changed one.
    fields: tuple[str, ...] = ()

    def line(self) -> str:
        what = f"{self.kind} {self.name}" if self.name else self.kind
        said = {"kept": "not in the file, kept (--prune deletes it)"}.get(self.action, self.action)
        return f"{what}: {said}" + (f" ({'; '.join(self.fields)})" if self.fields else "")


@dataclass(frozen=True)
class Plan:
    changes: tuple[Change, ...]
    # The sections the file does not name: left as they are.
    absent: tuple[str, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    profiles: dict[str, Profile] = field(default_factory=dict)
    deployments: dict[str, Deployment] = field(default_factory=dict)

    def of(self, action: str, kind: str = "") -> list[Change]:
        return [c for c in self.changes if c.action == action and (not kind or c.kind == kind)]

    def lines(self) -> list[str]:
        out = [f"{s}: not in the file, left as it is" for s in self.absent]
        return out + [c.line() for c in self.changes]

    def counts(self) -> str:
        return ", ".join(
            f"{len(self.of(action))} {action}" for action in ("added", "changed", "deleted", "unchanged")
        )


def named_sections(raw: bytes) -> frozenset[str]:
    """The sections a server.yaml names (present, even if empty: `deployments: []` names none)."""
    top = msgspec.yaml.decode(raw)
    return frozenset(s for s in SECTIONS if isinstance(top, dict) and s in top)


def _shown(value: Any) -> str:
    return msgspec.json.encode(value).decode()


def changed_fields(old: msgspec.Struct, new: msgspec.Struct) -> tuple[str, ...]:
    """`field: old -> new` for each field that differs, bookkeeping left out."""
    a = {k: msgspec.to_builtins(v) for k, v in msgspec.structs.asdict(old).items()}
    b = {k: msgspec.to_builtins(v) for k, v in msgspec.structs.asdict(new).items()}
    return tuple(
        f"{k}: {_shown(a.get(k))} -> {_shown(b.get(k))}"
        for k in sorted(a.keys() | b.keys())
        if k not in _BOOKKEEPING and a.get(k) != b.get(k)
    )


def _engines_text(engines: tuple[EngineSpec, ...]) -> str:
    return ", ".join(" ".join(x for x in (e.name, e.version, e.source) if x) for e in engines) or "none"


def _diff(
    kind: str,
    live: dict[str, Any],
    wanted: dict[str, Any],
    prune: bool,
) -> list[Change]:
    out = []
    for name in sorted(live.keys() | wanted.keys()):
        if name not in live:
            out.append(Change(kind, name, "added"))
        elif name not in wanted:
            out.append(Change(kind, name, "deleted" if prune else "kept"))
        else:
            fields = changed_fields(live[name], wanted[name])
            out.append(Change(kind, name, "changed" if fields else "unchanged", fields))
    return out


def _with_adapters(
    config: ServerConfig, named: Collection[str], live: Live, profiles: dict[str, Profile], prune: bool
) -> dict[str, Profile]:
    """The profiles to write (`profiles`: the file's catalog, where it names one), each holding
    the adapters it is to hold. A file that names no `adapters:` leaves the cluster's as they
    are, on the profiles it rewrites too; one that names them without a `catalog:` rewrites
    only the bases whose adapters change. What the file omits is deleted only with `prune`."""
    if "adapters" not in named:
        return {
            n: msgspec.structs.replace(p, adapters=live.catalog[n].adapters) if n in live.catalog else p
            for n, p in profiles.items()
        }
    wanted = [a.wire() for a in config.adapters]
    if not prune:
        listed = {a.name for a in wanted}
        wanted += [a for a in all_adapters(live.catalog).values() if a.name not in listed]
    if "catalog" in named:
        return folded(profiles, wanted)
    return {n: p for n, p in folded(live.catalog, wanted).items() if p.adapters != live.catalog[n].adapters}


def plan(config: ServerConfig, named: Collection[str], live: Live, *, prune: bool) -> Plan:
    """What applying `config` (its `named` sections only) would change in `live`."""
    changes: list[Change] = []
    profiles = {p.name: p.wire() for p in config.catalog} if "catalog" in named else {}
    profiles = _with_adapters(config, named, live, profiles, prune)
    deployments = {d.name: d.wire() for d in config.deployments} if "deployments" in named else {}
    if "engines" in named:
        if live.engines is None:
            changes.append(Change("engines", "", "added", (_engines_text(config.engines),)))
        elif tuple(live.engines) != tuple(config.engines):
            changes.append(
                Change(
                    "engines",
                    "",
                    "changed",
                    (f"{_engines_text(live.engines)} -> {_engines_text(config.engines)}",),
                )
            )
        else:
            changes.append(Change("engines", "", "unchanged"))
    if "catalog" in named:
        changes += _diff("profile", live.catalog, profiles, prune)
    elif "adapters" in named:
        # Only the bases whose adapters change are written.
        changes += [
            Change("profile", n, "changed", changed_fields(live.catalog[n], p))
            for n, p in sorted(profiles.items())
        ]
    if "adapters" in named:
        wanted = {a.name: a.wire() for a in config.adapters}
        changes += _diff("adapter", all_adapters(live.catalog), wanted, prune)
    if "deployments" in named:
        changes += _diff("deployment", live.deployments, deployments, prune)
    return Plan(
        changes=tuple(changes),
        # Adapters ride on their base profiles: a file without them says nothing of them.
        absent=tuple(s for s in SECTIONS if s not in named and s != "adapters"),
        engines=config.engines,
        profiles=profiles,
        deployments=deployments,
    )


def moved(the_plan: Plan, before: Live, now: Live) -> list[str]:
    """What another writer changed, between `before` (what the plan was made from) and `now`,
    of the objects the plan names, one line each; empty when none moved.

    Any of them the file names, written by the plan or not: a plan that said `unchanged` of
    what another writer changed meanwhile is no longer true either. One the file leaves alone
    (`kept`) is not the plan's."""
    out = []
    for change in the_plan.changes:
        k = (change.kind, change.name)
        if change.action == "kept":
            continue
        if before.revisions.get(k, 0) == now.revisions.get(k, 0):
            continue
        was, is_now = before.value(*k), now.value(*k)
        what = f"{change.kind} {change.name}" if change.name else change.kind
        if was is None and is_now is None:
            out.append(f"{what}: written by another writer (a value that does not decode)")
        elif was is None:
            out.append(f"{what}: added by another writer")
        elif is_now is None:
            out.append(f"{what}: deleted by another writer")
        elif change.kind == "engines":
            out.append(f"{what}: changed by another writer ({_engines_text(was)} -> {_engines_text(is_now)})")
        else:
            fields = changed_fields(was, is_now)
            out.append(f"{what}: changed by another writer" + (f" ({'; '.join(fields)})" if fields else ""))
    return out


def reference_problems(
    config: ServerConfig,
    named: Collection[str],
    live: Live,
    the_plan: Plan,
    *,
    engines: Collection[str],
    path: str,
) -> list[str]:
    """Every reference the applied state would hold to nothing, each with where it is (the
    file and the path in it); empty when the file may be applied."""
    problems: list[str] = []
    if "engines" in named:
        for i, spec in enumerate(config.engines):
            problem = engine_problem("the desired engines", spec.name, engines)
            if problem:
                problems.append(f"{path}: $.engines[{i}].name: {problem}")
    if "catalog" in named:
        for i, profile in enumerate(config.catalog):
            problem = engine_problem(f"profile {profile.name}", profile.engine, engines)
            if problem:
                problems.append(f"{path}: $.catalog[{i}].engine: {problem}")
    deleted = {(c.kind, c.name) for c in the_plan.of("deleted")}
    catalog = {n for n in live.catalog if ("profile", n) not in deleted} | set(the_plan.profiles)
    for i, dep in enumerate(config.deployments if "deployments" in named else ()):
        problem = profile_problem(dep.name, dep.profile, catalog)
        if problem:
            problems.append(f"{path}: $.deployments[{i}].profile: {problem}")
    # A model name routes to one deployment: the file's may not take another's name or alias.
    if "deployments" in named:
        left = [d for n, d in sorted(live.deployments.items()) if ("deployment", n) not in deleted]
        for i, problem in names_problems(config.deployments, left):
            problems.append(f"{path}: $.deployments[{i}]: {problem}")
    # An adapter's base must be in the catalog as applied, and its name routes to nothing else.
    catalog_after = {
        n: p for n, p in live.catalog.items() if ("profile", n) not in deleted
    } | the_plan.profiles
    deployments_after = {
        n: d for n, d in live.deployments.items() if ("deployment", n) not in deleted
    } | the_plan.deployments
    if "adapters" in named:
        wired = [a.wire() for a in config.adapters]
        found = adapters_problem(wired, catalog_after, deployments_after.values())
        if found is not None:
            problems.append(f"{path}: $.adapters[{found[0]}]: {found[1]}")
    elif "deployments" in named:
        held = all_adapters(catalog_after)
        for i, dep in enumerate(config.deployments):
            problem = deployment_meets_adapters(dep, held)
            if problem:
                problems.append(f"{path}: $.deployments[{i}]: {problem}")
    # A deployment the file leaves alone must not lose its profile to --prune.
    for name, stored in sorted(live.deployments.items()):
        kept = name not in the_plan.deployments and ("deployment", name) not in deleted
        if kept and stored.profile in live.catalog and stored.profile not in catalog:
            problems.append(
                f"{path}: --prune would delete profile {stored.profile}, which deployment {name} uses "
                f"(it is not in the file, so it stays): name the profile in the file, or delete "
                f"the deployment"
            )
    return problems
