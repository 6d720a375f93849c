"""Subjects, keys and their patterns, as they go on the wire: a pattern built from the
same builder as the subjects it matches cannot drift from them."""

from __future__ import annotations

from llmgw_core.access import permissions
from llmgw_core.subjects import ALL, ENGINES_KEY, ONE, Names

N = Names("p")


def test_the_patterns_are_the_subjects_with_wildcards() -> None:
    assert N.node_events("n1") == "p.events.node.n1.>"
    assert N.shard_event("n1", ALL) == "p.events.shard.n1.>"
    assert N.shard_events_all == "p.events.shard.>"
    assert N.replica_event("chat", ALL) == "p.events.replica.chat.>"
    assert N.replica_events_all == "p.events.replica.>"
    assert N.deployment_event(ONE) == "p.events.deployment.*"
    assert N.heartbeat("n1", ONE) == "p.heartbeat.n1.*"
    assert N.kv_subject(N.shard_status_bucket, N.shard_key("n1", ONE)) == "$KV.p-shard-status.n1.*"
    assert N.kv_subject(N.config_bucket, ENGINES_KEY) == "$KV.p-config.engines"


def test_a_nodes_permissions_name_only_its_own_subjects_and_keys() -> None:
    """The permissions as nats-server reads them, written out by hand: the wire, not the builders."""
    publish = set(permissions("node-n1", N, "UKEY").publish)
    assert {
        "$KV.p-nodes.n1",
        "$KV.p-shard-status.n1.*",
        "p.heartbeat.n1.*",
        "p.events.node.n1.>",
        "p.events.shard.n1.>",
        "p.dlq.installer-n1",
        "p.dlq.launcher-n1",
        "$JS.API.DIRECT.GET.KV_p-shards.$KV.p-shards.n1.*",
    } <= publish
    placement = set(permissions("placement", N, "UKEY").publish)
    assert {"$KV.p-replicas.>", "p.events.replica.>", "p.events.deployment.>", "p.dlq.placement"} <= placement
    ctl = set(permissions("ctl", N, "UKEY").publish)
    assert {"$KV.p-config.engines", "p.launcher.*.logs", "p.dlq.llmgw-ctl", "p.dlq.llmgw-up"} <= ctl
