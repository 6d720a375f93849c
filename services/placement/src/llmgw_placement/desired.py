"""Desired state as placement seeds and keeps it: what server.yaml would write, how two
placements' files differ, and which stored revision of a key is the last good one.

Pure functions over plain data; the service publishes, watches and reads history.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

import msgspec

from .config import ServerConfig

T = TypeVar("T", bound=msgspec.Struct)


class PlacementFile(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", tag=True):
    """`<prefix>.placement.file` (plain NATS): what one placement's server.yaml would seed.

    Each placement sends its own now and then; another with a different file is
    warned about, naming the entries that differ (their digests, not their values).
    """

    placement: str
    # Of every entry together: equal digests, equal files.
    digest: str
    # "engines", "profile NAME", "deployment NAME" -> a digest of that entry.
    entries: dict[str, str] = {}
    at: float = 0.0


def _digest(value: object) -> str:
    data = msgspec.json.encode(msgspec.to_builtins(value), order="sorted")
    return hashlib.sha256(data).hexdigest()[:16]


def file_entries(config: ServerConfig) -> dict[str, str]:
    """Each thing server.yaml seeds, by name, with a digest of what it would write."""
    entries = {"engines": _digest(config.engines)}
    for profile in config.profiles().values():
        entries[f"profile {profile.name}"] = _digest(profile)
    for dep in config.deployments:
        entries[f"deployment {dep.name}"] = _digest(dep.wire())
    return entries


def placement_file(identity: str, config: ServerConfig) -> PlacementFile:
    entries = file_entries(config)
    return PlacementFile(placement=identity, digest=_digest(sorted(entries.items())), entries=entries)


def file_difference(mine: PlacementFile, theirs: PlacementFile, *, limit: int = 8) -> str | None:
    """One line saying how another placement's server.yaml differs from this one's, naming
    the entries (at most `limit`); None when the files seed the same."""
    if mine.digest == theirs.digest:
        return None
    parts = []
    for name in sorted(mine.entries.keys() | theirs.entries.keys()):
        here, there = mine.entries.get(name), theirs.entries.get(name)
        if here == there:
            continue
        if here is None:
            parts.append(f"{name} only in {theirs.placement}'s")
        elif there is None:
            parts.append(f"{name} only in {mine.placement}'s")
        else:
            parts.append(f"{name} differs")
    if not parts:
        parts.append("the entries are the same but the files' digests differ")
    if len(parts) > limit:
        parts[limit:] = [f"{len(parts) - limit} more"]
    return (
        f"placement {theirs.placement}'s server.yaml differs from this placement's ({mine.placement}): "
        + "; ".join(parts)
    )


def last_good(
    history: list[tuple[int, bytes | None]], judge: Callable[[bytes], T | str]
) -> tuple[int, T] | None:
    """The newest revision of a key that `judge` accepts, from its history newest first
    ((revision, value), None for a delete); None when a delete comes first or none is good.

    `judge` returns the value, or why it cannot be used. A delete ends the search: what
    was written before it was deleted on purpose and must not come back.
    """
    for revision, data in history:
        if data is None:
            return None
        judged = judge(data)
        if not isinstance(judged, str):
            return revision, judged
    return None
