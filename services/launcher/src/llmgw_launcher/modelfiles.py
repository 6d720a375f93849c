"""The model files this node's shards found missing, kept until they appear.

A profile whose engine reads a file the node must already hold (`Profile.node_file`: a
`file://` source or an absolute `model_path`) is checked before its engine starts: a
missing file fails the shard once, for good, and the path is added here. The launcher's
heartbeats carry the paths still missing (`Heartbeat.missing_models`), and placement places
the profiles that read them on other nodes. Every heartbeat interval the paths are looked
at again (a `stat` each, in a worker thread), so a file copied onto the node makes the node
a candidate again within about a second, with no command to run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

# Paths kept at most: a node is told about each profile it was given, so this is only a
# bound against a catalog of thousands of absent paths growing every heartbeat.
LIMIT = 256


class MissingModels:
    """The missing paths, in the order they were found; `changed` hears every change."""

    def __init__(self, changed: Callable[[tuple[str, ...]], None] = lambda _paths: None) -> None:
        self._paths: dict[str, None] = {}
        self._changed = changed

    def paths(self) -> tuple[str, ...]:
        return tuple(sorted(self._paths))

    def add(self, path: str) -> None:
        if path in self._paths:
            return
        self._paths[path] = None
        while len(self._paths) > LIMIT:
            del self._paths[next(iter(self._paths))]
        self._changed(self.paths())

    def found(self, present: Iterable[str]) -> None:
        """Forget the paths that exist now (`present`, from `existing` run in a worker thread)."""
        gone = [p for p in present if p in self._paths]
        for path in gone:
            del self._paths[path]
        if gone:
            self._changed(self.paths())


def existing(paths: Iterable[str]) -> list[str]:
    """The paths that exist (blocking: a `stat` each)."""
    return [p for p in paths if os.path.exists(p)]
