"""Desired state read from the bus, checked as a whole before placement acts on it.

Decoding proves a value's shape; these rules prove it makes sense where it
was found. A value that breaks one is dead-lettered with the rule, counted,
and ignored: the key keeps its last good value, and nothing is placed,
removed or retried because of it.
"""

from __future__ import annotations

from llmgw_core.engines import Profile
from llmgw_core.events import Deployment

DEFAULT_MAX_REPLICAS = 10_000


def check_deployment(key: str, dep: Deployment, *, max_replicas: int = DEFAULT_MAX_REPLICAS) -> str | None:
    """Why the deployment stored under `key` must not be acted on; None when it may."""
    if dep.name != key:
        return (
            f"key {key} holds a deployment named {dep.name}: a deployment is stored under its own name "
            f"(write it to key {dep.name}, and delete key {key})"
        )
    if dep.replicas > max_replicas:
        return (
            f"deployment {dep.name} asks for {dep.replicas} replicas, over the maximum of {max_replicas} "
            "(placement's max_replicas in server.yaml)"
        )
    return None


def check_profile(key: str, profile: Profile) -> str | None:
    """Why the catalog entry stored under `key` must not be used; None when it may."""
    if profile.name != key:
        return (
            f"key {key} holds a profile named {profile.name}: a profile is stored under its own name "
            f"(write it to key {profile.name}, and delete key {key})"
        )
    return None
