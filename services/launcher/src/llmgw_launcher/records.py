"""What the launcher started, kept on disk so that its successor can adopt it.

`Records` is the files; `RecordWriter` is how the running launcher writes
them: in the launcher's file threads, and coalesced per shard (of several
writes of one shard that wait together, only the newest is written).

A record is replaced atomically (a new file renamed over the old one) but not
fsynced. It is there for a launcher that restarts while its engines run on: a
crash of the launcher leaves the kernel's page cache, so the successor reads
every record that was written. Only a crash of the machine loses what was not
flushed, and that takes the engines the records describe with it; a record
torn by it is reported as unreadable and skipped. An fsync per record bought
nothing, and cost the most exactly when a node is busiest: in a burst of 50
engines starting on 2 cores, with nats-server fsyncing every message, every
shard in a batch waited for the batch's last fsync before it could be `ready`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
from msgspec import Struct

from llmgw_core.engines import ShardSpec

from .workers import Workers


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

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def save(self, record: ShardRecord) -> None:
        """Atomically: a launcher that dies mid-write leaves the previous record, never half a file."""
        path = self.path(record.key)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(record))
        tmp.replace(path)

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

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


class RecordError(Exception):
    """A shard record could not be written; retrying (the next attempt) may help."""


@dataclass
class _Batch:
    # key -> the record to write, or None to remove it
    ops: dict[str, ShardRecord | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    # key -> set once that key's write is done: a shard waits for its own file, not the batch
    done: dict[str, anyio.Event] = field(default_factory=dict)


class RecordWriter:
    """`await writer.save(record)` returns once the record (or a newer one of its shard) is written.

    Writes wait in an open batch while one batch is being written; the task
    that finds no write in progress writes batches until none is left. The
    files of a batch are written side by side in the file threads, and each
    waiter returns when its own file is written: on a busy disk creating a
    file can wait for the filesystem's journal, and fifty shards waiting for
    the batch's last file all went `ready` at once, seconds late. A write that
    fails raises RecordError in the task that waited on it; the others are
    unaffected. One shard's writes never overlap: a newer one waits for the
    next batch.
    """

    def __init__(self, records: Records, workers: Workers | None = None) -> None:
        self.records = records
        self.workers = workers or Workers()
        self._open = _Batch()
        self._writing = False
        self.batches = 0
        self.writes = 0

    async def save(self, record: ShardRecord) -> None:
        await self._submit(record.key, record)

    async def remove(self, key: str) -> None:
        await self._submit(key, None)

    async def _submit(self, key: str, record: ShardRecord | None) -> None:
        batch = self._open
        batch.ops[key] = record
        done = batch.done.setdefault(key, anyio.Event())
        if not self._writing:
            self._writing = True
            # Shielded: the waiters of this batch and of the ones queued
            # behind it depend on this task to write them.
            with anyio.CancelScope(shield=True):
                try:
                    while self._open.ops:
                        current, self._open = self._open, _Batch()
                        async with anyio.create_task_group() as tg:
                            for k, r in current.ops.items():
                                tg.start_soon(self._write_one, current, k, r)
                        self.batches += 1
                        self.writes += len(current.ops)
                finally:
                    self._writing = False
        await done.wait()
        error = batch.errors.get(key)
        if error is not None:
            raise RecordError(error)

    async def _write_one(self, batch: _Batch, key: str, record: ShardRecord | None) -> None:
        try:
            await self.workers.files(self._write, key, record)
        except OSError as exc:
            batch.errors[key] = f"cannot write the shard record {self.records.path(key)}: {exc}"
        except Exception as exc:  # a bug here costs this write, not the launcher
            batch.errors[key] = f"cannot write the shard record of {key}: {exc}"
        finally:
            batch.done[key].set()

    def _write(self, key: str, record: ShardRecord | None) -> None:
        """In a file thread."""
        if record is None:
            self.records.remove(key)
        else:
            self.records.save(record)
