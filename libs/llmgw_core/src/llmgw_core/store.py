"""How much llmgw keeps in NATS, and what a write that NATS refused for space looks like.

Every bucket has a byte limit sized from what the cluster holds (`BusOptions`:
`max_nodes`, `max_shards`, `max_deployments`), and every value a size limit
(`max_value_bytes`): a writer that writes key after key, however many, is
refused at its bucket's limit instead of filling the store under every other
bucket. The sum of the limits is what one NATS server's store must hold
(`total_bytes`, docs/operations.md); nats-server reserves it when the streams
are created, and refuses a stream whose limit does not fit.

    bucket bytes = max(1 MiB, keys × value bytes × (HISTORY + 1))

where a bucket's keys and the bytes a value of it takes (what one holds
typically at most, not `max_value_bytes`) are in `budgets`: each key keeps
HISTORY revisions, and one more covers delete markers and the store's own
overhead per message. `bucket_max_bytes` overrides the formula per bucket.

A write refused for space is `errors.StoreFull`; `space_refusal` says whether an
error from nats-server is one, in words. `StoreWatch` keeps the episode: from the
first refused write to the first write that lands again, said once at each end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .subjects import Names

KiB = 1 << 10
MiB = 1 << 20
# Revisions a key keeps (the buckets' `history`).
HISTORY = 5
# No bucket gets less: a small cluster still has room for its rewrites.
FLOOR_BYTES = 1 * MiB
# Every bucket, by its name without the prefix (`Names.bucket`).
BUCKETS = (
    "config",
    "catalog",
    "deployments",
    "nodes",
    "shards",
    "shard-status",
    "replicas",
    "leases",
    "keys",
    "limits",
    "node-intent",
    "routing",
)
# Revisions a key keeps where not HISTORY: the routing bucket's values are each a whole
# snapshot of one replica's blocks, and only the last one is ever read.
BUCKET_HISTORY = {"routing": 1}
# Client API keys one cluster holds (the keys and limits buckets are sized for them).
MAX_API_KEYS = 1024
# How long usage records are kept (the usage stream drops older ones), and at most how much
# (no more than the events stream: `events_max_bytes`). A record is one key and deployment's
# second of use, about 250 bytes: 256 MiB holds a million of them.
USAGE_MAX_AGE_S = 400 * 24 * 3600
USAGE_MAX_BYTES = 256 * MiB
# The DLQ holds copies of bad messages: a quarter of the events stream, at most this.
DLQ_MAX_BYTES = 64 * MiB


class Sizing(Protocol):
    """What the limits are sized from: the `nats:` section (`bus.BusOptions`)."""

    @property
    def max_nodes(self) -> int: ...
    @property
    def max_shards(self) -> int: ...
    @property
    def max_deployments(self) -> int: ...
    @property
    def max_value_bytes(self) -> int: ...
    @property
    def events_max_bytes(self) -> int: ...
    @property
    def bucket_max_bytes(self) -> dict[str, int]: ...


# nats-server's error codes for a write refused for space (server/errors.json).
INSUFFICIENT_RESOURCES = 10023  # the server's JetStream store is at its limit (503)
STORAGE_RESOURCES_EXCEEDED = 10047  # a stream's limit does not fit what the store has left (500)
MEMORY_RESOURCES_EXCEEDED = 10028
ACCOUNT_RESOURCES_EXCEEDED = 10002
STREAM_STORE_FAILED = 10077  # "{err}": the stream's own limit (maximum bytes exceeded) or the disk
# "atomic publish batch is incomplete": also what nats-server answers when it cannot stage a batch
# (it stages each in a file of its store), as on a full disk.
BATCH_INCOMPLETE = 10176


@dataclass(frozen=True)
class Budget:
    """What one bucket is sized for: how many keys, and the bytes one value takes."""

    keys: int
    value_bytes: int
    why: str


def budgets(options: Sizing) -> dict[str, Budget]:
    """Each bucket (its name without the prefix) and what it is sized for."""
    o = options
    return {
        "config": Budget(16, 8 * KiB, "the desired engines and a few settings"),
        "catalog": Budget(o.max_deployments, 8 * KiB, "one profile per deployment at most"),
        "deployments": Budget(o.max_deployments, 2 * KiB, "one per deployment"),
        "nodes": Budget(o.max_nodes, 16 * KiB, "one status per node (its GPUs, engines, facts)"),
        "shards": Budget(o.max_shards, 8 * KiB, "one spec per shard (a profile in each)"),
        "shard-status": Budget(o.max_shards, 8 * KiB, "one status per shard, its last failure's log lines"),
        "replicas": Budget(o.max_shards, 8 * KiB, "one record per replica (replicas ≤ shards)"),
        "leases": Budget(o.max_deployments + 16, 1 * KiB, "the placement lease, replica ids per deployment"),
        "keys": Budget(MAX_API_KEYS, 1 * KiB, "one per client API key (a hash, models, limits)"),
        "limits": Budget(MAX_API_KEYS, 256, "one minute's counts per API key with limits"),
        "node-intent": Budget(o.max_nodes, 512, "one cordon or drain per node at most"),
        "routing": Budget(o.max_shards, 12 * KiB, "the prompt blocks one replica holds, 1,024 hashes"),
    }


def bucket_bytes(options: Sizing, bucket: str) -> int:
    """The byte limit of a bucket (named without the prefix): the override, or the formula."""
    override = options.bucket_max_bytes.get(bucket)
    if override is not None:
        return override
    b = budgets(options)[bucket]
    return max(FLOOR_BYTES, b.keys * b.value_bytes * (BUCKET_HISTORY.get(bucket, HISTORY) + 1))


@dataclass(frozen=True)
class Limits:
    """One stream's limits; -1 leaves one to the server (its max_payload bounds a message)."""

    max_bytes: int
    max_msg_size: int = -1
    # Revisions a bucket's key keeps.
    history: int = HISTORY


def stream_limits(options: Sizing, names: Names) -> dict[str, Limits]:
    """Every llmgw stream (a bucket's is `KV_<bucket>`) and its limits."""
    out = {
        names.events_stream: Limits(options.events_max_bytes),
        names.dlq_stream: Limits(dlq_bytes(options)),
        names.usage_stream: Limits(min(options.events_max_bytes, USAGE_MAX_BYTES)),
    }
    prefix = f"{names.prefix}-"
    for bucket in names.buckets():
        short = bucket.removeprefix(prefix)
        out[f"KV_{bucket}"] = Limits(
            bucket_bytes(options, short), options.max_value_bytes, BUCKET_HISTORY.get(short, HISTORY)
        )
    return out


def dlq_bytes(options: Sizing) -> int:
    return min(options.events_max_bytes, DLQ_MAX_BYTES)


def total_bytes(options: Sizing, names: Names) -> int:
    """What llmgw's streams reserve on each NATS server that holds a replica of them."""
    return sum(limits.max_bytes for limits in stream_limits(options, names).values())


def size(n: int) -> str:
    """`80 MiB`, `1.5 GiB`, `512 KiB`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value >= 10 or value == int(value) else f"{value:.1f} {unit}"
    return f"{n} B"


# --- writes refused for space ----------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """Why NATS refused a write for space. `server_wide`: the server's store as a whole (any
    write that lands shows it has room again), else this stream's own limit or its disk."""

    reason: str
    server_wide: bool


def space_refusal(err_code: int | None, description: str, *, stream: str, limit: int = 0) -> Refusal | None:
    """The refusal an error of nats-server's JetStream API is, if it is one for space."""
    text = description.lower()
    if "no space left" in text:
        return Refusal(
            "the disk under nats-server's store is full (no space left on device); nats-server stops "
            f"storing to {stream} until it is restarted",
            server_wide=False,
        )
    if err_code in (INSUFFICIENT_RESOURCES, MEMORY_RESOURCES_EXCEEDED, ACCOUNT_RESOURCES_EXCEEDED):
        return Refusal(
            f"nats-server's JetStream store is at its limit ({description}, error {err_code})",
            server_wide=True,
        )
    if err_code == STORAGE_RESOURCES_EXCEEDED:
        return Refusal(
            f"{stream}'s limit does not fit what nats-server's JetStream store has left "
            f"({description}, error {err_code})",
            server_wide=False,
        )
    if err_code == STREAM_STORE_FAILED and ("maximum bytes" in text or "maximum messages" in text):
        held = f" of {size(limit)}" if limit > 0 else ""
        return Refusal(f"{stream} holds its limit{held} ({description})", server_wide=False)
    return None


def unacknowledged(stream: str) -> Refusal:
    """Writes to `stream` get no answer while nats-server answers everything else: what a stream
    whose disk filled does (nats-server logs `no space left on device` and stops storing to it,
    even once space is freed, until it restarts)."""
    return Refusal(
        f"writes to {stream} get no acknowledgement while nats-server answers (a stream whose disk "
        "filled stops storing until nats-server restarts; its log says 'no space left on device')",
        server_wide=False,
    )


def unstaged(description: str, err_code: int) -> Refusal:
    """An atomic batch that nats-server could not stage: every message of it was sent (or it
    held one), yet it is `incomplete`. nats-server stages a batch in a file beside its store,
    and answers so when it cannot write one: its disk is full."""
    return Refusal(
        f"nats-server cannot stage a batch of writes ({description}, error {err_code}): the disk under "
        "its store is likely full",
        # A full disk still takes a write that fits the space its files hold already (a lease
        # renewal, say): only a write to this stream that lands shows this one stores again.
        server_wide=False,
    )


def clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


@dataclass
class Episode:
    since: float  # wall clock
    streams: dict[str, Refusal] = field(default_factory=dict)
    refused: int = 0


class StoreWatch:
    """Whether NATS refuses this client's writes for space now.

    An episode starts at the first write refused for space and ends at the
    first write that lands again on every stream that was refused (a refusal
    of the server's store as a whole ends with any write that lands). The
    caller says each end once: `refused` and `stored` return whether it changed.
    """

    def __init__(self) -> None:
        self.episode: Episode | None = None
        self.last: Episode | None = None
        self.refused_total = 0
        self.episodes = 0

    @property
    def full(self) -> bool:
        return self.episode is not None

    def refused(self, stream: str, refusal: Refusal, at: float) -> bool:
        """Count a refused write; True if it starts an episode or gives it a reason anew (another
        stream refused for the same reason is not news)."""
        self.refused_total += 1
        episode = self.episode
        if episode is None:
            episode = self.episode = Episode(since=at)
            self.episodes += 1
        episode.refused += 1
        new = refusal.reason not in {r.reason for r in episode.streams.values()}
        episode.streams[stream] = refusal
        return new

    def stored(self, stream: str, *, written: bool = True) -> Episode | None:
        """A write to `stream` landed (or, not `written`, the stream was created with its
        limits): the episode, if this ends it. A write that lands shows the server's store has
        room again; a stream created shows only that its own limit fitted."""
        episode = self.episode
        if episode is None:
            return None
        episode.streams = {
            s: r for s, r in episode.streams.items() if s != stream and not (written and r.server_wide)
        }
        if episode.streams:
            return None
        self.episode = None
        self.last = episode
        return episode

    def banner(self) -> str:
        """`NATS store full: <why> (<streams>): writes refused since 18:24:09`; empty when not full."""
        episode = self.episode
        if episode is None:
            return ""
        by_reason: dict[str, list[str]] = {}
        for stream, refusal in sorted(episode.streams.items()):
            by_reason.setdefault(refusal.reason, []).append(stream)
        what = "; ".join(
            reason if len(streams) == 1 and streams[0] in reason else f"{reason} ({', '.join(streams)})"
            for reason, streams in by_reason.items()
        )
        return f"NATS store full: {what}: writes refused since {clock(episode.since)}"
