"""llmgw's streams and buckets: their names, their settings and limits, and what each
kind of identity needs of them.

    <PREFIX>_EVENTS   every event (`<prefix>.events.>`); oldest dropped at its limits;
                      deduplicated by message id; takes atomic batches
    <PREFIX>_DLQ      copies of bad messages (`<prefix>.dlq.>`)
    <PREFIX>_USAGE    tokens spent per API key and deployment (`<prefix>.usage.>`), kept
                      for billing periods; deduplicated by message id
    KV_<bucket>       one per bucket (`store.BUCKETS`): HISTORY revisions per key (the
                      routing bucket's: 1, each value a whole snapshot), a byte
                      and a value-size limit (`store.stream_limits`), atomic batches

Pure: the bus creates what this says (`bus.streams`), and the permissions
(`access.permissions`) grant what `needs` says; neither imports the other for it.
A new bucket is a name in `store.BUCKETS` (with its budget) and in `Names.buckets`,
and a line in `needs` for each identity that reads or writes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from nats.js import api

from .store import USAGE_MAX_AGE_S, Limits

if TYPE_CHECKING:
    from .subjects import Names

# How long the events stream remembers a message id, to drop a retried publish that landed.
DUPLICATE_WINDOW_S = 120


def kv_stream(bucket: str) -> str:
    """The JetStream stream that holds a bucket (named with its prefix)."""
    return f"KV_{bucket}"


def all_streams(names: Names) -> list[str]:
    """Every llmgw stream: events, DLQ, usage, then each bucket's."""
    return [
        names.events_stream,
        names.dlq_stream,
        names.usage_stream,
        *(kv_stream(b) for b in names.buckets()),
    ]


def node_streams(names: Names) -> list[str]:
    """What a node's installer and launcher use."""
    return [
        names.events_stream,
        names.dlq_stream,
        *(
            kv_stream(b)
            for b in (names.config_bucket, names.nodes_bucket, names.shards_bucket, names.shard_status_bucket)
        ),
    ]


def event_streams(
    names: Names, limits: dict[str, Limits], *, replicas: int, max_age_s: float
) -> tuple[api.StreamConfig, ...]:
    """The events, DLQ and usage streams as this configuration asks for them (`limits` from
    `store.stream_limits`)."""
    return (
        api.StreamConfig(
            name=names.events_stream,
            subjects=[names.events_all],
            storage=api.StorageType.FILE,
            max_age=max_age_s,
            max_bytes=limits[names.events_stream].max_bytes,
            num_replicas=replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
            # Many events of one control step are written as one atomic batch (`Bus.commit`).
            allow_atomic=True,
        ),
        api.StreamConfig(
            name=names.dlq_stream,
            subjects=[names.dlq_all],
            storage=api.StorageType.FILE,
            max_age=max_age_s,
            max_bytes=limits[names.dlq_stream].max_bytes,
            num_replicas=replicas,
        ),
        api.StreamConfig(
            name=names.usage_stream,
            subjects=[names.usage_all],
            storage=api.StorageType.FILE,
            max_age=USAGE_MAX_AGE_S,
            max_bytes=limits[names.usage_stream].max_bytes,
            num_replicas=replicas,
            duplicate_window=DUPLICATE_WINDOW_S,
        ),
    )


def bucket_config(bucket: str, limits: dict[str, Limits], *, replicas: int) -> api.KeyValueConfig:
    """A bucket (named with its prefix) as it is created; `allow_atomic` is set afterwards,
    where the server knows it (`bus.streams`)."""
    own = limits[kv_stream(bucket)]
    return api.KeyValueConfig(
        bucket=bucket,
        history=own.history,
        storage=api.StorageType.FILE,
        replicas=replicas,
        max_bytes=own.max_bytes,
        max_value_size=own.max_msg_size,
    )


def stream_of(names: Names, subject: str) -> str:
    """The stream a subject's messages are stored in: a bucket's for `$KV.<bucket>.<key>`,
    the usage stream for usage records, else the events stream."""
    if subject.startswith("$KV."):
        return kv_stream(subject.split(".", 2)[1])
    if subject.startswith(f"{names.prefix}.usage."):
        return names.usage_stream
    return names.events_stream


@dataclass(frozen=True)
class Needs:
    """What one kind of identity needs of the streams and buckets. `access.permissions`
    turns it into nats-server's rules, and adds what is narrower than a whole stream: a
    node's own keys and the subjects each identity publishes on."""

    # Streams it reads whole: gets, watches, snapshots, consumers.
    reads: tuple[str, ...] = ()
    # Buckets it writes, every key.
    writes: tuple[str, ...] = ()
    # Streams it creates and updates (`Bus.ensure`); only placement does.
    manages: tuple[str, ...] = ()
    # Streams that must exist before it works (`bus.require_streams`).
    requires: tuple[str, ...] = ()


def needs(names: Names) -> dict[str, Needs]:
    """Each kind of identity (`access.ROLES`, and `node` for every `node-<id>`) and its needs."""
    n = names
    return {
        # Seeds the catalog and deployments, writes specs, replicas, the lease and the engines;
        # reads the usage stream for its page and `/api/usage`.
        "placement": Needs(
            reads=(*(kv_stream(b) for b in n.buckets()), n.usage_stream),
            writes=(
                n.config_bucket,
                n.catalog_bucket,
                n.deployments_bucket,
                n.shards_bucket,
                n.replicas_bucket,
                n.leases_bucket,
                # The API's cordon and drain; forgetting a lost node (`ctl delete node`, the
                # API's delete): its status and shard statuses, which the node wrote while it lived.
                n.node_intent_bucket,
                n.nodes_bucket,
                n.shard_status_bucket,
            ),
            manages=tuple(all_streams(n)),
        ),
        # The operator: reads everything; writes deployments, the catalog, client API keys and
        # the nodes' cordons and drains, and the desired engines (one key of config) besides.
        # Never a node's status: `ctl delete node` asks the leader to forget a lost node.
        "ctl": Needs(
            reads=tuple(all_streams(n)),
            writes=(n.deployments_bucket, n.catalog_bucket, n.keys_bucket, n.node_intent_bucket),
        ),
        # Never the shard specs: they carry environments.
        "observer": Needs(
            reads=(
                n.events_stream,
                kv_stream(n.nodes_bucket),
                kv_stream(n.shard_status_bucket),
                kv_stream(n.replicas_bucket),
            )
        ),
        # Deployments too: their aliases, and a deployment with no replica yet is known. Keys:
        # who may call, for which models, within which limits (never written by a gateway);
        # limits: every gateway's claims on each key's minute. Routing: what each replica is
        # believed to hold, every gateway's; shard statuses: each engine's running and waiting.
        "gateway": Needs(
            reads=(
                kv_stream(n.replicas_bucket),
                kv_stream(n.deployments_bucket),
                kv_stream(n.keys_bucket),
                kv_stream(n.limits_bucket),
                kv_stream(n.routing_bucket),
                kv_stream(n.shard_status_bucket),
            ),
            writes=(n.limits_bucket, n.routing_bucket),
        ),
        # Besides: its own status and shard statuses (written), its own shard specs and
        # shard statuses (read).
        "node": Needs(reads=(kv_stream(n.config_bucket),), requires=tuple(node_streams(n))),
        # `llmgw fleet`'s simulated nodes: every node's needs at once, every shard spec.
        "fleet": Needs(
            reads=(kv_stream(n.config_bucket), kv_stream(n.shards_bucket)), requires=tuple(node_streams(n))
        ),
    }
