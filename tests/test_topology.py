"""The topology names only llmgw's own streams and buckets, and the permissions grant what it
says each identity needs: a node that may not ask for a stream's info waits for it forever."""

from __future__ import annotations

import pytest

from llmgw_core.access import NODE_ROLE_PREFIX, ROLES, permissions
from llmgw_core.subjects import Names
from llmgw_core.topology import all_streams, kv_stream, needs, node_streams, stream_of

NAMES = Names("t-1")


def _role(kind: str) -> str:
    return f"{NODE_ROLE_PREFIX}gpu-01" if kind == "node" else kind


def test_every_identity_has_needs_and_they_name_only_llmgws_streams() -> None:
    found = needs(NAMES)
    assert set(found) == {*ROLES, "node"}
    streams = set(all_streams(NAMES))
    for kind, need in found.items():
        assert set(need.reads) <= streams, kind
        assert set(need.manages) <= streams, kind
        assert set(need.requires) <= streams, kind
        assert {kv_stream(b) for b in need.writes} <= streams, kind
    assert found["placement"].manages == tuple(all_streams(NAMES))
    assert found["node"].requires == tuple(node_streams(NAMES))


@pytest.mark.parametrize("kind", [*ROLES, "node"])
def test_the_permissions_grant_what_each_identity_needs(kind: str) -> None:
    need = needs(NAMES)[kind]
    granted = set(permissions(_role(kind), NAMES, "UKEY").publish)
    for stream in {*need.reads, *need.requires, *need.manages}:
        assert f"$JS.API.STREAM.INFO.{stream}" in granted, stream
    for stream in need.reads:
        assert f"$JS.API.CONSUMER.CREATE.{stream}.>" in granted, stream
    for bucket in need.writes:
        assert f"$KV.{bucket}.>" in granted, bucket
    for stream in need.manages:
        assert f"$JS.API.STREAM.CREATE.{stream}" in granted, stream


def test_a_subject_is_stored_in_its_buckets_stream_or_the_events_stream() -> None:
    assert stream_of(NAMES, f"$KV.{NAMES.nodes_bucket}.gpu-01") == "KV_t-1-nodes"
    assert stream_of(NAMES, NAMES.node_install("gpu-01")) == NAMES.events_stream
