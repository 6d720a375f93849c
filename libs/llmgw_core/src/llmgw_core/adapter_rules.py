"""What may be written of LoRA adapters (`adapters.Adapter`) beside the catalog and the
deployments: each adapter on its base, names that route to one thing, at most ADAPTERS_MAX on a
base (docs/adapters.md).

Pure: the rules here read plain values; nothing touches the bus, a disk or the network.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping

import msgspec

from .adapters import (
    ADAPTER_ENGINES,
    ADAPTERS_MAX,
    LIMIT_MAX,
    LORA_RANKS,
    MAX_LORA_RANK_DEFAULT,
    MAX_LORAS_DEFAULT,
    RUNTIME_ENGINES,
    SCALE_MAX,
    Adapter,
)
from .events import Profile
from .limits import NAME_MAX, Routed, name_problem, shown
from .sources import ModelSource, SourceError


def adapter_problem(adapter: Adapter, catalog: Mapping[str, Profile]) -> str | None:
    """Why `adapter` cannot be served on its base; None when it can. `catalog`: the profiles it
    would stand beside."""
    where = f"adapter {adapter.name}"
    problem = name_problem("adapter", adapter.name, limit=NAME_MAX) or name_problem("profile", adapter.base)
    if problem is not None:
        return problem
    if not math.isfinite(adapter.scale) or not 0 < adapter.scale <= SCALE_MAX:
        return f"{where}: scale {adapter.scale:g} is outside (0, {SCALE_MAX:g}]; 1 applies it as trained"
    for what, limit in (("rpm", adapter.rpm), ("tpm", adapter.tpm)):
        if type(limit) is not int or not 0 <= limit <= LIMIT_MAX:
            return (
                f"{where}: {what} {limit!r} is not a whole number from 0 to {LIMIT_MAX:,}; "
                "0 sets no limit of its own"
            )
    base = catalog.get(adapter.base)
    if base is None:
        known = ", ".join(sorted(catalog)[:8]) or "none"
        return f"{where}: base profile {adapter.base} is not in the catalog (profiles: {known}); add it first"
    if base.engine not in ADAPTER_ENGINES:
        return (
            f"{where}: base profile {adapter.base} runs on {base.engine}, which llmgw serves no "
            f"adapters on; engines with adapters: {', '.join(sorted(ADAPTER_ENGINES))}"
        )
    try:
        source = adapter.model_source
    except SourceError as exc:
        return str(exc)
    if base.engine in RUNTIME_ENGINES:
        return _runtime_problem(where, base, source)
    if source.kind == "hf" and not source.file:
        return f"{where}: source {source} names a repository, not the adapter's .gguf file in it"
    return None


def _runtime_problem(where: str, base: Profile, source: ModelSource) -> str | None:
    """Why an adapter cannot be loaded at run time on `base`'s engine (vLLM, the simulator):
    its source is a PEFT directory (adapter_config.json and adapter_model.safetensors), and the
    profile's rank bound is one vLLM accepts."""
    one_file = source.kind == "file" and source.path.endswith(".gguf")
    if one_file or source.kind == "url" or (source.kind == "hf" and source.file):
        return (
            f"{where}: source {source} names one file; {base.engine} loads a PEFT adapter's "
            "directory: hf://<org>/<repo> or file:///path/to/adapter/"
        )
    if base.max_lora_rank and base.max_lora_rank not in LORA_RANKS:
        ranks = ", ".join(map(str, LORA_RANKS))
        return f"{where}: base profile {base.name} has max_lora_rank {base.max_lora_rank}; vLLM takes {ranks}"
    return None


def profile_adapters_problem(profile: Profile) -> str | None:
    """Why the adapters a stored profile holds cannot be served on it; None when they can: each
    names this profile as its base, once, and passes `adapter_problem`."""
    seen: set[str] = set()
    for adapter in profile.adapters:
        if adapter.base != profile.name:
            return (
                f"profile {profile.name} holds adapter {adapter.name}, whose base is {adapter.base}: "
                f"an adapter is kept on its own base profile"
            )
        if adapter.name in seen:
            return f"profile {profile.name} holds adapter {adapter.name} twice"
        seen.add(adapter.name)
        problem = adapter_problem(adapter, {profile.name: profile})
        if problem is not None:
            return f"profile {profile.name}: {problem}"
    return None


def adapters_problem(
    adapters: Iterable[Adapter], catalog: Mapping[str, Profile], deployments: Iterable[Routed]
) -> tuple[int, str] | None:
    """The first of `adapters` (stored together, as a file lists them) that cannot be served,
    with why: its own rules (`adapter_problem`), a name listed twice, a name a deployment holds
    (its name or an alias: a model name routes to one thing), or more than ADAPTERS_MAX on one
    base. None when every one stands."""
    routed: dict[str, str] = {}
    for dep in sorted(deployments, key=lambda d: d.name):
        routed.setdefault(dep.name, f"the name of deployment {dep.name}")
        for alias in dep.aliases:
            routed.setdefault(alias, f"an alias of deployment {dep.name}")
    seen: dict[str, int] = {}
    per_base: dict[str, int] = {}
    for i, adapter in enumerate(adapters):
        problem = adapter_problem(adapter, catalog)
        if problem is not None:
            return i, problem
        if adapter.name in seen:
            return i, (
                f"adapter {adapter.name} is listed twice (first at $.adapters[{seen[adapter.name]}]): "
                "list each adapter once"
            )
        seen[adapter.name] = i
        holder = routed.get(adapter.name)
        if holder is not None:
            return i, (
                f"adapter {adapter.name}: the name is {holder}: a model name routes to one deployment "
                "or adapter; name the adapter otherwise"
            )
        per_base[adapter.base] = per_base.get(adapter.base, 0) + 1
        if per_base[adapter.base] > ADAPTERS_MAX:
            return i, (
                f"adapter {adapter.name}: base profile {adapter.base} would have more than "
                f"{ADAPTERS_MAX} adapters; serve the rest on another profile of the same model"
            )
    return None


def deployment_meets_adapters(dep: Routed, adapters: Collection[str]) -> str | None:
    """Why a deployment's name or an alias cannot be written beside the stored `adapters`
    (their names); None when it can."""
    for name in (dep.name, *dep.aliases):
        if name in adapters:
            what = "its name" if name == dep.name else f"alias {shown(name)}"
            return (
                f"deployment {dep.name}: {what} is the name of adapter {name}: a model name routes "
                "to one deployment or adapter; delete the adapter first, or name this otherwise"
            )
    return None


def folded(catalog: Mapping[str, Profile], adapters: Iterable[Adapter]) -> dict[str, Profile]:
    """The profiles of `catalog` with the `adapters` that name each as base (sorted by name),
    in place of the ones they held."""
    by_base: dict[str, list[Adapter]] = {}
    for adapter in adapters:
        by_base.setdefault(adapter.base, []).append(adapter)
    out = {}
    for name, profile in catalog.items():
        mine = tuple(sorted(by_base.get(name, ()), key=lambda a: a.name))
        out[name] = profile if mine == profile.adapters else msgspec.structs.replace(profile, adapters=mine)
    return out


def all_adapters(catalog: Mapping[str, Profile]) -> dict[str, Adapter]:
    """Every adapter the catalog's profiles hold, by name."""
    return {a.name: a for p in catalog.values() for a in p.adapters}


def max_loras(profile: Profile) -> int:
    """How many adapters one replica of `profile` holds at once (a runtime engine's)."""
    return profile.max_loras or MAX_LORAS_DEFAULT


def max_lora_rank(profile: Profile) -> int:
    """The largest adapter rank a replica of `profile` serves (a runtime engine's)."""
    return profile.max_lora_rank or MAX_LORA_RANK_DEFAULT
