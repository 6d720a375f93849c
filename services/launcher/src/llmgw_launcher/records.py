"""What the launcher started, kept on disk so that its successor can adopt it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec
from msgspec import Struct

from llmgw_core.engines import ShardSpec


class ProcRecord(Struct, frozen=True, kw_only=True):
    name: str
    pid: int
    start_time: int
    log: str


class ShardRecord(Struct, frozen=True, kw_only=True):
    key: str
    spec: ShardSpec
    port: int
    procs: tuple[ProcRecord, ...] = ()
    restarts: int = 0
    ready: bool = False


_decoder = msgspec.json.Decoder(ShardRecord)


class Records:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / "shards"
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def save(self, record: ShardRecord) -> None:
        """Atomically: a crash mid-write leaves the previous record, never half a file."""
        path = self._path(record.key)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(record))
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def load_all(self) -> tuple[dict[str, ShardRecord], list[str]]:
        """Every readable record, and a sentence for each that could not be read."""
        records: dict[str, ShardRecord] = {}
        problems: list[str] = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = _decoder.decode(path.read_bytes())
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                problems.append(f"{path}: unreadable shard record ({exc}); ignored")
                continue
            records[record.key] = record
        return records, problems
