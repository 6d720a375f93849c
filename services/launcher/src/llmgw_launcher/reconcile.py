"""Desired against running, as a pure diff."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw_core.engines import ShardSpec


@dataclass(frozen=True)
class Diff:
    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


def diff(desired: Mapping[str, ShardSpec], observed: Mapping[str, ShardSpec]) -> Diff:
    """Sorted keys to start, stop and replace.

    A spec that differs only in bookkeeping (pool, fabric name, fingerprint)
    is not changed: restarting a loaded 70B model for a label is a bug.
    """
    added = sorted(set(desired) - set(observed))
    removed = sorted(set(observed) - set(desired))
    changed = sorted(
        k for k in set(desired) & set(observed)
        if desired[k].process_view() != observed[k].process_view()
    )  # fmt: skip
    return Diff(tuple(added), tuple(removed), tuple(changed))
