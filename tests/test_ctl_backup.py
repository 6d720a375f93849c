"""`llmgw ctl backup` and `restore`: the desired state to a file and back, the file read as the
outside bytes it is, and a cluster whose NATS store was lost serving again with the same keys."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.ctl._backup import (
    MAX_BACKUP_BYTES,
    VERSION,
    Backup,
    BackupError,
    parse,
    plan,
)
from llmgw_core.events import Autoscale, Deployment, DesiredEngines, NodeIntent, encode
from llmgw_core.keys import ApiKey
from llmgw_core.subjects import Names

NAMES = Names("llmgw")
HASH = "ab" * 32


def backup_of(**sections: Any) -> Backup:
    return Backup(version=VERSION, prefix="llmgw", written_at=1000.0, **sections)


def raw(backup: Backup) -> bytes:
    return encode(backup)


# --- the file, as outside bytes ------------------------------------------------------


def test_a_backup_reads_back_as_it_was_written() -> None:
    taken = backup_of(
        engines=DesiredEngines(),
        deployments={
            "chat": Deployment(
                name="chat", profile="tiny", autoscale=Autoscale(min_replicas=0, max_replicas=4)
            )
        },
        keys={"team": ApiKey(name="team", hash=HASH, models=("chat",), rpm=60)},
        node_intents={"gpu-3": NodeIntent(node="gpu-3", drain=True, reason="disk swap")},
    )
    assert parse(raw(taken), "b.json") == taken


def test_an_unknown_version_is_refused_in_words_that_say_what_to_do() -> None:
    with pytest.raises(BackupError) as refused:
        parse(b'{"version": 7, "written_at": 1, "whatever": [1, 2]}', "old.json")
    assert str(refused.value) == (
        "old.json: backup format version 7 is not one this llmgw reads (it reads 1); "
        "restore it with the llmgw that wrote it, or one that reads its version"
    )


def test_a_file_too_large_for_a_backup_is_refused_before_it_is_decoded() -> None:
    with pytest.raises(BackupError) as refused:
        parse(b" " * (MAX_BACKUP_BYTES + 1), "huge.json")
    assert "over the 67108864 a backup may take" in str(refused.value)


def test_bad_values_are_refused_naming_where_and_nothing_is_restored() -> None:
    stolen = {
        "version": 1,
        "written_at": 1,
        "keys": {"team": {"kind": "ApiKey", "name": "other", "hash": HASH}},
    }
    with pytest.raises(BackupError) as refused:
        parse(json.dumps(stolen).encode(), "b.json")
    assert str(refused.value) == (
        "b.json: keys.team: holds 'other': a record is stored under its own name; nothing was restored"
    )
    negative = {
        "version": 1,
        "written_at": 1,
        "deployments": {"chat": {"kind": "Deployment", "name": "chat", "profile": "t", "replicas": -1}},
    }
    with pytest.raises(BackupError) as refused:
        parse(json.dumps(negative).encode(), "b.json")
    assert str(refused.value) == (
        "b.json: deployments.chat: Expected `int` >= 0 - at `$.replicas`; nothing was restored"
    )
    dotted = {"version": 1, "written_at": 1, "deployments": {"a.b": {"kind": "Deployment", "name": "a.b"}}}
    with pytest.raises(BackupError):
        parse(json.dumps(dotted).encode(), "b.json")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_fuzz_any_bytes_are_a_backup_or_backup_error(data: bytes) -> None:
    started = time.monotonic()
    with contextlib.suppress(BackupError):
        parse(data, "f")
    assert time.monotonic() - started < 1.0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)
_section = st.dictionaries(
    st.text(max_size=70),
    st.fixed_dictionaries(
        {"kind": st.sampled_from(["Deployment", "ApiKey", "NodeIntent", "Profile", "x"])},
        optional={"name": st.text(max_size=70), "node": st.text(max_size=70), "hash": st.text(max_size=70)},
    )
    | _json,
    max_size=4,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {"version": st.sampled_from([1, 1, 1, 0, 2, -1, 10**30])},
        optional={
            "written_at": st.floats() | st.integers() | _json,
            "prefix": st.text(max_size=80) | _json,
            "engines": _json,
            "catalog": _section,
            "deployments": _section,
            "keys": _section,
            "node_intents": _section,
        },
    )
)
def test_fuzz_backup_shaped_documents_are_a_backup_or_backup_error(doc: dict[str, Any]) -> None:
    try:
        data = json.dumps(doc).encode()
    except ValueError:
        return  # a float JSON cannot write
    try:
        found = parse(data, "f")
    except BackupError:
        return
    assert found.version == VERSION


# --- the plan: what a restore writes ------------------------------------------------


def stored(value: msgspec.Struct, revision: int, at: float) -> tuple[int, bytes, float]:
    return revision, encode(value), at


def test_a_restore_writes_what_is_gone_or_older_leaves_what_matches_and_refuses_what_is_newer() -> None:
    chat = Deployment(name="chat", profile="tiny", replicas=2)
    code = Deployment(name="code", profile="tiny")
    team = ApiKey(name="team", hash=HASH)
    taken = backup_of(deployments={"chat": chat, "code": code}, keys={"team": team})
    names = NAMES
    held = {
        names.deployments_bucket: {
            "chat": stored(msgspec.structs.replace(chat, replicas=5), 7, 2000.0),  # changed since
            "code": stored(msgspec.structs.replace(code, replicas=3), 4, 500.0),  # older than it
        },
        names.keys_bucket: {"team": stored(team, 2, 2000.0)},  # as the backup has it
    }
    todo = plan(taken, held, names)
    assert [(r.what, rev) for r, rev in todo.writes] == [("deployment code", 4)]
    assert [r.what for r in todo.same] == ["key team"]
    assert [(r.what, at) for r, at in todo.newer] == [("deployment chat", 2000.0)]
    forced = plan(taken, held, names, force=True)
    assert [(r.what, rev) for r, rev in forced.writes] == [("deployment chat", 7), ("deployment code", 4)]
    empty = plan(taken, {}, names)
    assert [(r.what, rev) for r, rev in empty.writes] == [
        ("deployment chat", None),
        ("deployment code", None),
        ("key team", None),
    ]
