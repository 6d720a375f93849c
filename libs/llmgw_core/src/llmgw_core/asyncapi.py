"""The AsyncAPI 3.0 document for every subject and bucket, generated from the message types.

`python -m llmgw_core.asyncapi > docs/asyncapi.yaml` regenerates it; a test fails
when the committed document and the types disagree.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, get_args

import msgspec
import yaml

from . import events as ev
from . import keys as keys_
from . import prefixes as prefixes_
from .adapters import AdapterLoad, load_subject
from .subjects import Names

_N = Names("{prefix}")


def _channel(
    address: str, message: type[msgspec.Struct], description: str, params: list[str]
) -> dict[str, Any]:
    channel: dict[str, Any] = {
        "address": address,
        "description": description,
        "messages": {message.__name__: {"$ref": f"#/components/messages/{message.__name__}"}},
    }
    if params:
        channel["parameters"] = {p: {"$ref": f"#/components/parameters/{p}"} for p in params}
    return channel


CHANNELS: list[tuple[str, str, type[msgspec.Struct], str, list[str], str]] = [
    # id, address, message, description, parameters, operation (receive = other systems subscribe)
    (
        "nodeFacts",
        _N.node_facts("{node}"),
        ev.NodeFacts,
        "A node's facts changed (JetStream, stream <PREFIX>_EVENTS).",
        ["node"],
        "receive",
    ),
    (
        "nodeEngines",
        _N.node_engines("{node}"),
        ev.EngineInventory,
        "A node's engine inventory, after every probe.",
        ["node"],
        "receive",
    ),
    (
        "nodeInstall",
        _N.node_install("{node}"),
        ev.InstallProgress,
        "One step of an engine install, in the node's words.",
        ["node"],
        "receive",
    ),
    (
        "nodeWeights",
        _N.node_weights("{node}"),
        ev.WeightsEvicted,
        "A staged model the node removed to make room: no shard of the node used it, and it "
        "was the least recently used (docs/weights.md).",
        ["node"],
        "receive",
    ),
    (
        "nodeIntent",
        _N.node_intent("{node}"),
        ev.NodeLifecycle,
        "A node cordoned, draining, drained, uncordoned or deleted (placement tells each change).",
        ["node"],
        "receive",
    ),
    (
        "shardEvent",
        _N.shard_event("{node}", "{shard}"),
        ev.ShardStatus,
        "A shard changed state.",
        ["node", "shard"],
        "receive",
    ),
    (
        "replicaEvent",
        _N.replica_event("{deployment}", "{replica}"),
        ev.ReplicaStatus,
        "A replica changed state.",
        ["deployment", "replica"],
        "receive",
    ),
    (
        "placementEvent",
        _N.placement_event("{deployment}"),
        ev.PlacementDecision,
        "A replica was placed, or refused with every node's reason.",
        ["deployment"],
        "receive",
    ),
    (
        "deploymentEvent",
        _N.deployment_event("{deployment}"),
        ev.DeploymentStatus,
        "A deployment's desired, ready, pending and unplaceable counts, with the refusal; "
        "published when any of them changes (the stream keeps the last per subject).",
        ["deployment"],
        "receive",
    ),
    (
        "heartbeat",
        _N.heartbeat("{node}", "{service}"),
        ev.Heartbeat,
        "Plain NATS liveness of one node service (installer, launcher, or agent for both), "
        "every heartbeat_interval (default 1 s).",
        ["node", "service"],
        "receive",
    ),
    (
        "demand",
        _N.demand("{gateway}"),
        ev.Demand,
        "Plain NATS, gateway to placement (not stored): one gateway's requests in flight, held and "
        "arrived per deployment, and in flight per replica, every demand_interval_s (1 s) and at "
        "once when it starts holding a request for a deployment with no ready replica.",
        ["gateway"],
        "receive",
    ),
    (
        "judgement",
        _N.judgement("{gateway}"),
        ev.Judgement,
        "Plain NATS, gateway to placement (not stored): the replicas that failed the gateway's "
        "requests in its outlier window (5xx answers, connections refused or reset, no first byte "
        "in time), with the engine's own words, sent with each demand report; placement marks a "
        "replica any gateway judges failing degraded and restarts it after unhealthy_restart_s.",
        ["gateway"],
        "receive",
    ),
    (
        "launcherLogs",
        _N.launcher_logs("{node}"),
        ev.ShardLogsRequest,
        "Request/reply (plain NATS): the node's launcher answers with a ShardLogs, the shard's "
        "own log lines, at most about 1 MB (`llmgw ctl logs`); an unknown shard gets `error`.",
        ["node"],
        "send",
    ),
    (
        "launcherAdapters",
        load_subject(_N.prefix, "{node}"),
        AdapterLoad,
        "Request/reply (plain NATS), gateway to the node's launcher: load a LoRA adapter into a "
        "replica's engine (vLLM), then, where it is full, unloading the least recently used with no "
        "request in flight; the reply (AdapterLoaded) says why not where it could not, in the "
        "engine's words, `retryable` where every adapter it holds is in use.",
        ["node"],
        "send",
    ),
    (
        "weightsQuery",
        _N.weights_query("{node}"),
        ev.WeightsQuery,
        "Plain NATS, nodes only: a node staging a blob asks the others; each that holds it, "
        "fetches it or wants it answers on weightsOffer. The asker is the subject's node (only "
        "its identity may publish there), not the payload's.",
        ["node"],
        "send",
    ),
    (
        "weightsOffer",
        _N.weights_offer("{asker}", "{node}"),
        ev.WeightsOffer,
        "Plain NATS, nodes only: `node`'s answer to `asker`'s query (where, and a token). The "
        "offering node is the subject's last token (only its identity may publish there); the "
        "asker reads the blob only from the `mgmt_addr` that node reports in its status.",
        ["asker", "node"],
        "send",
    ),
    (
        "configBucket",
        "$KV.{prefix}-config.engines",
        ev.DesiredEngines,
        "KV: the engines every node must have (written by placement).",
        [],
        "receive",
    ),
    (
        "catalogBucket",
        "$KV.{prefix}-catalog.{profile}",
        ev.Profile,
        "KV: catalog profiles by name.",
        ["profile"],
        "receive",
    ),
    (
        "deploymentsBucket",
        "$KV.{prefix}-deployments.{deployment}",
        ev.Deployment,
        "KV: deployments by name.",
        ["deployment"],
        "send",
    ),
    (
        "nodesBucket",
        "$KV.{prefix}-nodes.{node}",
        ev.NodeStatus,
        "KV: each node's status (written by its installer).",
        ["node"],
        "receive",
    ),
    (
        "shardsBucket",
        "$KV.{prefix}-shards.{node}.{shard}",
        ev.ShardSpec,
        "KV: desired shards (written by placement).",
        ["node", "shard"],
        "receive",
    ),
    (
        "shardStatusBucket",
        "$KV.{prefix}-shard-status.{node}.{shard}",
        ev.ShardStatus,
        "KV: observed shards (written by launchers).",
        ["node", "shard"],
        "receive",
    ),
    (
        "replicasBucket",
        "$KV.{prefix}-replicas.{deployment}.{replica}",
        ev.ReplicaRecord,
        "KV: replica records (written by placement).",
        ["deployment", "replica"],
        "receive",
    ),
    (
        "keysBucket",
        "$KV.{prefix}-keys.{key}",
        keys_.ApiKey,
        "KV: client API keys by name, the secret only hashed (written by `llmgw ctl keys`).",
        ["key"],
        "send",
    ),
    (
        "limitsBucket",
        "$KV.{prefix}-limits.{key}",
        keys_.KeyWindow,
        "KV: each key's current minute, as the gateways claim it (compare-and-set).",
        ["key"],
        "receive",
    ),
    (
        "routingBucket",
        "$KV.{prefix}-routing.{deployment}.{replica}",
        prefixes_.RoutingHeld,
        "KV: the prompt blocks each replica is believed to hold, as the gateways route by them "
        "(every gateway writes and reads it; one revision per key).",
        ["deployment", "replica"],
        "receive",
    ),
    (
        "usage",
        _N.usage("{deployment}", "{key}"),
        keys_.UsageRecord,
        "Tokens and requests one gateway served per key and deployment, once a second "
        "(JetStream, stream <PREFIX>_USAGE).",
        ["deployment", "key"],
        "receive",
    ),
]

# Request/reply channels: the reply's message and what it says; it comes on the requester's
# own inbox (AsyncAPI: a reply channel with a null address).
REPLIES: dict[str, tuple[type[msgspec.Struct], str]] = {
    "launcherLogs": (ev.ShardLogs, "The launcher's reply: the shard's log lines, or why none."),
}

PARAMETERS = {
    "prefix": "Subject prefix, `llmgw` by default.",
    "node": "Node id, matching [A-Za-z0-9_-]+.",
    "asker": "The id of the node that asked, matching [A-Za-z0-9_-]+.",
    "shard": "Shard id, matching [A-Za-z0-9_-]+.",
    "deployment": "Deployment name, matching [A-Za-z0-9_-]+.",
    "replica": "Replica id, matching [A-Za-z0-9_-]+.",
    "profile": "Profile name, matching [A-Za-z0-9_-]+.",
    "service": "The service that refused the message.",
    "gateway": "A gateway's id (gateway.yaml's `id`; by default its host, pid and a random tail).",
    "key": "Client API key name, matching [A-Za-z0-9_-]+ (`_`: no key required).",
}


# Enumerations named for code generators (an inline enum becomes `AnonymousSchemaN`):
# the value set of each Literal alias in events.py, else `<Struct><Field>`.
_NAMED_ENUMS = {
    frozenset(get_args(ev.EngineStateName)): "EngineStateName",
    frozenset(get_args(ev.ShardState)): "ShardState",
    frozenset(get_args(ev.ReplicaState)): "ReplicaState",
}


def _name_enums(components: dict[str, Any]) -> dict[str, Any]:
    """Lift every inline `enum` of a struct's properties into a named schema and refer to it."""
    lifted: dict[str, Any] = {}
    for struct, schema in components.items():
        for field, prop in schema.get("properties", {}).items():
            values = prop.get("enum")
            if values is None:
                continue
            if field == "kind" and len(values) == 1:
                # The type tag: one value, the struct's own name.
                schema["properties"][field] = {"const": values[0]}
                continue
            name = _NAMED_ENUMS.get(frozenset(values)) or f"{struct}{field[0].upper()}{field[1:]}"
            if name in components:  # never shadow a struct of the same name
                name = f"{name}Enum"
            enum = {k: v for k, v in prop.items() if k not in ("default", "description")}
            lifted[name] = {"title": name, **enum}
            keep = {k: v for k, v in prop.items() if k in ("default", "description")}
            schema["properties"][field] = {"$ref": f"#/components/schemas/{name}", **keep}
    return {**components, **lifted}


def _stream_of(address: str) -> dict[str, str]:
    """Where a channel's messages are kept: the JetStream stream (and KV bucket), by name."""
    if address.startswith("$KV."):
        bucket = address.split(".")[1]
        return {"stream": f"KV_{bucket}", "bucket": bucket}
    if address.startswith("{prefix}.events."):
        return {"stream": _N.events_stream}
    if address.startswith("{prefix}.dlq."):
        return {"stream": _N.dlq_stream}
    if address.startswith("{prefix}.usage."):
        return {"stream": _N.usage_stream}
    return {}


DLQ_HEADERS = {
    "type": "object",
    "properties": {
        "Llmgw-Subject": {"type": "string", "description": "The subject the bad message came on."},
        "Llmgw-Error": {"type": "string", "description": "Why it was refused (at most 1,024 bytes)."},
    },
    "required": ["Llmgw-Subject", "Llmgw-Error"],
}


# What a message written in an atomic batch (`bus.commit`: KV puts and deletes and events,
# one batch per stream, where the stream allows atomic publishes) carries besides its own
# headers; nats-server stores them with it.
BATCH_HEADERS: dict[str, Any] = {
    "Nats-Batch-Id": {
        "type": "string",
        "maxLength": 64,
        "description": (
            "Present on a message written in an atomic batch: the batch's id (the same on every "
            "message of the batch). A batch is stored whole or not at all; a reader need not act on it."
        ),
    },
    "Nats-Batch-Sequence": {
        "type": "string",
        "pattern": "^[1-9][0-9]*$",
        "description": "With Nats-Batch-Id: the message's place in its batch, from 1.",
    },
    "Nats-Batch-Commit": {
        "type": "string",
        "const": "1",
        "description": "With Nats-Batch-Id, on the batch's last message only: the batch's commit.",
    },
}

# The headers a KV value may carry: a value written in a batch its batch's; a delete marker
# (empty payload) its operation.
KV_HEADERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "KV-Operation": {
            "type": "string",
            "enum": ["DEL", "PURGE"],
            "description": "On a delete marker only (its payload is empty): the key was deleted or purged.",
        },
        **BATCH_HEADERS,
    },
}

# The headers every event carries (JetStream publishes to the events and usage streams, one
# at a time or in an atomic batch). `traceparent` is there only where tracing is on.
EVENT_HEADERS = {
    "type": "object",
    "properties": {
        "Nats-Msg-Id": {
            "type": "string",
            "description": (
                "Unique per event (a per-process random prefix and a counter, or an id of the "
                "publisher's own); JetStream de-duplicates on it within the stream's window, and a "
                "reader may too."
            ),
        },
        "traceparent": {
            "type": "string",
            "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
            "description": (
                "W3C trace context of the publisher's span. Present on every event where tracing "
                "is on (OTEL_EXPORTER_OTLP_ENDPOINT set for the publishing service), absent where it "
                "is off (`llmgw up`'s default)."
            ),
        },
        **BATCH_HEADERS,
    },
    "required": ["Nats-Msg-Id"],
    "x-llmgw-required-with-tracing": ["traceparent"],
}


def _is_event(address: str) -> bool:
    return address.startswith(("{prefix}.events.", "{prefix}.usage."))


def _is_kv(address: str) -> bool:
    return address.startswith("$KV.")


# How a client connects and subscribes where authentication is on (`llmgw auth`): what a
# client written from this document alone needs, as values (llmgw_core.access).
CLIENT: dict[str, Any] = {
    "description": (
        "Connect with the identity's nkey (its seed file, `<identity>.nk` from `llmgw auth init`) and "
        "with the inbox prefix below: every identity may subscribe only to its own inbox, so a client "
        "on the default `_INBOX` is refused (`permissions violation for subscription to "
        '"_inbox.…"`). Read a channel kept in JetStream by naming its stream '
        "(`x-llmgw-jetstream.stream`, with `{PREFIX}` as below) when subscribing: looking a stream "
        "up by subject (`$JS.API.STREAM.NAMES`) is refused to every identity. Identity `observer` "
        "reads the events, node status, shard status, replicas and heartbeats and writes nothing; "
        "`ctl` reads everything (docs/security.md)."
    ),
    "inboxPrefix": "_INBOX.{publicKey}",
    "publicKey": (
        "The public key of the client's nkey (56 characters, first `U`), as nkeys gives it from the "
        "seed (`nkeys.from_seed(seed).public_key`)."
    ),
    "streamPrefix": {
        "{PREFIX}": "The subject prefix in capitals, each `-` written `_` (`LLMGW` for `llmgw`).",
    },
}


def document() -> dict[str, Any]:
    types = sorted({c[2] for c in CHANNELS} | {r[0] for r in REPLIES.values()}, key=lambda t: t.__name__)
    (_, components) = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    event_types = {c[2] for c in CHANNELS if _is_event(c[1])}
    # A KV value of a type also sent as an event: a message of its own, without the event's
    # headers (a KV put carries none).
    entries = sorted({c[2] for c in CHANNELS if not _is_event(c[1]) and c[2] in event_types}, key=str)
    for cid, address, message, description, params, action in CHANNELS:
        channels[cid] = _channel(address, message, description, ["prefix", *params])
        if message in event_types and not _is_event(address):
            name = f"{message.__name__}Entry"
            channels[cid]["messages"] = {name: {"$ref": f"#/components/messages/{name}"}}
        if kept := _stream_of(address):
            channels[cid]["x-llmgw-jetstream"] = kept
        operation: dict[str, Any] = {"action": action, "channel": {"$ref": f"#/channels/{cid}"}}
        if cid in REPLIES:
            reply_message, reply_description = REPLIES[cid]
            channels[f"{cid}Reply"] = {
                "address": None,
                "description": reply_description,
                "messages": {
                    reply_message.__name__: {"$ref": f"#/components/messages/{reply_message.__name__}"}
                },
            }
            operation["reply"] = {"channel": {"$ref": f"#/channels/{cid}Reply"}}
        operations[f"{action}{cid[0].upper()}{cid[1:]}"] = operation
    channels["deadLetters"] = {
        "address": _N.dlq("{service}"),
        "description": (
            "A message a service could not take (undecodable, a key that names another object, "
            "a rule broken), copied as it came with why; the service goes on. `service` is "
            "placement, installer-<node>, launcher-<node>, llmgw-ctl, …"
        ),
        "messages": {"DeadLetter": {"$ref": "#/components/messages/DeadLetter"}},
        "parameters": {p: {"$ref": f"#/components/parameters/{p}"} for p in ("prefix", "service")},
        "x-llmgw-jetstream": _stream_of(_N.dlq("{service}")),
    }
    operations["receiveDeadLetters"] = {"action": "receive", "channel": {"$ref": "#/channels/deadLetters"}}
    messages: dict[str, Any] = {
        t.__name__: {
            "name": t.__name__,
            "payload": {"$ref": f"#/components/schemas/{t.__name__}"},
        }
        for t in types
    }
    for t in event_types:
        messages[t.__name__]["headers"] = copy.deepcopy(EVENT_HEADERS)  # no YAML aliases
    # A type kept only as KV values: its message carries the KV headers.
    elsewhere = {c[2] for c in CHANNELS if not _is_kv(c[1])} | {r[0] for r in REPLIES.values()}
    for t in {c[2] for c in CHANNELS if _is_kv(c[1])} - elsewhere:
        messages[t.__name__]["headers"] = copy.deepcopy(KV_HEADERS)
    for t in entries:
        messages[f"{t.__name__}Entry"] = {
            "name": f"{t.__name__}Entry",
            "description": f"A {t.__name__} as a KV value (no Nats-Msg-Id, no traceparent).",
            "headers": copy.deepcopy(KV_HEADERS),
            "payload": {"$ref": f"#/components/schemas/{t.__name__}"},
        }
    messages = dict(sorted(messages.items()))
    messages["DeadLetter"] = {
        "name": "DeadLetter",
        "contentType": "application/octet-stream",
        "description": "The refused message's bytes, unchanged.",
        "headers": DLQ_HEADERS,
        "payload": {"description": "The original payload, as it was published."},
    }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmgw bus",
            "version": "0.1.0",
            "description": (
                "Messages llmgw exchanges over NATS JetStream. Every payload is JSON. "
                "Every event (the channels kept in the events and usage streams) carries a "
                "Nats-Msg-Id header, unique per event, in an atomic batch too; the W3C traceparent "
                "header only where tracing is on; a message written in an atomic batch, event or KV "
                "value, its Nats-Batch-* headers. Each message's `headers` says what it carries; "
                "KV values carry no Nats-Msg-Id nor traceparent. How to connect and subscribe with "
                "authentication on: `servers.nats.x-llmgw-client`. "
                "Readers must ignore unknown fields: new fields are added with defaults. "
                "`x-llmgw-jetstream` names the stream (and KV bucket) that keeps a channel's messages."
            ),
        },
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": (
                    "The cluster's NATS server with JetStream (`llmgw up` starts one on :4222; "
                    "compose names it nats:4222). With `llmgw auth`, each identity connects with "
                    "its own nkey and may use only the subjects auth.conf grants it."
                ),
                "security": [{"$ref": "#/components/securitySchemes/nkey"}],
                "bindings": {"nats": {"bindingVersion": "0.1.0"}},
                "x-llmgw-client": copy.deepcopy(CLIENT),
            }
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {
            "securitySchemes": {
                "nkey": {
                    "type": "asymmetricEncryption",
                    "description": (
                        "NATS nkey authentication: the server's challenge signed with the identity's "
                        "ed25519 seed (`llmgw auth init` writes one per identity); what each may publish "
                        "and subscribe to is in docs/security.md. `llmgw up --insecure` and a server "
                        "without `llmgw auth` take no credentials."
                    ),
                }
            },
            "parameters": {name: {"description": text} for name, text in PARAMETERS.items()},
            "messages": messages,
            "schemas": dict(sorted(_name_enums(components).items())),
        },
    }


def render() -> str:
    header = "# Generated by `python -m llmgw_core.asyncapi`; do not edit by hand.\n"
    return header + yaml.safe_dump(document(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
