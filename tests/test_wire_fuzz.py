"""Every wire type's decoder, fed what any identity on the bus could publish.

The bus client reads every message and stored value through one function
(`llmgw_core.bus.deadletter.decode`): whatever the bytes, it returns the type or raises
`DecodeFailure` with msgspec's words cut to a bounded length (they quote the bad value,
an enum's string whole), which the caller dead-letters. Nothing else may escape: an
exception of another kind would end a watcher that serves every record.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core import events
from llmgw_core.bus.deadletter import MAX_ERROR_CHARS, DecodeFailure, decode


def _wire_types() -> list[type[msgspec.Struct]]:
    found: list[type[msgspec.Struct]] = []
    todo: list[type[msgspec.Struct]] = [events.Message]
    while todo:
        kind = todo.pop()
        for sub in kind.__subclasses__():
            found.append(sub)
            todo.append(sub)
    return sorted(set(found), key=lambda k: k.__name__)


WIRE_TYPES = _wire_types()

# Values an attacker reaches for: huge and negative integers, floats msgspec may read as
# infinite, long strings, deep and wide containers.
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([10**400, -(10**400), 2**64, 2**63, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.just("x" * 3000),
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=12,
)


def _raw(value: Any) -> bytes:
    """JSON text for `value`, with Python's unbounded integers and non-finite floats as written."""
    return json.dumps(value, allow_nan=True).encode()


def _document(kind: type[msgspec.Struct]) -> st.SearchStrategy[bytes]:
    """A JSON object with the type's own tag and field names, each holding anything."""
    names = [f.encode_name for f in msgspec.structs.fields(kind)]
    tag = kind.__struct_config__.tag
    fields = st.dictionaries(st.sampled_from(names), _json, max_size=len(names)) if names else st.just({})
    return fields.map(lambda doc: _raw({"kind": tag, **doc}))


def _assert_bounded(kind: type[msgspec.Struct], data: bytes) -> None:
    failure: DecodeFailure | None = None
    try:
        value = decode(kind, "llmgw.test", data)
    except DecodeFailure as exc:
        failure = exc
    if failure is None:
        assert isinstance(value, kind)
    else:
        assert failure.subject == "llmgw.test"
        assert len(failure.error) <= MAX_ERROR_CHARS, failure.error[:200]


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=lambda k: k.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_any_bytes_decode_to_the_type_or_a_bounded_decode_failure(
    kind: type[msgspec.Struct], data: bytes
) -> None:
    _assert_bounded(kind, data)


@pytest.mark.parametrize("kind", WIRE_TYPES, ids=lambda k: k.__name__)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_document_with_the_types_fields_decodes_or_fails_bounded(
    kind: type[msgspec.Struct], data: st.DataObject
) -> None:
    _assert_bounded(kind, data.draw(_document(kind)))


def test_a_bad_value_of_a_megabyte_is_named_in_a_bounded_error() -> None:
    """msgspec quotes an unknown tag whole; the failure says how long it was, not all of it."""
    data = _raw({"kind": "x" * 1_000_000})
    with pytest.raises(DecodeFailure) as caught:
        decode(events.NodeStatus, "llmgw.test", data)
    assert len(caught.value.error) <= MAX_ERROR_CHARS
    assert "characters in all" in caught.value.error
