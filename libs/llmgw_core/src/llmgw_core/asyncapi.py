"""The AsyncAPI 3.0 document for every subject and bucket, generated from the message types.

`python -m llmgw_core.asyncapi > docs/asyncapi.yaml` regenerates it; a test fails
when the committed document and the types disagree.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec
import yaml

from . import events as ev
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
        "launcherLogs",
        _N.launcher_logs("{node}"),
        ev.ShardLogsRequest,
        "Request/reply (plain NATS): the node's launcher answers with a ShardLogs, the shard's "
        "own log lines, at most about 1 MB (`llmgw ctl logs`); an unknown shard gets `error`.",
        ["node"],
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
]

# Request/reply channels: the reply's message and what it says; it comes on the requester's
# own inbox (AsyncAPI: a reply channel with a null address).
REPLIES: dict[str, tuple[type[msgspec.Struct], str]] = {
    "launcherLogs": (ev.ShardLogs, "The launcher's reply: the shard's log lines, or why none."),
}

PARAMETERS = {
    "prefix": "Subject prefix, `llmgw` by default.",
    "node": "Node id, matching [A-Za-z0-9_-]+.",
    "shard": "Shard id, matching [A-Za-z0-9_-]+.",
    "deployment": "Deployment name, matching [A-Za-z0-9_-]+.",
    "replica": "Replica id, matching [A-Za-z0-9_-]+.",
    "profile": "Profile name, matching [A-Za-z0-9_-]+.",
}


def document() -> dict[str, Any]:
    types = sorted({c[2] for c in CHANNELS} | {r[0] for r in REPLIES.values()}, key=lambda t: t.__name__)
    (_, components) = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for cid, address, message, description, params, action in CHANNELS:
        channels[cid] = _channel(address, message, description, ["prefix", *params])
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
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmgw bus",
            "version": "0.1.0",
            "description": (
                "Messages llmgw exchanges over NATS JetStream. Every payload is JSON; "
                "every JetStream publish carries Nats-Msg-Id and W3C traceparent headers. "
                "Readers must ignore unknown fields: new fields are added with defaults."
            ),
        },
        "defaultContentType": "application/json",
        "channels": channels,
        "operations": operations,
        "components": {
            "parameters": {name: {"description": text} for name, text in PARAMETERS.items()},
            "messages": {
                t.__name__: {
                    "name": t.__name__,
                    "payload": {"$ref": f"#/components/schemas/{t.__name__}"},
                }
                for t in types
            },
            "schemas": dict(sorted(components.items())),
        },
    }


def render() -> str:
    header = "# Generated by `python -m llmgw_core.asyncapi`; do not edit by hand.\n"
    return header + yaml.safe_dump(document(), sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
