"""A client written from docs/asyncapi.yaml alone, with authentication on: it connects, finds its
inbox and the streams, and subscribes to events and KV values, each value taken from the document;
every header the bus sends it is one the document names for that message."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anyio
import nats
import nats.errors
import nkeys
import pytest
import yaml

from llmgw_core.bus import Bus, Writes
from llmgw_core.events import ReplicaRecord, ReplicaStatus
from tests import auth_support

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

DOC = Path(__file__).parent.parent / "docs" / "asyncapi.yaml"


def message_of(doc: dict[str, Any], cid: str) -> dict[str, Any]:
    (ref,) = doc["channels"][cid]["messages"].values()
    message: dict[str, Any] = doc["components"]["messages"][ref["$ref"].rsplit("/", 1)[1]]
    return message


def subject(doc: dict[str, Any], cid: str, prefix: str) -> str:
    """The channel's address for `prefix`, every other parameter a wildcard token."""
    address: str = doc["channels"][cid]["address"]
    return re.sub(r"\{[a-z]+\}", "*", address.replace("{prefix}", prefix))


def stream(doc: dict[str, Any], cid: str, prefix: str) -> str:
    client = doc["servers"]["nats"]["x-llmgw-client"]
    name: str = doc["channels"][cid]["x-llmgw-jetstream"]["stream"].replace("{prefix}", prefix)
    # The document's own rule for `{PREFIX}`: capitals, `-` as `_`.
    assert "in capitals, each `-` written `_`" in client["streamPrefix"]["{PREFIX}"]
    return name.replace("{PREFIX}", prefix.upper().replace("-", "_"))


async def test_a_client_configured_from_the_document_alone_subscribes_with_authentication_on(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a client written from docs/asyncapi.yaml was refused as every identity
    (`permissions violation for subscription to "_inbox.…"`, then `$js.api.stream.names`): the
    inbox prefix was only in docs/security.md, the stream names not said, and `Nats-Batch-*`
    headers came undocumented."""
    session = auth_support.session_for(nats_url)
    if session is None:
        pytest.skip("an external NATS server has no llmgw identities")
    seed = session.identities(prefix, tmp_path / "auth").seed("observer")
    doc = yaml.safe_load(DOC.read_text())
    client = doc["servers"]["nats"]["x-llmgw-client"]
    assert doc["servers"]["nats"]["security"] == [{"$ref": "#/components/securitySchemes/nkey"}]
    public_key = nkeys.from_seed(seed.read_bytes().strip()).public_key.decode()
    inbox = client["inboxPrefix"].replace("{publicKey}", public_key)
    assert inbox == f"_INBOX.{public_key}"

    # What the cluster writes: an event alone; then a KV value and two events in one commit, an
    # atomic batch per stream.
    event = bus.names.replica_event("chat", "r0")
    await bus.publish(event, ReplicaStatus(deployment="chat", replica="r0", state="starting"))
    writes = Writes()
    writes.put(
        bus.names.replicas_bucket,
        "chat.r0",
        ReplicaRecord(deployment="chat", replica="r0", profile="tiny", profile_fp="fp", state="ready"),
    )
    for state in ("loading", "ready"):
        writes.publish(event, ReplicaStatus(deployment="chat", replica="r0", state=state))
    await bus.commit(writes)

    errors: list[str] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(
        session.url, nkeys_seed=str(seed), inbox_prefix=inbox, error_cb=error_cb, allow_reconnect=False
    )
    try:
        js = nc.jetstream(timeout=5)
        seen: dict[str, list[dict[str, str]]] = {}
        for cid, count in (("replicaEvent", 3), ("replicasBucket", 1)):
            sub = await js.subscribe(
                subject(doc, cid, prefix), stream=stream(doc, cid, prefix), ordered_consumer=True
            )
            seen[cid] = []
            with anyio.fail_after(10):
                while len(seen[cid]) < count:
                    msg = await sub.next_msg(timeout=5)
                    seen[cid].append(dict(msg.headers or {}))
            await sub.unsubscribe()
        assert errors == []
    finally:
        await nc.close()

    for cid, headers in seen.items():
        promised = message_of(doc, cid)["headers"]
        for got in headers:
            assert set(got) <= set(promised["properties"]), (cid, got)
            assert set(promised.get("required", ())) <= set(got), (cid, got)
            for name, value in got.items():
                schema = promised["properties"][name]
                if "pattern" in schema:
                    assert re.match(schema["pattern"], value), (cid, name, value)
                if "const" in schema:
                    assert value == schema["const"], (cid, name, value)
    # The batches were atomic (this server takes them): their headers came, each documented.
    alone, *batch = seen["replicaEvent"]
    assert "Nats-Batch-Id" not in alone
    assert [(h["Nats-Batch-Sequence"], h.get("Nats-Batch-Commit")) for h in batch] == [
        ("1", None),
        ("2", "1"),
    ]
    assert batch[0]["Nats-Batch-Id"] == batch[1]["Nats-Batch-Id"]
    (value,) = seen["replicasBucket"]
    assert (value["Nats-Batch-Sequence"], value["Nats-Batch-Commit"]) == ("1", "1")


async def test_without_the_documents_inbox_prefix_the_identity_is_refused(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """The document's values are needed, not decoration: nats-py's default inbox is refused."""
    session = auth_support.session_for(nats_url)
    if session is None:
        pytest.skip("an external NATS server has no llmgw identities")
    seed = session.identities(prefix, tmp_path / "auth").seed("observer")
    errors: list[str] = []

    async def error_cb(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(session.url, nkeys_seed=str(seed), error_cb=error_cb, allow_reconnect=False)
    try:
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await nc.request(f"$JS.API.STREAM.INFO.{bus.names.events_stream}", b"", timeout=1)
    finally:
        await nc.close()
    assert any('permissions violation for subscription to "_inbox.' in e for e in errors), errors
