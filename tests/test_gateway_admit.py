"""The gateway's admission (`admission.admit`), written once and called by both of its paths
(the ASGI app and the express lane): plain values in, an `Admitted` or a `Refusal` out, no
I/O. Table cases for each refusal in the order the ASGI path answers them, and a fuzz test
that no header, body or path makes it raise: a refusal is a value, never an exception."""

from __future__ import annotations

import json
import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.engines import default_registry
from llmgw_core.events import Deployment, ReplicaRecord
from llmgw_core.keys import ApiKey, secret_hash
from llmgw_gateway.admission import STARTING, Admitted, Refusal, Tables, admit
from llmgw_gateway.keyring import Keyring, file_keys
from llmgw_gateway.routing import Table
from llmgw_gateway.surface import ROUTED

SECRET = "sk-admit-file"
LIMITED = "sk-admit-only-chat"
REVOKED = "sk-admit-revoked"


def tables(max_json_depth: int = 16) -> Tables:
    """Keys required: a file key (every model), a key for `chat` only and a revoked one; `chat`
    (alias `gpt`) on a sim engine, `embed` on llama.cpp (which serves no `/v1/embeddings`)."""
    keyring = Keyring(required=True, file=file_keys(frozenset({SECRET})))
    keyring.set("only-chat", ApiKey(name="only-chat", hash=secret_hash(LIMITED), models=("chat",)))
    keyring.set("gone", ApiKey(name="gone", hash=secret_hash(REVOKED), revoked_at=1_000.0))
    table = Table()
    table.set_deployment("chat", Deployment(name="chat", profile="tiny", aliases=("gpt",)))
    table.set_deployment("embed", Deployment(name="embed", profile="tiny"))
    for deployment, engine in (("chat", "sim"), ("embed", "llamacpp")):
        table.set_replica(
            f"{deployment}.r0",
            ReplicaRecord(
                deployment=deployment,
                replica="r0",
                profile="tiny",
                profile_fp="x",
                state="ready",
                url="http://127.0.0.1:1",
                engine=engine,
            ),
        )
    return Tables(keyring, table, default_registry(), max_json_depth)


TABLES = tables()


def bearer(secret: str) -> list[tuple[bytes, bytes]]:
    return [(b"host", b"gw"), (b"authorization", f"Bearer {secret}".encode())]


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "chat", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def refusal(headers: list[tuple[bytes, bytes]], raw: bytes, path: str = "/v1/chat/completions") -> Refusal:
    found = admit(headers, raw, path, TABLES, loaded=True, now=2_000.0)
    assert isinstance(found, Refusal), found
    return found


def test_a_request_is_admitted_to_the_deployment_its_model_or_alias_names() -> None:
    raw = body(model="gpt", max_tokens=8)
    found = admit(bearer(SECRET), raw, "/v1/chat/completions", TABLES, loaded=True)
    assert isinstance(found, Admitted)
    assert (found.key.name, found.model, found.deployment) == (
        f"file-{secret_hash(SECRET)[:8]}",
        "gpt",
        "chat",
    )
    # Sent as it came: nothing asked of the engine that the client did not ask.
    assert found.body == raw
    assert not found.strip
    assert found.unserved == frozenset()
    assert found.estimate.prompt == -(-len(raw) // 4)
    # Anthropic's clients send the key as `x-api-key`.
    by_x = admit([(b"x-api-key", SECRET.encode())], raw, "/v1/messages", TABLES, loaded=True)
    assert isinstance(by_x, Admitted)
    assert by_x.deployment == "chat"


def test_a_stream_not_asking_for_its_usage_is_sent_asking_and_the_usage_chunk_is_taken_out() -> None:
    raw = body(stream=True)
    found = admit(bearer(SECRET), raw, "/v1/chat/completions", TABLES, loaded=True)
    assert isinstance(found, Admitted)
    assert found.strip
    assert json.loads(found.body)["stream_options"] == {"include_usage": True}
    # Judged on the body as the client sent it.
    assert found.estimate.prompt == -(-len(raw) // 4)
    asked = admit(
        bearer(SECRET),
        body(stream=True, stream_options={"include_usage": True}),
        "/v1/chat/completions",
        TABLES,
        loaded=True,
    )
    assert isinstance(asked, Admitted)
    assert not asked.strip


def test_each_refusal_says_what_and_is_counted_under_its_reason() -> None:
    cases = [
        (
            bearer("sk-nobody"),
            body(),
            "/v1/chat/completions",
            (401, "invalid_api_key", "unauthorized", "(unknown)"),
        ),
        ([], body(), "/v1/chat/completions", (401, "invalid_api_key", "unauthorized", "(unknown)")),
        (
            bearer(REVOKED),
            body(),
            "/v1/chat/completions",
            (401, "revoked_api_key", "unauthorized", "(unknown)"),
        ),
        (
            bearer(SECRET),
            b"{not json",
            "/v1/chat/completions",
            (400, "invalid_json", "bad_request", "(unknown)"),
        ),
        (bearer(SECRET), b"[]", "/v1/chat/completions", (400, "missing_model", "bad_request", "(unknown)")),
        (
            bearer(SECRET),
            b"[" * 17 + b"]" * 17,
            "/v1/chat/completions",
            (400, "json_too_deep", "bad_request", "(unknown)"),
        ),
        (
            bearer(SECRET),
            body(stream="yes"),
            "/v1/chat/completions",
            (400, "invalid_type", "bad_request", "(unknown)"),
        ),
        (
            bearer(SECRET),
            body(model="nope"),
            "/v1/chat/completions",
            (404, "model_not_found", "unknown_model", "(unknown)"),
        ),
        # A model the key may not call is unknown to it, as one that does not exist.
        (
            bearer(LIMITED),
            body(model="embed"),
            "/v1/embeddings",
            (404, "model_not_found", "unknown_model", "(unknown)"),
        ),
        (
            bearer(SECRET),
            body(model="embed"),
            "/v1/embeddings",
            (400, "unsupported_endpoint", "unsupported_path", "embed"),
        ),
    ]
    for headers, raw, path, (status, code, reason, deployment) in cases:
        found = refusal(headers, raw, path)
        assert (found.status, found.code, found.reason, found.deployment) == (
            status,
            code,
            reason,
            deployment,
        ), (
            raw,
            found,
        )
        assert found.message
        assert not found.loading
    assert refusal(bearer(SECRET), body(stream="yes")).param == "stream"
    assert refusal(bearer(LIMITED), body(model="nope")).message == (
        "model 'nope' is not served here; known models: chat (aliases: gpt)"
    )
    assert refusal(bearer(SECRET), body(model="embed"), "/v1/embeddings").message == (
        "deployment embed runs on engine llamacpp, which does not serve /v1/embeddings; it serves "
        "/v1/chat/completions, /v1/completions, /v1/messages, /v1/responses"
    )


def test_before_the_buckets_are_read_a_known_body_waits_and_a_bad_one_is_refused_at_once() -> None:
    # An unknown model may only be unknown yet: the ASGI path waits for the buckets, then admits again.
    assert admit(bearer(SECRET), body(model="nope"), "/v1/chat/completions", TABLES, loaded=False) is STARTING
    assert STARTING.loading
    assert STARTING.status == 503
    assert STARTING.code == "gateway_starting"
    # What no bucket can change is answered without the wait.
    bad = admit(bearer(SECRET), b"{", "/v1/chat/completions", TABLES, loaded=False)
    assert isinstance(bad, Refusal)
    assert bad.code == "invalid_json"
    assert not bad.loading


HEADER_NAMES = st.sampled_from([b"authorization", b"x-api-key", b"host", b"content-type", b"traceparent"])
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
FIELDS = st.dictionaries(
    st.sampled_from(
        ["model", "stream", "stream_options", "max_tokens", "max_completion_tokens", "n", "messages"]
    ),
    JSONISH | st.sampled_from(["chat", "gpt", "embed", ""]),
    max_size=6,
)
BODIES = st.one_of(
    st.binary(max_size=256),
    FIELDS.map(lambda d: json.dumps(d).encode()),
    st.integers(min_value=0, max_value=200).map(lambda n: b"[" * n + b"]" * n),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    headers=st.lists(
        st.tuples(
            HEADER_NAMES,
            st.one_of(
                st.binary(max_size=80), st.sampled_from([b"Bearer " + SECRET.encode(), LIMITED.encode()])
            ),
        ),
        max_size=4,
    ),
    raw=BODIES,
    path=st.one_of(st.sampled_from(ROUTED), st.text(max_size=30)),
    loaded=st.booleans(),
)
def test_no_input_makes_admission_raise_only_refuse(
    headers: list[tuple[bytes, bytes]], raw: bytes, path: str, loaded: bool
) -> None:
    started = time.perf_counter()
    found = admit(headers, raw, path, TABLES, loaded=loaded)
    assert isinstance(found, Admitted | Refusal)
    if isinstance(found, Refusal):
        assert 400 <= found.status < 600
        assert found.message
        assert found.code
        # Its words are bounded whatever the input's size: the model named is shown cut short.
        assert len(found.message) < 2_000
    else:
        assert found.deployment in {"chat", "embed"}
        assert isinstance(found.payload, dict)
        assert len(found.body) <= 2 * len(raw) + 64
    assert time.perf_counter() - started < 0.5
