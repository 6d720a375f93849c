"""`llmgw ctl backup -o FILE` and `llmgw ctl restore -f FILE`: the desired state to a file, and
back into the store (after a lost NATS store, docs/operations.md).

The desired state is what an operator wrote: the engines, the catalog, the deployments (with
their autoscale bounds), the API keys (their hashes and limits: no secret is ever stored) and
the node intents (cordons, drains). What placement and the nodes write (replicas, shard specs
and statuses, node statuses, lease, usage) is not in it: each is made again from the desired
state and by the nodes themselves.

The file is versioned JSON (`version`; docs/ctl.md shows it). Restored, it is outside bytes:
`parse` bounds its size and every count, checks every name and value as the buckets' readers
do, and raises only BackupError. `plan` (pure) compares it with what the store holds: a
record that is absent or older than the backup is written; one the store holds as the backup
does is left; one stored after the backup was written and different from it is newer, and
a restore refuses (naming each) unless --force.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, DesiredEngines, NodeIntent, encode
from llmgw_core.keys import ApiKey
from llmgw_core.limits import Name
from llmgw_core.subjects import ENGINES_KEY, Names
from llmgw_core.validate import check_deployment, check_profile

from ._errors import Conflict, Refused, UsageError

# The format this llmgw writes and reads; an unknown one is refused, never guessed at.
VERSION = 1
# A backup larger than this is not one llmgw wrote (1,024 keys, 512 deployments and profiles,
# 10,000 node intents take a few MiB).
MAX_BACKUP_BYTES = 64 * 1024 * 1024
# Records of each section a backup may hold.
MAX_RECORDS = 100_000
# Unix seconds: up to the year 5138; a time past it is no time llmgw wrote.
_When = Annotated[float, Meta(ge=0, le=1e11)]


class BackupError(UsageError):
    """A backup file that cannot be restored: what is wrong, where, and what to do (exit 2)."""


class _Versioned(Struct):
    """What is read first of any backup: its format's version."""

    version: int = 0


class Backup(Struct, frozen=True, kw_only=True):
    """One backup: version 1 of the format."""

    version: int
    # The cluster prefix it was taken from (a restore may go to another).
    prefix: Annotated[str, Meta(max_length=64)] = ""
    written_at: _When
    engines: DesiredEngines | None = None
    catalog: Annotated[dict[Name, Profile], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )
    deployments: Annotated[dict[Name, Deployment], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )
    keys: Annotated[dict[Name, ApiKey], Meta(max_length=MAX_RECORDS)] = msgspec.field(default_factory=dict)
    node_intents: Annotated[dict[Name, NodeIntent], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )


class _Sections(Struct, frozen=True, kw_only=True):
    """Version 1 with each record's bytes kept, to be decoded alone: an error then names the
    record (`deployments.chat: … at $.replicas`), where msgspec says `$.deployments[...]`."""

    version: int
    prefix: Annotated[str, Meta(max_length=64)] = ""
    written_at: _When
    # `null` when the backup holds no engines (a Raw cannot be optional).
    engines: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    catalog: Annotated[dict[Name, msgspec.Raw], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )
    deployments: Annotated[dict[Name, msgspec.Raw], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )
    keys: Annotated[dict[Name, msgspec.Raw], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )
    node_intents: Annotated[dict[Name, msgspec.Raw], Meta(max_length=MAX_RECORDS)] = msgspec.field(
        default_factory=dict
    )


_VERSION = msgspec.json.Decoder(_Versioned)
_SECTIONS = msgspec.json.Decoder(_Sections)
_RECORDS: dict[str, msgspec.json.Decoder[Any]] = {
    "catalog": msgspec.json.Decoder(Profile),
    "deployments": msgspec.json.Decoder(Deployment),
    "keys": msgspec.json.Decoder(ApiKey),
    "node_intents": msgspec.json.Decoder(NodeIntent),
}
_ENGINES = msgspec.json.Decoder(DesiredEngines | None)


def parse(data: bytes, where: str) -> Backup:
    """A backup's bytes, checked; BackupError (and nothing else) says what is wrong, where."""
    if len(data) > MAX_BACKUP_BYTES:
        raise BackupError(
            f"{where}: {len(data)} bytes, over the {MAX_BACKUP_BYTES} a backup may take: "
            "this is no backup that `llmgw ctl backup` wrote"
        )
    try:
        version = _VERSION.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackupError(
            f"{where}: not a backup ({exc}); give a file that `llmgw ctl backup -o FILE` wrote"
        ) from exc
    if version != VERSION:
        raise BackupError(
            f"{where}: backup format version {version} is not one this llmgw reads (it reads {VERSION}); "
            "restore it with the llmgw that wrote it, or one that reads its version"
        )
    try:
        raw = _SECTIONS.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BackupError(f"{where}: {exc}; nothing was restored") from exc
    problems: list[str] = []
    decoded: dict[str, dict[str, Any]] = {}
    for section, decoder in _RECORDS.items():
        decoded[section] = {}
        for key, value in sorted(getattr(raw, section).items()):
            try:
                decoded[section][key] = decoder.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                problems.append(f"{section}.{key}: {exc}")
    engines = None
    try:
        engines = _ENGINES.decode(raw.engines)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        problems.append(f"engines: {exc}")
    if not problems:
        backup = Backup(
            version=raw.version,
            prefix=raw.prefix,
            written_at=raw.written_at,
            engines=engines,
            catalog=decoded["catalog"],
            deployments=decoded["deployments"],
            keys=decoded["keys"],
            node_intents=decoded["node_intents"],
        )
        problems = _problems(backup)
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise BackupError(f"{where}: {'; '.join(problems[:5])}{more}; nothing was restored")
    return backup


def _problems(backup: Backup) -> list[str]:
    """What a decoded backup holds that the buckets' readers would refuse, one line each."""
    out: list[str] = []
    for key, profile in sorted(backup.catalog.items()):
        problem = check_profile(key, profile)
        if problem is not None:
            out.append(f"catalog.{key}: {problem}")
    for key, dep in sorted(backup.deployments.items()):
        problem = check_deployment(key, dep)
        if problem is not None:
            out.append(f"deployments.{key}: {problem}")
    named = [("keys", k, v.name) for k, v in backup.keys.items()]
    named += [("node_intents", k, v.node) for k, v in backup.node_intents.items()]
    for section, key, name in sorted(named):
        if name != key:
            out.append(f"{section}.{key}: holds {name!r}: a record is stored under its own name")
    return out


# --- what a backup holds, as records of the buckets ------------------------------


@dataclass(frozen=True)
class Record:
    """One key of one bucket, as a backup holds it; `what` names it to the operator."""

    bucket: str
    key: str
    value: Struct
    what: str


def records(backup: Backup, names: Names) -> list[Record]:
    out: list[Record] = []
    if backup.engines is not None:
        out.append(Record(names.config_bucket, ENGINES_KEY, backup.engines, "engines"))
    out += [Record(names.catalog_bucket, k, v, f"profile {k}") for k, v in sorted(backup.catalog.items())]
    out += [
        Record(names.deployments_bucket, k, v, f"deployment {k}")
        for k, v in sorted(backup.deployments.items())
    ]
    out += [Record(names.keys_bucket, k, v, f"key {k}") for k, v in sorted(backup.keys.items())]
    out += [
        Record(names.node_intent_bucket, k, v, f"node intent {k}")
        for k, v in sorted(backup.node_intents.items())
    ]
    return out


# The buckets a backup covers, with the kind each holds.
def covered(names: Names) -> dict[str, type[Struct]]:
    return {
        names.config_bucket: DesiredEngines,
        names.catalog_bucket: Profile,
        names.deployments_bucket: Deployment,
        names.keys_bucket: ApiKey,
        names.node_intent_bucket: NodeIntent,
    }


# (revision, value bytes, stored at) of each key, per bucket, as `Bus.stored` reads them.
Stored = dict[str, dict[str, tuple[int, bytes, float]]]


@dataclass
class Plan:
    """What a restore writes: each record with the revision it was planned against (None:
    the store holds no value), those already as the backup has them, and those newer."""

    writes: list[tuple[Record, int | None]] = field(default_factory=list)
    same: list[Record] = field(default_factory=list)
    # Stored after the backup was written and different from it: (record, stored at).
    newer: list[tuple[Record, float]] = field(default_factory=list)


def plan(backup: Backup, stored: Stored, names: Names, *, force: bool = False) -> Plan:
    """Pure: compare the backup with the store. A value that decodes to the backup's is the
    same (bytes alone differ between llmgw versions); one that does not decode is replaced."""
    kinds = covered(names)
    out = Plan()
    for record in records(backup, names):
        found = stored.get(record.bucket, {}).get(record.key)
        if found is None:
            out.writes.append((record, None))
            continue
        revision, data, at = found
        try:
            current = msgspec.json.decode(data, type=kinds[record.bucket])
        except (msgspec.DecodeError, msgspec.ValidationError):
            current = None
        if current == record.value:
            out.same.append(record)
        elif at > backup.written_at and not force:
            out.newer.append((record, at))
        else:
            out.writes.append((record, revision))
    return out


def _clock(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


# --- the commands ------------------------------------------------------------------


async def take(bus: Bus) -> Backup:
    """The desired state as the store holds it now (values that do not decode are left out:
    they go to the DLQ, as for every reader)."""
    names = bus.names
    engines = await bus.get(names.config_bucket, ENGINES_KEY, DesiredEngines)

    async def section(bucket: str, kind: type[Any]) -> dict[str, Any]:
        return {
            k: c.value for k, c in sorted((await bus.entries(bucket, kind)).items()) if c.value is not None
        }

    return Backup(
        version=VERSION,
        prefix=names.prefix,
        written_at=time.time(),
        engines=engines[0] if engines else None,
        catalog=await section(names.catalog_bucket, Profile),
        deployments=await section(names.deployments_bucket, Deployment),
        keys=await section(names.keys_bucket, ApiKey),
        node_intents=await section(names.node_intent_bucket, NodeIntent),
    )


async def backup(bus: Bus, path: str) -> str:
    taken = await take(bus)
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    try:
        # Owner-only: key hashes and limits are no secrets, but no one else's business either.
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.format(encode(taken), indent=2) + b"\n")
        os.replace(partial, target)
    except OSError as exc:
        raise UsageError(f"cannot write the backup to {path}: {exc.strerror or exc}") from exc
    return (
        f"backup of {names_of(taken)} written to {path} at {_clock(taken.written_at)} "
        f"(restore it with `llmgw ctl restore -f {path}`)"
    )


def names_of(backup: Backup) -> str:
    parts = [
        f"{len(backup.catalog)} profiles",
        f"{len(backup.deployments)} deployments",
        f"{len(backup.keys)} keys",
        f"{len(backup.node_intents)} node intents",
    ]
    return ("the engines, " if backup.engines is not None else "") + ", ".join(parts)


def read_backup(path: str) -> Backup:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BACKUP_BYTES + 1)
    except OSError as exc:
        raise BackupError(f"cannot read {path}: {exc.strerror or exc}") from exc
    return parse(data, path)


async def restore(bus: Bus, path: str, *, force: bool) -> str:
    backup = read_backup(path)
    stored: Stored = {bucket: await bus.stored(bucket) for bucket in covered(bus.names)}
    todo = plan(backup, stored, bus.names, force=force)
    if todo.newer:
        newer = ", ".join(f"{r.what} (stored {_clock(at)})" for r, at in todo.newer)
        raise Refused(
            f"{len(todo.newer)} records in the store are newer than the backup (written "
            f"{_clock(backup.written_at)}): {newer}; nothing was restored; restore over them with --force"
        )
    written: list[str] = []
    for record, revision in todo.writes:
        if revision is None:
            landed = await bus.create(record.bucket, record.key, record.value)
        else:
            landed = await bus.update(record.bucket, record.key, record.value, last=revision)
        if landed is None:
            done = f" (restored before it: {', '.join(written)})" if written else ""
            raise Conflict(f"{record.what} changed while restoring{done}; run the restore again")
        written.append(record.what)
    said = f"restored {len(written)} records from {path}"
    if written:
        said += f": {', '.join(written)}"
    if todo.same:
        said += f"; {len(todo.same)} already as the backup has them"
    if backup.prefix and backup.prefix != bus.names.prefix:
        said += f" (the backup was taken from prefix {backup.prefix!r})"
    return said


async def none_stored(bus: Bus, bucket: str, what: str) -> str:
    """For a listing that found nothing: since when the bucket has held nothing, as a store
    emptied or replaced would leave it (`deployments: none stored since 10:42 (store emptied?
    …)`); "" when that cannot be read."""
    try:
        created = (await bus.stream_info(f"KV_{bucket}")).created
    except BusError:
        return ""
    if created is None:
        return ""
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(created.timestamp()))
    return (
        f"{what}: none stored since {since} (store emptied? `llmgw ctl restore -f BACKUP` writes "
        "a backup's desired state back; docs/operations.md)"
    )
