"""A profile's `model:` parsed once into values: `ModelRef` (the served name, or the source, or
why neither), kept with the profile; the operator's YAML and JSON keys unchanged.

Regression: `model:` meant a served name or a source, told apart by a `"://"` test at each
reader, and `parse_source` ran again at every call site that needed the source."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.config import loads
from llmgw_core.engines import ModelRef, ModelSource, Profile, SourceError, parse_model, parse_source
from llmgw_core.sources import MAX_SOURCE_CHARS

SHA = "ab" * 32


def test_a_served_name_and_a_source_are_two_fields_of_one_parse() -> None:
    named = parse_model("tiny-chat")
    assert named == ModelRef(name="tiny-chat")
    hub = parse_model("hf://org/repo/m.gguf@v1")
    assert hub == ModelRef(
        source=ModelSource(kind="hf", repo="org/repo", file="m.gguf", revision="v1"),
        key="hf://org/repo/m.gguf@v1",
    )
    broken = parse_model("https://host/m.gguf", profile="p")
    assert (broken.name, broken.source) == ("", None)
    assert isinstance(broken.error, SourceError)
    assert (broken.error.profile, str(broken.error)) == (
        "p",
        "profile p: model 'https://host/m.gguf' needs model_sha256 (the file's sha256, 64 hex digits): "
        "a URL's bytes are verified before an engine reads them",
    )


def test_the_profile_keeps_its_parse_and_the_operator_writes_the_same_keys() -> None:
    yaml = (
        "name: chat\nengine: llamacpp\nmodel: https://host/files/m.gguf\n"
        f"model_sha256: {SHA.upper()}\nmodel_path: /ignored.gguf\n"
    )
    profile = loads(yaml, Profile)
    assert profile.model == "https://host/files/m.gguf"  # as written, and written back so
    assert profile.source == ModelSource(kind="url", url="https://host/files/m.gguf", sha256=SHA)
    assert profile.model_ref is loads(yaml, Profile).model_ref  # parsed once, kept
    assert (profile.served_name, profile.weights_key, profile.staged_key) == (
        "chat",
        f"sha256:{SHA}",
        f"sha256:{SHA}",
    )
    # Encoded, it is the fields the operator writes, and nothing derived from them.
    encoded = msgspec.json.decode(msgspec.json.encode(profile))
    assert (set(encoded), encoded["model"]) == (set(Profile.__struct_fields__), "https://host/files/m.gguf")
    # A replaced profile parses its own `model`, never keeping the one it was made from.
    renamed = msgspec.structs.replace(profile, model="tiny-chat", model_sha256="")
    assert (renamed.source, renamed.served_name, renamed.weights_key) == (None, "tiny-chat", "/ignored.gguf")
    # A source that cannot be staged: its readers get the error, naming the profile, each time.
    bad = loads("name: p\nengine: sim\nmodel: hf://org\n", Profile)
    for _ in range(2):
        with pytest.raises(SourceError, match=r"^profile p: model 'hf://org' must name a repository"):
            _ = bad.source
    assert (bad.served_name, bad.weights_key, bad.node_file) == ("p", "", "")


_PART = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True).filter(lambda p: ".." not in p)
_FILE = st.lists(_PART, min_size=0, max_size=4).map("/".join)
_PATH = st.lists(st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True), min_size=1, max_size=5).map(
    lambda parts: "/" + "/".join(parts)
)


@st.composite
def _sources(draw: st.DrawFn) -> tuple[str, str]:
    kind = draw(st.sampled_from(["hf", "url", "file"]))
    if kind == "hf":
        file = draw(_FILE)
        revision = draw(st.one_of(st.just(""), _PART))
        model = f"hf://{draw(_PART)}/{draw(_PART)}" + (f"/{file}" if file else "")
        return (model + (f"@{revision}" if revision else ""), "")
    if kind == "file":
        return (f"file://{draw(_PATH)}", "")
    host = draw(st.from_regex(r"[a-z][a-z0-9-]{0,15}(\.[a-z]{2,6})?", fullmatch=True))
    return (f"https://{host}{draw(_PATH)}.gguf", draw(st.from_regex(r"[0-9a-f]{64}", fullmatch=True)))


@given(_sources())
@settings(max_examples=150, deadline=None)
def test_fuzz_a_source_round_trips_through_its_text(given_source: tuple[str, str]) -> None:
    """A source said as text (`str(source)`, what logs, keys and the page show) parses back to
    the same source."""
    model, sha256 = given_source
    source = parse_source(model, sha256)
    assert source is not None
    assert parse_source(str(source), sha256) == source
    assert parse_model(model, sha256).source == source


@given(
    st.one_of(
        st.text(max_size=300),
        st.tuples(
            st.sampled_from(["hf://", "https://", "http://", "file://", "HF://", "ftp://"]), st.text()
        ).map("".join),
        st.just("hf://" + "a/" * (MAX_SOURCE_CHARS // 2)),
    ),
    st.one_of(st.just(""), st.text(max_size=80), st.just(SHA)),
    st.text(max_size=20),
)
@settings(max_examples=400, deadline=None)
def test_fuzz_parsing_a_model_raises_nothing_but_its_own_error(model: str, sha256: str, profile: str) -> None:
    """Whatever `model:` and `model_sha256:` a profile gives: `parse_source` raises SourceError
    or nothing, and `parse_model` (what a profile keeps) never raises."""
    # parse_model catches SourceError only: anything else parse_source raised would fail here.
    ref = parse_model(model, sha256, profile=profile)
    if ref.error is not None:
        assert str(ref.error) == (f"profile {profile}: {ref.error.words}" if profile else ref.error.words)
    assert (ref.source is None) or (ref.error is None)
    assert ref.name == ("" if "://" in model else model)
    # Every reader of a kept parse is total too.
    ref.weights_key("/p")
    ref.staged_key()
    ref.node_file("/p")
