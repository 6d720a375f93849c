"""The rules of a valid deployment and profile, as stored on the bus: one set of rules
for every part that reads or writes them.

Decoding proves a value's shape; these rules prove it makes sense where it was found.
Placement dead-letters a stored value that breaks one, with the rule, counts it and
ignores it: the key keeps its last good value, and nothing is placed, removed or retried
because of it. Placement's API and `llmgw ctl` refuse a write that breaks one, with the
same words, before it is stored. The single-field rules (names, keys, replica counts,
aliases, references to the catalog) are in `limits`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .adapter_rules import profile_adapters_problem
from .events import Autoscale, Deployment, Profile
from .limits import Routed, aliases_problem, key_problem, name_problem, replicas_problem, shown

__all__ = [
    "DEFAULT_MAX_REPLICAS",
    "autoscale_problem",
    "check_deployment",
    "check_profile",
    "deployments_problem",
    "names_problem",
    "names_problems",
]

DEFAULT_MAX_REPLICAS = 10_000


def check_deployment(key: str, dep: Deployment, *, max_replicas: int = DEFAULT_MAX_REPLICAS) -> str | None:
    """Why the deployment stored under `key` must not be acted on; None when it may."""
    # Before anything else: a name or key that is too long or holds a dot never becomes part
    # of a subject.
    problem = name_problem("deployment", dep.name) or key_problem(key, "deployment")
    if problem is not None:
        return problem
    if dep.name != key:
        return (
            f"key {key} holds a deployment named {dep.name}: a deployment is stored under its own name "
            f"(write it to key {dep.name}, and delete key {key})"
        )
    return (
        name_problem("profile", dep.profile)
        or replicas_problem(dep.name, dep.replicas, max_replicas)
        or aliases_problem(dep.name, dep.aliases)
        or (autoscale_problem(dep.name, dep.autoscale, max_replicas) if dep.autoscale is not None else None)
    )


def autoscale_problem(deployment: str, a: Autoscale, max_replicas: int = DEFAULT_MAX_REPLICAS) -> str | None:
    """Why a deployment's autoscale bounds cannot be followed; None when they can."""
    where = f"deployment {deployment}: autoscale"
    if a.min_replicas < 0:
        return f"{where} min_replicas is {a.min_replicas}: it is 0 (scale to zero) or more"
    if a.max_replicas < 1:
        return f"{where} max_replicas is {a.max_replicas}: it is 1 or more"
    if a.min_replicas > a.max_replicas:
        return (
            f"{where} min_replicas {a.min_replicas} is above max_replicas {a.max_replicas}: "
            "min_replicas must be at most max_replicas"
        )
    if a.max_replicas > max_replicas:
        return (
            f"{where} max_replicas {a.max_replicas} is over the maximum of {max_replicas} "
            "(placement's max_replicas in server.yaml)"
        )
    if not math.isfinite(a.target_in_flight) or a.target_in_flight <= 0:
        return (
            f"{where} target_in_flight is {a.target_in_flight:g}: the requests in flight per replica "
            "it aims at is more than 0 (4 is a fair start)"
        )
    if not math.isfinite(a.scale_down_after_s) or a.scale_down_after_s < 0:
        return f"{where} scale_down_after_s is {a.scale_down_after_s:g}: it is 0 seconds or more"
    return None


def check_profile(key: str, profile: Profile) -> str | None:
    """Why the catalog entry stored under `key` must not be used; None when it may."""
    problem = name_problem("profile", profile.name) or key_problem(key, "profile")
    if problem is not None:
        return problem
    if profile.name != key:
        return (
            f"key {key} holds a profile named {profile.name}: a profile is stored under its own name "
            f"(write it to key {profile.name}, and delete key {key})"
        )
    return profile_adapters_problem(profile)


# --- the names a client sends ------------------------------------------------------------------
#
# A model name routes to one deployment: its own name first, else the deployment whose alias it
# is. An alias equal to another deployment's name is never routed by (the name wins), and one
# two deployments share routes to whichever sorts first: either way a deployment silently
# serves, or fails to serve, what its aliases promise, and a key scoped to a name was matched
# against the alias and reached the other deployment. So every writer refuses a deployment
# whose names meet another's, naming both.


class _Routes:
    """The model names some deployments hold: their names, and their aliases."""

    def __init__(self) -> None:
        self.named: set[str] = set()
        self.aliased: dict[str, str] = {}

    def add(self, dep: Routed) -> None:
        self.named.add(dep.name)
        for alias in dep.aliases:
            self.aliased.setdefault(alias, dep.name)

    def problem(self, dep: Routed) -> str | None:
        where = f"deployment {dep.name}"
        why = "a model name routes to one deployment"
        owner = self.aliased.get(dep.name)
        if owner is not None and owner != dep.name:
            return (
                f"{where}: its name is an alias of deployment {owner}: {why}; remove the alias from "
                f"{owner} first, or name this deployment otherwise"
            )
        for alias in dep.aliases:
            if alias == dep.name:
                continue
            if alias in self.named:
                return (
                    f"{where}: alias {shown(alias)} is the name of deployment {alias}: {why}; "
                    f"remove the alias from {dep.name}"
                )
            owner = self.aliased.get(alias)
            if owner is not None:
                return (
                    f"{where}: alias {shown(alias)} is also an alias of deployment {owner}: {why}; "
                    "keep it on one of them"
                )
        return None


def names_problem(dep: Routed, others: Iterable[Routed]) -> str | None:
    """Why `dep`'s name and aliases cannot stand beside `others` (the other deployments; one
    named as `dep` is its own earlier value and left out); None when they can."""
    routes = _Routes()
    for other in sorted(others, key=lambda d: d.name):
        if other.name != dep.name:
            routes.add(other)
    return routes.problem(dep)


def names_problems(written: Sequence[Routed], others: Iterable[Routed]) -> list[tuple[int, str]]:
    """Each of `written` (deployments stored together, each name once) whose names meet those of
    `others` (the deployments left beside them), by its index, with why."""
    mine = {dep.name for dep in written}
    routes = _Routes()
    for other in sorted(others, key=lambda d: d.name):
        if other.name not in mine:
            routes.add(other)
    found = []
    for i, dep in enumerate(written):
        problem = routes.problem(dep)
        if problem is not None:
            found.append((i, problem))
    return found


def deployments_problem(deployments: Sequence[Routed]) -> tuple[int, str] | None:
    """The first entry of a list of deployments (a server.yaml's) that repeats an earlier one's
    name or meets its names (`names_problem`), with why; None when every one stands."""
    seen: dict[str, int] = {}
    routes = _Routes()
    for i, dep in enumerate(deployments):
        if dep.name in seen:
            return i, (
                f"deployment {dep.name} is listed twice (first at $.deployments[{seen[dep.name]}]): "
                "list each deployment once"
            )
        seen[dep.name] = i
        problem = routes.problem(dep)
        if problem is not None:
            return i, problem
        routes.add(dep)
    return None
