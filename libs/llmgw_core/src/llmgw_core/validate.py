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

from .events import Autoscale, Deployment, Profile
from .limits import aliases_problem, key_problem, name_problem, replicas_problem

__all__ = ["DEFAULT_MAX_REPLICAS", "autoscale_problem", "check_deployment", "check_profile"]

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
    return None
