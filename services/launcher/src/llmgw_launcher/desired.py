"""What placement wants run on this node: each shard spec and the bucket revision it came at,
as the spec watch yields them, and checked now and then against a fresh read of the bucket.

A watch can go quiet and stay alive: its consumer sends heartbeats and delivers nothing (a
NATS server cut from its cluster while the node's only connection is to it, then healed; a
consumer paused). The node would then never hear that its replica moved, and its engine
would serve on beside the new one. So the launcher reads its specs afresh every
`spec_resync_s` and takes from that read what the watch missed, by revision: a newer value or
delete, or a key gone from the bucket at a revision the read has passed.
"""

from __future__ import annotations

from llmgw_core.bus import KVChange
from llmgw_core.engines import ShardSpec


class Desired:
    """The specs this node should run (`specs`, accepted ones only) and the revision of every
    key heard, accepted or not (`revisions`), so that a fresh read tells what is news."""

    def __init__(self) -> None:
        self.specs: dict[str, ShardSpec] = {}
        self.revisions: dict[str, int] = {}

    def heard(self, key: str, revision: int) -> None:
        """`key` changed at `revision` (0: gone with its store, whose revisions start again)."""
        if revision:
            self.revisions[key] = revision
        else:
            self.revisions.pop(key, None)

    def missed(self, fresh: dict[str, KVChange[ShardSpec]], through: int) -> list[KVChange[ShardSpec]]:
        """The changes a fresh read (`KV.changes`: each key's last change, and the highest
        revision it saw) shows that this node has not heard: a value or delete at a revision
        past the one heard, and a delete for each spec held whose key the read lacks though it
        has passed the spec's revision (its delete marker removed). A value that does not
        decode is no change here: the watch skips it too, and the key keeps its last spec."""
        out: list[KVChange[ShardSpec]] = []
        for key, change in sorted(fresh.items()):
            if change.error or change.revision <= self.revisions.get(key, 0):
                continue
            if change.value is None and key not in self.specs:
                continue  # the delete of a spec not held here: nothing to act on
            out.append(change)
        for key in sorted(self.specs):
            if key not in fresh and 0 < self.revisions.get(key, 0) <= through:
                out.append(KVChange(key, None, through))
        return out
