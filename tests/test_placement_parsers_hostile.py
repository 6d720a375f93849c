"""The placement API's and page's readers of a request's own bytes, fuzzed: an `If-Match`
header and the page's query string. Only a value or the reader's own refusal comes back."""

from __future__ import annotations

from urllib.parse import quote_from_bytes

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.requests import Request

from llmgw_placement.deployments_api import if_match
from llmgw_placement.page_fleet import STATES, Query


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200) | st.from_regex(r'\A(W/)?"?[0-9]{1,25}"?\Z'))
def test_if_match_is_a_bounded_revision_or_its_refusal(header: str) -> None:
    got = if_match(header)
    if isinstance(got, int):
        # A revision is digits only, at most 19 of them: it fits NATS's sequence numbers.
        assert 0 <= got < 10**19
    else:
        assert isinstance(got, str)
        assert got.startswith("If-Match ")
        assert "give the revision the write is based on" in got


def test_if_match_reads_an_etag_as_the_api_writes_it() -> None:
    assert if_match(None) is None
    assert if_match('"12"') == 12
    assert if_match('W/"0"') == 0
    assert isinstance(if_match('"12a"'), str)
    assert isinstance(if_match("1" * 20), str)


def _request(query: bytes) -> Request:
    return Request({"type": "http", "method": "GET", "path": "/", "query_string": query, "headers": []})


def _encoded(pairs: list[tuple[str, str]]) -> bytes:
    return "&".join(
        f"{quote_from_bytes(k.encode())}={quote_from_bytes(v.encode())}" for k, v in pairs
    ).encode()


_PAIRS = st.lists(
    st.tuples(st.sampled_from(["node", "state", "deployment"]) | st.text(max_size=300), st.text(max_size=300))
)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048) | _PAIRS.map(_encoded))
def test_the_pages_query_is_bounded_whatever_the_address_says(query: bytes) -> None:
    q = Query.of(_request(query))
    assert len(q.node) <= 200
    assert len(q.deployment) <= 200
    assert q.state in ("", *STATES)
    # Its links are built again from it without a fault.
    assert q.href(node="n1").startswith("?")
