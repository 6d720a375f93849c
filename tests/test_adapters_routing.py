"""The gateway's view of LoRA adapters, as pure functions over shard statuses: which replicas hold
an adapter, the `lora` field each is sent, and what admission makes of a model name and a key."""

from __future__ import annotations

import json

from llmgw_core.adapters import ServedAdapter
from llmgw_core.engines import default_registry
from llmgw_core.events import ReplicaRecord, ShardStatus
from llmgw_core.keys import ApiKey, secret_hash
from llmgw_gateway.adapters import AdapterIndex
from llmgw_gateway.admission import Admitted, Refusal, Tables, admit, model_objects
from llmgw_gateway.keyring import Keyring
from llmgw_gateway.routing import Table


def status(replica: str, *adapters: ServedAdapter, rank: int = 0, node: str = "n1") -> ShardStatus:
    return ShardStatus(
        node=node,
        shard=f"chat-{replica}-{rank}",
        replica=replica,
        deployment="chat",
        state="ready",
        rank=rank,
        adapters=adapters,
    )


LEGAL, FINANCE = ServedAdapter(name="legal", scale=0.5), ServedAdapter(name="finance")


def test_the_index_follows_what_each_leader_loaded_and_names_every_scale() -> None:
    index = AdapterIndex()
    index.observe("n1.chat-r0-0", status("r0", FINANCE, LEGAL))
    index.observe("n2.chat-r1-0", status("r1", LEGAL, node="n2"))
    # A worker rank's word does not count: the leader runs the server.
    index.observe("n3.chat-r2-1", status("r2", FINANCE, rank=1, node="n3"))
    assert index.names() == ["finance", "legal"]
    assert index.holders("legal") == ("chat", frozenset({"chat.r0", "chat.r1"}))
    assert index.holders("finance") == ("chat", frozenset({"chat.r0"}))
    assert index.lora("chat.r0", "legal") == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.5}]
    assert index.lora("chat.r1", "legal") == [{"id": 0, "scale": 0.5}]
    # The base: every adapter at 0 (llama-server applies them to a request that names none).
    assert index.lora("chat.r0", "") == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 0.0}]
    assert index.lora("chat.r9", "legal") is None
    index.observe("n1.chat-r0-0", None)
    assert index.holders("finance") is None
    assert index.any_on("chat")
    index.observe("n2.chat-r1-0", status("r1", node="n2"))
    assert not index.any_on("chat")


def _tables(*keys: tuple[str, tuple[str, ...]]) -> Tables:
    table = Table()
    for replica in ("r0", "r1"):
        table.set_replica(
            f"chat.{replica}",
            ReplicaRecord(
                deployment="chat",
                replica=replica,
                profile="tiny",
                profile_fp="x",
                state="ready",
                url=f"http://{replica}",
                engine="llamacpp",
            ),
        )
    table.set_shard_status("n1.chat-r0-0", status("r0", FINANCE, LEGAL))
    keyring = Keyring(required=True)
    for name, models in keys:
        keyring.set(name, ApiKey(name=name, hash=secret_hash(f"sk-{name}"), models=models))
    return Tables(keyring, table, default_registry(), 64)


def _admit(tables: Tables, model: str, key: str) -> Admitted | Refusal:
    headers = [(b"authorization", f"Bearer sk-{key}".encode())]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]}).encode()
    return admit(headers, body, "/v1/chat/completions", tables, loaded=True)


def test_an_adapter_goes_to_its_base_on_the_replicas_that_hold_it_and_a_key_is_held_to_its_models() -> None:
    tables = _tables(("all", ()), ("legal", ("legal",)), ("chat", ("chat",)))
    admitted = _admit(tables, "legal", "all")
    assert isinstance(admitted, Admitted)
    assert (admitted.deployment, admitted.adapter, admitted.unserved) == ("chat", "legal", {"chat.r1"})
    base = _admit(tables, "chat", "all")
    assert isinstance(base, Admitted)
    assert (base.adapter, base.unserved) == ("", frozenset())
    assert isinstance(_admit(tables, "legal", "legal"), Admitted)
    for model in ("chat", "finance"):
        refused = _admit(tables, model, "legal")
        assert isinstance(refused, Refusal)
        assert (refused.status, refused.code) == (403, "model_not_allowed")
        assert refused.message == f"this key may call legal only, not '{model}'; ask for a key that names it"
    # A key for the base does not reach its adapters, and the name is not confirmed to it.
    refused = _admit(tables, "legal", "chat")
    assert isinstance(refused, Refusal)
    assert refused.status == 404
    unknown = _admit(tables, "nope", "legal")
    assert isinstance(unknown, Refusal)
    assert unknown.status == 404


def test_models_lists_each_adapter_a_key_may_call_with_its_parent() -> None:
    tables = _tables(("all", ()), ("legal", ("legal",)))
    every = model_objects(tables.table, tables.keyring.identify("Bearer sk-all"))  # type: ignore[arg-type]
    assert [(m["id"], m.get("parent"), m["ready_replicas"]) for m in every] == [
        ("chat", None, 2),
        ("finance", "chat", 1),
        ("legal", "chat", 1),
    ]
    scoped = model_objects(tables.table, tables.keyring.identify("Bearer sk-legal"))  # type: ignore[arg-type]
    assert [m["id"] for m in scoped] == ["legal"]
