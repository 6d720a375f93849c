"""Subject, stream and bucket names, all derived from one prefix (`llmgw` by default).

A second prefix on the same NATS server is a second, independent cluster:
tests use that to share one server.

Every subject and key llmgw uses is built here, the patterns that subscriptions, key
filters and permissions match included: a builder given `ONE` (`*`) or, in its last
place, `ALL` (`>`) is that pattern. A pattern written by hand elsewhere drifted from the
subjects it meant to match, and then matched nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "llmgw"

# NATS wildcards: one token, and every token to the end.
ONE = "*"
ALL = ">"

# The config bucket's key of the desired engines (`DesiredEngines`).
ENGINES_KEY = "engines"


@dataclass(frozen=True)
class Names:
    prefix: str = DEFAULT_PREFIX

    # --- streams and buckets ---
    @property
    def events_stream(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_EVENTS"

    @property
    def dlq_stream(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_DLQ"

    def bucket(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    @property
    def config_bucket(self) -> str:
        return self.bucket("config")

    @property
    def catalog_bucket(self) -> str:
        return self.bucket("catalog")

    @property
    def deployments_bucket(self) -> str:
        return self.bucket("deployments")

    @property
    def nodes_bucket(self) -> str:
        return self.bucket("nodes")

    @property
    def shards_bucket(self) -> str:
        return self.bucket("shards")

    @property
    def shard_status_bucket(self) -> str:
        return self.bucket("shard-status")

    @property
    def replicas_bucket(self) -> str:
        return self.bucket("replicas")

    @property
    def leases_bucket(self) -> str:
        return self.bucket("leases")

    @property
    def keys_bucket(self) -> str:
        """Client API keys by name (`llmgw_core.keys.ApiKey`, the secret only hashed): `llmgw
        ctl keys` writes them, every gateway watches them."""
        return self.bucket("keys")

    @property
    def limits_bucket(self) -> str:
        """Per API key, the current minute's requests and tokens claimed by the gateways
        (`llmgw_core.keys.KeyWindow`, compare-and-set)."""
        return self.bucket("limits")

    @property
    def routing_bucket(self) -> str:
        """Per replica (`<deployment>.<replica>`), the prompt blocks the gateways believe it
        holds (`llmgw_core.prefixes.RoutingHeld`): every gateway writes and reads it."""
        return self.bucket("routing")

    @property
    def node_intent_bucket(self) -> str:
        """Per node, the operator's cordon or drain (`NodeIntent`); written by ctl and the API."""
        return self.bucket("node-intent")

    @property
    def usage_stream(self) -> str:
        """Tokens spent per key and deployment (`llmgw_core.keys.UsageRecord`), as gateways
        write them; `llmgw ctl usage` sums them."""
        return f"{self.prefix.upper().replace('-', '_')}_USAGE"

    @property
    def usage_all(self) -> str:
        return f"{self.prefix}.usage.>"

    def usage(self, deployment: str, key: str) -> str:
        return f"{self.prefix}.usage.{deployment}.{key}"

    def buckets(self) -> tuple[str, ...]:
        return (
            self.config_bucket,
            self.catalog_bucket,
            self.deployments_bucket,
            self.nodes_bucket,
            self.shards_bucket,
            self.shard_status_bucket,
            self.replicas_bucket,
            self.leases_bucket,
            self.keys_bucket,
            self.limits_bucket,
            self.node_intent_bucket,
            self.routing_bucket,
        )

    # --- subjects ---
    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    def node_facts(self, node: str) -> str:
        return f"{self.prefix}.events.node.{node}.facts"

    def node_engines(self, node: str) -> str:
        return f"{self.prefix}.events.node.{node}.engines"

    def node_install(self, node: str) -> str:
        return f"{self.prefix}.events.node.{node}.install"

    def node_weights(self, node: str) -> str:
        """`WeightsEvicted`: a staged model the node removed to make room."""
        return f"{self.prefix}.events.node.{node}.weights"

    def node_intent(self, node: str) -> str:
        """`NodeIntent`: a node cordoned, drained or uncordoned, and `drained` once it holds none."""
        return f"{self.prefix}.events.node.{node}.intent"

    def node_events(self, node: str) -> str:
        """Every event of one node (facts, engines, install)."""
        return f"{self.prefix}.events.node.{node}.{ALL}"

    def shard_event(self, node: str, shard: str) -> str:
        return f"{self.prefix}.events.shard.{node}.{shard}"

    @property
    def shard_events_all(self) -> str:
        return f"{self.prefix}.events.shard.{ALL}"

    @property
    def replica_events_all(self) -> str:
        return f"{self.prefix}.events.replica.{ALL}"

    def replica_event(self, deployment: str, replica: str) -> str:
        return f"{self.prefix}.events.replica.{deployment}.{replica}"

    def placement_event(self, deployment: str) -> str:
        return f"{self.prefix}.events.placement.{deployment}"

    def scale_event(self, deployment: str) -> str:
        """`ScaleDecision`: an autoscaled deployment's count changed, and why."""
        return f"{self.prefix}.events.scale.{deployment}"

    def demand(self, gateway: str) -> str:
        """Plain NATS, gateway to placement: a `Demand` every second (not stored)."""
        return f"{self.prefix}.demand.{gateway}"

    def judgement(self, gateway: str) -> str:
        """Plain NATS, gateway to placement: a `Judgement` of the replicas that failed its
        requests, with each demand report (not stored)."""
        return f"{self.prefix}.judgement.{gateway}"

    def deployment_event(self, deployment: str) -> str:
        """`DeploymentStatus`: desired, ready, pending and unplaceable, with the refusal."""
        return f"{self.prefix}.events.deployment.{deployment}"

    def heartbeat(self, node: str, service: str) -> str:
        """Each node service beats on its own subject: a silent launcher is told apart
        from a silent installer (`service` is `installer`, `launcher`, or `agent` for a
        process that is both, such as a simulated fleet node)."""
        return f"{self.prefix}.heartbeat.{node}.{service}"

    @property
    def heartbeat_all(self) -> str:
        return f"{self.prefix}.heartbeat.>"

    @property
    def liveness_request(self) -> str:
        """Request/reply: every placement (one answers, a queue group) replies with a
        `Liveness` of every node, as it judges them; `llmgw ctl` asks it."""
        return f"{self.prefix}.placement.liveness"

    @property
    def placement_file(self) -> str:
        """Plain NATS, placement to placement: each says now and then what its server.yaml
        would seed (digests), so that two placements with different files are warned about."""
        return f"{self.prefix}.placement.file"

    def launcher_logs(self, node: str) -> str:
        """Request/reply: the node's launcher answers a `ShardLogsRequest` with `ShardLogs`,
        a shard's own log lines (`llmgw ctl logs`)."""
        return f"{self.prefix}.launcher.{node}.logs"

    def weights_query(self, node: str) -> str:
        """Plain NATS among nodes: `node` asks for a blob (`WeightsQuery`). The asker is this
        subject's last token, which nats-server lets only `node`'s identity publish: a query
        whose payload names another node cannot make a node answer in that node's name."""
        return f"{self.prefix}.weights.who.{node}"

    def weights_offer(self, asker: str, offerer: str) -> str:
        """Plain NATS among nodes: `offerer`'s answer (`WeightsOffer`) to `asker`'s query. Only
        `offerer`'s identity may publish it and only `asker`'s may hear it: the offering node is
        this subject's last token, never the payload's (an invented name cannot offer)."""
        return f"{self.prefix}.weights.offer.{asker}.{offerer}"

    def dlq(self, service: str) -> str:
        return f"{self.prefix}.dlq.{service}"

    @property
    def dlq_all(self) -> str:
        return f"{self.prefix}.dlq.>"

    # --- keys ---
    @staticmethod
    def kv_subject(bucket: str, key: str) -> str:
        """The subject a key of a bucket is stored under (a key filter gives a pattern)."""
        return f"$KV.{bucket}.{key}"

    @staticmethod
    def shard_key(node: str, shard: str) -> str:
        return f"{node}.{shard}"

    @staticmethod
    def replica_key(deployment: str, replica: str) -> str:
        return f"{deployment}.{replica}"
