"""What the launcher started, kept on disk so that its successor can adopt it.

`Records` is the files; `RecordWriter` is how the running launcher writes
them: in a worker thread (an fsync on the event loop stalls every other
shard, heartbeat and status write behind one disk flush), in batches, and
coalesced per shard (of several writes of one shard that wait together, only
the newest reaches the disk). A batch's files are written and fsynced by a
few threads side by side, so that the filesystem can commit their fsyncs
together instead of one disk flush after another.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import anyio
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

    def path(self, key: str) -> Path:
        return self.dir / f"{key}.json"

    def save(self, record: ShardRecord) -> None:
        """Atomically: a crash mid-write leaves the previous record, never half a file."""
        path = self.path(record.key)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(msgspec.json.encode(record))
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)

    def sync_dir(self) -> None:
        """Make renames and unlinks in the directory durable."""
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

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
    done: anyio.Event = field(default_factory=anyio.Event)


class RecordWriter:
    """`await writer.save(record)` returns once the record (or a newer one of its shard) is on disk.

    Writes wait in an open batch while one batch is being written; the task
    that finds no write in progress writes batches until none is left. A
    write that fails raises RecordError in every task that waited on it;
    the others in the batch are unaffected.
    """

    # Threads that write one batch's files side by side.
    PARALLEL = 8

    def __init__(self, records: Records) -> None:
        self.records = records
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
        if not self._writing:
            self._writing = True
            # Shielded: the waiters of this batch and of the ones queued
            # behind it depend on this task to write them.
            with anyio.CancelScope(shield=True):
                try:
                    while self._open.ops:
                        current, self._open = self._open, _Batch()
                        try:
                            current.errors = await self._write_batch(current.ops)
                        except Exception as exc:  # a bug here costs these writes, not the launcher
                            current.errors = {
                                k: f"cannot write the shard record of {k}: {exc}" for k in current.ops
                            }
                        finally:
                            current.done.set()
                        self.batches += 1
                        self.writes += len(current.ops)
                finally:
                    self._writing = False
        await batch.done.wait()
        error = batch.errors.get(key)
        if error is not None:
            raise RecordError(error)

    async def _write_batch(self, ops: dict[str, ShardRecord | None]) -> dict[str, str]:
        """Every write of the batch, in up to PARALLEL worker threads, then one directory sync."""
        errors: dict[str, str] = {}
        items = list(ops.items())
        chunks = [items[i :: self.PARALLEL] for i in range(min(self.PARALLEL, len(items)))]
        async with anyio.create_task_group() as tg:
            for chunk in chunks:
                tg.start_soon(self._write_chunk, chunk, errors)
        try:
            await anyio.to_thread.run_sync(self.records.sync_dir)
        except OSError as exc:
            for key in ops:
                errors.setdefault(key, f"cannot sync {self.records.dir}: {exc}")
        return errors

    async def _write_chunk(self, chunk: list[tuple[str, ShardRecord | None]], errors: dict[str, str]) -> None:
        errors.update(await anyio.to_thread.run_sync(self._write, chunk))

    def _write(self, chunk: list[tuple[str, ShardRecord | None]]) -> dict[str, str]:
        """In a worker thread: these writes, one after another."""
        errors: dict[str, str] = {}
        for key, record in chunk:
            try:
                if record is None:
                    self.records.remove(key)
                else:
                    self.records.save(record)
            except OSError as exc:
                errors[key] = f"cannot write the shard record {self.records.path(key)}: {exc}"
        return errors
