"""What a run left behind, read for `checker.py`: every revision of the buckets that say where
replicas run, every replica, placement and shard event, and every engine each node's launcher
ran (its records on disk, each pid looked up by its start time).

A bucket keeps `history` revisions of a key (5): the lease is renewed every heartbeat, so
after a run only its last few terms are left. `Recorder` reads every stream while the run
goes on (a fresh consumer each pass from where the last stopped, so a reconnect or a cut
costs it a pass, never a message still held) and `read` merges what it took with what the
streams hold at the end. Without a recorder the checker sees only what is left (`History.first`
says where each stream's history starts), and a lease term whose revisions are gone is skipped.

Reading goes through the bus's JetStream context on purpose: the checker needs each
message's stream sequence, its headers (a delete, the writer's message id) and its bytes,
undecoded, which no reader in `llmgw_core` hands out.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.abc
import nats.errors
from nats.js import api

from llmgw_core.bus import Bus
from llmgw_launcher.procs import alive
from llmgw_launcher.records import Records

# The buckets the checker reads, by the role it knows them under.
ROLES = ("shards", "replicas", "shard-status", "nodes", "leases", "deployments")
# The events it reads, under `<prefix>.events.`.
EVENT_KINDS = ("replica", "placement", "shard")
# A message id is a writer's random prefix (32 hex digits) and a counter.
WRITER_CHARS = 32
# A read takes this many messages per fetch, and gives up on a stream after this long.
FETCH = 256
READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Revision:
    """One revision of one key: `value` None for a delete or purge."""

    bucket: str  # its role: one of ROLES
    key: str
    revision: int  # the bucket stream's sequence
    time: float  # when the stream stored it (Unix time, by the server's clock)
    value: bytes | None


@dataclass(frozen=True)
class Event:
    subject: str  # after `<prefix>.events.`: `replica.chat.r1`
    seq: int
    time: float
    writer: str  # the message id's writer prefix ("" if it carried none)
    data: bytes


@dataclass(frozen=True)
class Engine:
    """One shard a node's launcher keeps a record of, and which of its processes still run."""

    node: str
    key: str  # the shard key, `<node>.<shard>`
    pids: tuple[int, ...]
    running: tuple[int, ...]
    gpus: tuple[int, ...] = ()


@dataclass
class History:
    revisions: list[Revision] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    engines: list[Engine] = field(default_factory=list)
    # Per stream read: the first sequence it still held (above 1: older messages are gone).
    first: dict[str, int] = field(default_factory=dict)
    # Records of a launcher that could not be read, each as the launcher words it.
    unreadable: list[str] = field(default_factory=list)
    # Whether a recorder followed the run (else only what the streams kept is here).
    recorded: bool = False

    def of(self, bucket: str) -> list[Revision]:
        return sorted((r for r in self.revisions if r.bucket == bucket), key=lambda r: r.revision)


@dataclass(frozen=True)
class _Raw:
    seq: int
    subject: str
    time: float
    headers: dict[str, str]
    data: bytes


def _sources(bus: Bus) -> list[tuple[str, str, str]]:
    """(stream, subject filter, role) of every stream the checker reads."""
    names = bus.names
    buckets = {
        "shards": names.shards_bucket,
        "replicas": names.replicas_bucket,
        "shard-status": names.shard_status_bucket,
        "nodes": names.nodes_bucket,
        "leases": names.leases_bucket,
        "deployments": names.deployments_bucket,
    }
    found = [(f"KV_{bucket}", f"$KV.{bucket}.>", role) for role, bucket in buckets.items()]
    found += [(names.events_stream, f"{names.prefix}.events.{k}.>", "events") for k in EVENT_KINDS]
    return found


async def _read(bus: Bus, stream: str, subject: str, after: int) -> tuple[list[_Raw], int]:
    """Every message on `subject` in `stream` after sequence `after`, and the stream's first
    sequence. nats errors and timeouts raise: the caller decides whether to try again."""
    info = await bus.stream_info(stream)
    first, last = int(info.state.first_seq or 0), int(info.state.last_seq or 0)
    if last <= after or not info.state.messages:
        return [], first
    config = api.ConsumerConfig(
        ack_policy=api.AckPolicy.NONE,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(after + 1, first),
        inactive_threshold=30.0,
        mem_storage=True,
    )
    out: list[_Raw] = []
    sub = await bus.js.pull_subscribe(subject, stream=stream, config=config)
    try:
        pending = int((await sub.consumer_info()).num_pending or 0)
        with anyio.fail_after(READ_TIMEOUT_S):
            while pending > 0:
                try:
                    msgs = await sub.fetch(min(FETCH, pending), timeout=2.0)
                except nats.errors.TimeoutError:
                    continue
                for msg in msgs:
                    meta = msg.metadata
                    pending = int(meta.num_pending)
                    out.append(
                        _Raw(
                            int(meta.sequence.stream),
                            msg.subject,
                            meta.timestamp.timestamp(),
                            dict(msg.headers or {}),
                            msg.data or b"",
                        )
                    )
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
            await sub.unsubscribe()
    return out, first


class Recorder:
    """Reads every stream the checker needs, every `interval`, while the run goes on."""

    def __init__(self, bus: Bus, interval: float = 0.5) -> None:
        self.bus = bus
        self.interval = interval
        self.taken: dict[tuple[str, str], dict[int, _Raw]] = {}
        self.first: dict[str, int] = {}
        self.passes = 0
        self.failed = 0

    async def catch_up(self) -> None:
        """One pass over every stream; a stream that cannot be read now is read next pass."""
        for stream, subject, _ in _sources(self.bus):
            taken = self.taken.setdefault((stream, subject), {})
            try:
                found, first = await _read(self.bus, stream, subject, max(taken, default=0))
            except Exception as exc:  # a cut, a stream electing its leader: next pass
                self.bus.raise_if_final(exc)
                self.failed += 1
                continue
            self.first.setdefault(stream, first)
            for raw in found:
                taken[raw.seq] = raw
        self.passes += 1

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.catch_up()
        task_status.started()
        while True:
            await anyio.sleep(self.interval)
            await self.catch_up()


async def read(bus: Bus, state_dirs: Iterable[Path] = (), recorder: Recorder | None = None) -> History:
    """The run's history: what `recorder` took and what the streams hold now, and every
    engine recorded under each node's state directory (a launcher's `state_dir`)."""
    history = History(recorded=recorder is not None)
    deadline = time.monotonic() + READ_TIMEOUT_S
    for stream, subject, role in _sources(bus):
        taken = dict(recorder.taken.get((stream, subject), {})) if recorder else {}
        while True:
            try:
                found, first = await _read(bus, stream, subject, 0)
                break
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                bus.raise_if_final(exc)
                if time.monotonic() > deadline:
                    raise
                await anyio.sleep(0.5)
        history.first[stream] = min(first, recorder.first.get(stream, first)) if recorder else first
        taken.update({raw.seq: raw for raw in found})
        for raw in sorted(taken.values(), key=lambda r: r.seq):
            if role == "events":
                history.events.append(_event(bus, raw))
            else:
                history.revisions.append(_revision(role, raw))
    for state_dir in state_dirs:
        found_engines, problems = engines(Path(state_dir))
        history.engines += found_engines
        history.unreadable += problems
    return history


def _revision(role: str, raw: _Raw) -> Revision:
    # `$KV.<bucket>.<key>`: the key is all after the bucket's token.
    key = raw.subject.split(".", 2)[2] if raw.subject.count(".") >= 2 else ""
    deleted = raw.headers.get("KV-Operation", "") in ("DEL", "PURGE")
    return Revision(role, key, raw.seq, raw.time, None if deleted else raw.data)


def _event(bus: Bus, raw: _Raw) -> Event:
    subject = raw.subject.removeprefix(f"{bus.names.prefix}.events.")
    writer = raw.headers.get("Nats-Msg-Id", "")[:WRITER_CHARS]
    return Event(subject, raw.seq, raw.time, writer, raw.data)


def engines(state_dir: Path) -> tuple[list[Engine], list[str]]:
    """Every shard record under `state_dir` (a node's launcher state) with its live pids, and
    a sentence for each record that could not be read."""
    if not (state_dir / "shards").is_dir():
        return [], []
    records, problems = Records(state_dir).load_all()
    found = []
    for record in records.values():
        pids = tuple(p.pid for p in record.procs)
        running = tuple(p.pid for p in record.procs if alive(p.pid, p.start_time))
        found.append(Engine(record.spec.node, record.key, pids, running, tuple(record.spec.gpus)))
    return found, problems
