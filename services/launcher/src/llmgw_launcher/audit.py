"""What the status bucket says of this node's shards, against what this launcher runs: a pure diff.

A shard's status is written by whoever ran it last: a second machine given this
node's id, or a launcher that ran here before. `ready` at a port no engine of
this node holds stays so while this launcher's own runner does not change state,
and placement and the gateway believe it. So the launcher compares, every few
seconds: a stored status that is not the one its runner last published is
written again, and a stored status of a shard it does not run is removed. A
difference counts only when two audits in a row find the same stored value, so
a status still on its way to the bucket is not written twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from llmgw_core.events import ShardStatus


@dataclass(frozen=True)
class Corrections:
    # Keys whose runner's own last status is to be written again.
    rewrite: tuple[str, ...] = ()
    # Keys of shards this launcher does not run: their stored statuses go.
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rewrite or self.remove)


Suspects = dict[str, ShardStatus | None]


def audit(
    stored: Mapping[str, ShardStatus],
    mine: Mapping[str, ShardStatus | None],
    suspects: Mapping[str, ShardStatus | None],
) -> tuple[Corrections, Suspects]:
    """What to correct now, and what the next audit checks again.

    `stored`: the bucket's statuses of this node's shards; `mine`: each shard this
    launcher runs, with the status its runner last published (None before its
    first, as while an adopted engine is checked); `suspects`: what the last audit
    found wrong, by the stored value it found.
    """
    wrong: Suspects = {}
    for key in sorted(set(stored) | {k for k, s in mine.items() if s is not None}):
        have = stored.get(key)
        if key in mine:
            want = mine[key]
            if want is None or have == want:
                continue
        wrong[key] = have
    confirmed = [k for k, have in wrong.items() if k in suspects and suspects[k] == have]
    fix = Corrections(
        rewrite=tuple(k for k in confirmed if k in mine),
        remove=tuple(k for k in confirmed if k not in mine),
    )
    return fix, {k: v for k, v in wrong.items() if k not in confirmed}
