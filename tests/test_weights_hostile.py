"""Hubs, mirrors and names that become paths: a hub on loopback that answers hostile commits,
file names, digests, sizes, listings and redirects, links planted under the store, a revision
that names a path. Each fails the staging of that model only, not retried, naming the hub, the
field and the value, and no file appears outside the models directory. The parsers of what a
hub or an operator names are fuzzed (hypothesis, fast tier): a checked value or their own error."""

from __future__ import annotations

import hashlib
import json
import os
import re
import tracemalloc
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus
from llmgw_core.sources import (
    MAX_NAME_BYTES,
    MAX_NAME_PARTS,
    MAX_SOURCE_CHARS,
    ModelSource,
    SourceError,
    parse_source,
    path_problem,
    revision_problem,
    shown,
)
from llmgw_core.staged import hf_dir, hf_view, url_view
from llmgw_launcher.weights import (
    MAX_FILE_BYTES,
    MAX_LISTING_BYTES,
    MAX_LISTING_FILES,
    MAX_MODEL_BYTES,
    MAX_REDIRECTS,
    Weights,
    WeightsError,
    check_commit,
    parse_listing,
    parse_size,
)
from tests.hf_server import Hub, git_blob_id, hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

GGUF = bytes(range(256)) * 40  # 10 kB: an LFS file, its etag is its sha256
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'  # small: its etag is its git blob id
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BLOB = re.compile(r"(sha256-[0-9a-f]{64}|gitsha1-[0-9a-f]{40})")
# Where the fuzz tests place a store: a path is inside it or it is not, no disk needed.
ROOT = PurePosixPath("/node/models")

FUZZ = settings(max_examples=300, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture
def hub() -> object:
    with hf_hub() as h:
        h.add("org/repo", {"tiny.gguf": GGUF, "config.json": CONFIG})
        yield h


def outside(tmp_path: Path, root: Path) -> set[str]:
    """Every path under `tmp_path` but outside the models directory `root`, and every entry of
    the temp dir's parents: what a staging that escaped its root would add to."""
    seen = {str(p) for p in tmp_path.rglob("*") if not p.is_relative_to(root)}
    seen |= {str(p) for p in tmp_path.parent.iterdir()}
    # Other pytest sessions on the machine add their own `pytest-<n>` beside this one's.
    return seen | {str(p) for p in tmp_path.parent.parent.iterdir() if not p.name.startswith("pytest-")}


def store(tmp_path: Path, hub: Hub) -> Weights:
    root = tmp_path / "node" / "models"
    root.mkdir(parents=True, exist_ok=True)
    return Weights(root, environ={"HF_ENDPOINT": hub.url}, progress_interval_s=0.01, timeout_s=5)


def src(model: str, sha256: str = "") -> ModelSource:
    source = parse_source(model, sha256)
    assert source is not None
    return source


def views(root: Path) -> list[str]:
    """The files (and links) the store's views hold."""
    return sorted(
        str(p) for kind in ("hf", "url") for p in (root / kind).rglob("*") if p.is_file() or p.is_symlink()
    )


async def refused(
    tmp_path: Path, weights: Weights, source: ModelSource | str, sha256: str = ""
) -> WeightsError:
    """Stage `source`; the WeightsError it fails with, once it is proven that nothing was written
    outside the models directory and that no view was added in it."""
    source = src(source, sha256) if isinstance(source, str) else source
    before, held = outside(tmp_path, weights.root), views(weights.root)
    with pytest.raises(WeightsError) as caught:
        await weights.stage(source, lambda _words: None)
    assert outside(tmp_path, weights.root) == before
    assert views(weights.root) == held
    return caught.value


def on(hub: Hub, revision: str = "main") -> str:
    return f"weights repo: org/repo@{revision} on {hub.url.removeprefix('http://')}"


# --- hostile hub answers, through huggingface_hub and the node's own store ---------------------


@pytest.mark.anyio
@pytest.mark.parametrize("model", ["hf://org/repo/tiny.gguf", "hf://org/repo"])
async def test_a_hub_answering_a_commit_that_is_a_path_stages_nothing(
    tmp_path: Path, hub: Hub, model: str
) -> None:
    repo = hub.state.repos["org/repo"]
    # The hub serves the files at that "commit" too: unchecked, they would be fetched and
    # linked at `models/hf/org/repo/../../../../x`, outside the models directory.
    bad = "../../../../x"
    repo.commit, repo.revisions = bad, (*repo.revisions, bad)
    caught = await refused(tmp_path, store(tmp_path, hub), model)
    field = "sha" if model == "hf://org/repo" else "X-Repo-Commit"
    assert caught.reason == (
        f"{on(hub)}: the hub's {field} '../../../../x' is not a commit id (40 hex digits); "
        "nothing is staged from this answer"
    )
    assert not caught.retryable
    assert hub.state.gets == []


ABSOLUTE = "<an absolute path under the test's temp dir>"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("patch", "field", "problem"),
    [
        ({"rfilename": "../../x"}, "rfilename", "has a '..' part"),
        ({"rfilename": "../../../../../x"}, "rfilename", "has a '..' part"),
        ({"rfilename": ABSOLUTE}, "rfilename", "is an absolute path"),
        ({"rfilename": "a\\..\\..\\x"}, "rfilename", "has a backslash"),
        ({"rfilename": "x\x00.gguf"}, "rfilename", "has a NUL, a control character or a lone surrogate"),
        ({"rfilename": "/".join(["d"] * 40)}, "rfilename", "has more than 32 parts"),
        ({"rfilename": "d/" + "x" * 300}, "rfilename", "has a part longer than 255 bytes"),
        (
            {"lfs": {"sha256": "../../../x", "size": 1}},
            "lfs.sha256",
            "is not a sha256 or a git blob id (64 or 40 hex digits)",
        ),
        ({"lfs": None, "blobId": "../x"}, "blobId", "is not a sha256 or a git blob id (64 or 40 hex digits)"),
        ({"size": -1}, "size", "is not a size in bytes (0 to 4.4 TB)"),
        ({"size": MAX_FILE_BYTES + 1}, "size", "is not a size in bytes (0 to 4.4 TB)"),
    ],
)
async def test_a_listing_naming_a_hostile_file_stages_nothing_of_the_repository(
    tmp_path: Path, hub: Hub, patch: dict[str, Any], field: str, problem: str
) -> None:
    index = 1  # the hub lists its files sorted: config.json, then tiny.gguf
    if field == "rfilename":
        # A file the hub holds and serves under that name, with its true size and digest: only
        # the name is hostile (an absolute one reaches the hub whole, `resolve/<commit>//tmp/…`).
        name = str(tmp_path / "abs" / "x") if patch["rfilename"] == ABSOLUTE else patch["rfilename"]
        hub.add("org/repo", {"config.json": CONFIG, name: GGUF})
        patch, index = {"rfilename": name}, sorted(["config.json", name]).index(name)
    else:
        hub.state.sibling_patch["tiny.gguf"] = patch
    caught = await refused(tmp_path, store(tmp_path, hub), "hf://org/repo")
    value = patch["lfs"]["sha256"] if field == "lfs.sha256" else patch[field]
    assert caught.reason == (
        f"{on(hub)}: the hub's siblings[{index}].{field} {shown(value)} {problem}; "
        "nothing is staged from this answer"
    )
    assert not caught.retryable
    assert hub.state.gets == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("headers", "words"),
    [
        ({"X-Linked-Size": "-5"}, "the hub's X-Linked-Size -5 is not a size in bytes (0 to 4.4 TB)"),
        (
            {"X-Linked-Size": str(MAX_FILE_BYTES + 1)},
            f"the hub's X-Linked-Size {MAX_FILE_BYTES + 1} is not a size in bytes (0 to 4.4 TB)",
        ),
        (
            {"ETag": '"../../x"'},
            "the hub's ETag '../../x' is not a sha256 or a git blob id (64 or 40 hex digits)",
        ),
        (
            {"X-Linked-Etag": '"' + "a" * 63 + '"'},
            f"the hub's ETag '{'a' * 63}' is not a sha256 or a git blob id (64 or 40 hex digits)",
        ),
    ],
)
async def test_a_files_headers_that_are_no_size_or_digest_stage_nothing(
    tmp_path: Path, hub: Hub, headers: dict[str, str], words: str
) -> None:
    hub.state.headers.update(headers)
    caught = await refused(tmp_path, store(tmp_path, hub), "hf://org/repo/tiny.gguf")
    assert caught.reason == f"{on(hub)}: {words}; nothing is staged from this answer"
    assert not caught.retryable
    assert hub.state.gets == []


@pytest.mark.anyio
async def test_a_listing_too_long_or_too_big_or_at_odds_with_itself_stages_nothing(
    tmp_path: Path, hub: Hub
) -> None:
    weights = store(tmp_path, hub)
    entry = {"rfilename": "config.json", "size": len(CONFIG), "blobId": git_blob_id(CONFIG)}
    hub.state.extra_siblings = [entry]
    caught = await refused(tmp_path, weights, "hf://org/repo")
    assert (
        caught.reason
        == f"{on(hub)}: the hub's file 'config.json' is listed twice; nothing is staged from this answer"
    )

    hub.add("org/clash", {"a": CONFIG, "a/b": CONFIG})
    hub.state.extra_siblings = []
    caught = await refused(tmp_path, weights, "hf://org/clash")
    assert caught.reason == (
        f"weights clash: org/clash@main on {hub.url.removeprefix('http://')}: the hub's file 'a/b' is "
        "inside 'a', which is a file too; nothing is staged from this answer"
    )

    hub.state.extra_siblings = [{**entry, "rfilename": f"f{i}"} for i in range(MAX_LISTING_FILES)]
    caught = await refused(tmp_path, weights, "hf://org/repo")
    assert caught.reason == (
        f"{on(hub)}: the hub's file listing names {MAX_LISTING_FILES + 2} files, more than the "
        f"{MAX_LISTING_FILES} a repository may have here; nothing is staged from this answer"
    )

    big = MAX_FILE_BYTES
    hub.state.extra_siblings = [{**entry, "rfilename": f"f{i}", "size": big} for i in range(17)]
    caught = await refused(tmp_path, weights, "hf://org/repo")
    assert caught.reason == (
        f"{on(hub)}: the hub's file listing states 74.8 TB in all, more than the 70.4 TB one repository "
        "may hold here; nothing is staged from this answer"
    )

    # Read to its limit, never whole: the hub streams more than that.
    hub.state.extra_siblings = []
    hub.state.listing_padding = MAX_LISTING_BYTES + 1
    caught = await refused(tmp_path, weights, "hf://org/repo")
    assert (
        caught.reason
        == f"{on(hub)}: the hub's file listing is over 33.6 MB; nothing is staged from this answer"
    )
    assert not caught.retryable
    assert hub.state.gets == []


@pytest.mark.anyio
@pytest.mark.parametrize("link", ["elsewhere", "loop"])
async def test_a_link_planted_under_the_store_is_not_followed_out_of_it(
    tmp_path: Path, hub: Hub, link: str
) -> None:
    weights = store(tmp_path, hub)
    planted = weights.root / "hf" / "org"
    planted.parent.mkdir(parents=True)
    if link == "elsewhere":
        (tmp_path / "elsewhere").mkdir()
        planted.symlink_to(tmp_path / "elsewhere")
    else:
        planted.symlink_to(planted)
    caught = await refused(tmp_path, weights, "hf://org/repo/tiny.gguf")
    commit = hub.state.repos["org/repo"].commit
    view = weights.root / "hf" / "org" / "repo" / commit / "files" / "tiny.gguf"
    if link == "elsewhere":
        real = tmp_path / "elsewhere" / "repo" / commit / "files" / "tiny.gguf"
        assert caught.reason == (
            f"weights repo@{commit[:6]}: {shown(str(view))} leads outside {weights.root} "
            f"(to {shown(str(real))}); nothing is written there"
        )
        assert list((tmp_path / "elsewhere").iterdir()) == []
    else:
        assert caught.reason.startswith(f"weights repo@{commit[:6]}: cannot resolve {shown(str(view))}: ")
    assert not caught.retryable
    assert hub.state.gets == []


@pytest.mark.anyio
async def test_a_revision_that_names_a_path_is_refused_even_past_the_parser(tmp_path: Path, hub: Hub) -> None:
    with pytest.raises(SourceError) as parsed:
        parse_source("hf://org/repo/tiny.gguf@../../x", profile="p")
    assert str(parsed.value) == (
        "profile p: model 'hf://org/repo/tiny.gguf@../../x': the revision '../../x' is not valid: "
        "it has a '..' part"
    )
    # A source made without the parser (as a future caller might): the hub answers the revision,
    # and the branch's ref would be written at `models/hf/org/repo/refs/../../../../../x`.
    bad = "../../../../../x"
    repo = hub.state.repos["org/repo"]
    repo.revisions = (*repo.revisions, bad)
    weights = store(tmp_path, hub)
    source = ModelSource(kind="hf", repo="org/repo", file="tiny.gguf", revision=bad)
    caught = await refused(tmp_path, weights, source)
    ref = hf_dir(weights.root, source) / "refs" / bad
    assert caught.reason == (
        f"weights repo@{repo.commit[:6]}: {shown(str(ref))} leads outside {weights.root} "
        f"(to {shown(str(ref.resolve()))}); nothing is written there"
    )
    assert not caught.retryable


@pytest.mark.anyio
async def test_redirects_are_checked_and_bounded(tmp_path: Path, hub: Hub) -> None:
    weights = store(tmp_path, hub)
    sha = hashlib.sha256(GGUF).hexdigest()
    url = hub.add_plain("x.gguf", GGUF)
    # A redirect that stays an http(s) URL is followed (the hub sends its files from a CDN).
    hub.state.redirects["/files/moved.gguf"] = "/files/x.gguf"
    path = await weights.stage(src(f"{hub.url}/files/moved.gguf", sha), lambda _words: None)
    assert path.read_bytes() == GGUF

    hub.state.redirects["/files/local.gguf"] = "file:///etc/passwd"
    caught = await refused(tmp_path, weights, f"{hub.url}/files/local.gguf", sha)
    host = hub.url.removeprefix("http://")
    assert caught.reason == (
        f"weights local.gguf@{sha[:6]}: {hub.url}/files/local.gguf: a redirect to "
        f"'file://{host.split(':')[0]}/etc/passwd' is not an http:// or https:// URL; not followed"
    )
    assert not caught.retryable

    hub.state.redirects["/files/loop.gguf"] = "/files/loop.gguf"
    caught = await refused(tmp_path, weights, f"{hub.url}/files/loop.gguf", sha)
    assert caught.reason == (
        f"weights loop.gguf@{sha[:6]}: {hub.url}/files/loop.gguf: more than {MAX_REDIRECTS} redirects; "
        "not followed further"
    )
    assert not caught.retryable
    assert hub.state.redirected.count("/files/loop.gguf") == MAX_REDIRECTS + 1

    # More than any file may be (httpx itself refuses what is not digits).
    hub.state.plain_headers["Content-Length"] = str(MAX_FILE_BYTES + 1)
    caught = await refused(tmp_path, weights, url, "0" * 64)
    assert caught.reason == (
        f"weights x.gguf@000000: {url}: the server's Content-Length {shown(str(MAX_FILE_BYTES + 1))} "
        "is not a size in bytes (0 to 4.4 TB); nothing is staged from it"
    )
    assert not caught.retryable


@pytest.mark.anyio
async def test_a_hostile_answer_costs_that_model_only(tmp_path: Path, hub: Hub) -> None:
    hub.add("org/evil", {"tiny.gguf": GGUF})
    hub.state.repos["org/evil"].commit = "../../../../x"
    weights = store(tmp_path, hub)
    await refused(tmp_path, weights, "hf://org/evil/tiny.gguf")
    path = await weights.stage(src("hf://org/repo"), lambda _words: None)
    assert (path / "tiny.gguf").read_bytes() == GGUF
    assert path.is_relative_to(weights.root)


@pytest.mark.anyio
async def test_a_shard_whose_hub_answers_a_path_fails_once_and_the_others_run(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    evil = hub.add("org/evil", {"tiny.gguf": GGUF})
    evil.commit, evil.revisions = "../../../../x", (*evil.revisions, "../../../../x")
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    models = tmp_path / "agent" / "models"
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(
            bus.names.shards_bucket,
            "node-a.w1",
            shard("node-a", "w1", sim_profile(model="hf://org/repo/tiny.gguf")),
        )
        await bus.put(
            bus.names.shards_bucket,
            "node-a.w2",
            shard("node-a", "w2", sim_profile(model="hf://org/evil/tiny.gguf")),
        )
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=30)

        def failed_once() -> ShardStatus | None:
            last = events.last("w2")
            return last if last is not None and last.state == "failed" else None

        failed = await eventually(failed_once, timeout=30)
        assert failed is not None
        assert failed.reason == (
            f"weights evil: org/evil@main on {hub.url.removeprefix('http://')}: the hub's X-Repo-Commit "
            "'../../../../x' is not a commit id (40 hex digits); nothing is staged from this answer"
        )
        assert not failed.retryable
        assert "starting" not in events.states("w2")
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("tiny.gguf")] == [
        f"agent/models/hf/org/repo/{hub.state.repos['org/repo'].commit}/files/tiny.gguf"
    ]
    assert not (models.parent / "x").exists()


# --- the parsers, fuzzed: a checked value or their own error, never a path outside the root ------


def _inside(path: PurePosixPath, root: PurePosixPath = ROOT) -> bool:
    return PurePosixPath(os.path.normpath(path)).is_relative_to(root)


NAME_CHARS = st.sampled_from(
    ["a", "b", ".", "..", "/", "\\", "\x00", "\n", " ", "@", ":", "é", "\ud800", "%2e"]
)
NAMES = st.one_of(
    st.text(max_size=80),
    st.lists(NAME_CHARS, max_size=24).map("".join),
    st.lists(st.sampled_from(["a", ".", "..", "", "x" * 256]), max_size=40).map("/".join),
)


def _check_name(name: str) -> None:
    """What `path_problem` lets through is a plain relative path that stays under any root."""
    assert not name.startswith("/")
    parts = name.split("/")
    assert len(parts) <= MAX_NAME_PARTS
    assert len(name.encode()) <= MAX_NAME_BYTES
    assert all(p not in ("", ".", "..") for p in parts)
    assert "\\" not in name
    assert "\x00" not in name
    assert _inside(ROOT / "snapshot" / name, ROOT / "snapshot")


@FUZZ
@given(NAMES)
def test_path_and_revision_checks_let_through_only_plain_relative_paths(name: str) -> None:
    if path_problem(name) is None:
        _check_name(name)
    if revision_problem(name) is None:
        _check_name(name)
        assert not any(c.isspace() for c in name)


@FUZZ
@given(
    st.one_of(
        st.text(max_size=200),
        st.tuples(
            st.sampled_from(["hf://", "HF://", "https://", "http://", "file://", "s3://"]), NAMES, NAMES
        ).map(lambda t: f"{t[0]}{t[1]}@{t[2]}"),
        st.tuples(NAMES, NAMES).map(lambda t: f"hf://org/repo/{t[0]}@{t[1]}"),
        st.tuples(NAMES).map(lambda t: f"https://h[{t[0]}/x.gguf"),
        st.just("hf://org/repo/" + "x/" * 3000),
    ),
    st.one_of(st.just(""), st.just("a" * 64), st.text(max_size=70)),
)
def test_parse_source_gives_a_checked_source_or_its_own_error(model: str, sha256: str) -> None:
    try:
        source = parse_source(model, sha256)
    except SourceError:
        return
    if source is None:
        assert "://" not in model.strip()
        return
    root = Path(str(ROOT))
    if source.kind == "hf":
        if source.file:
            assert path_problem(source.file) is None
        assert revision_problem(source.revision) is None
        for path in (hf_view(root, source, COMMIT), hf_dir(root, source) / "refs" / source.revision):
            assert _inside(PurePosixPath(path)), path
    elif source.kind == "url":
        assert _inside(PurePosixPath(url_view(root, source)), ROOT / "url" / source.sha256)
        assert len(source.url) <= MAX_SOURCE_CHARS
    else:
        assert source.path.startswith("/")


def _entry(name: Any, size: Any, blob: Any, lfs: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"rfilename": name, "size": size, "blobId": blob}
    if lfs is not ...:
        entry["lfs"] = lfs
    return entry


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
DIGESTS = st.one_of(
    st.just("a" * 40), st.just("b" * 64), st.just("A" * 64), st.text(max_size=70), st.just("../" * 20), JSON
)
SIBLINGS = st.builds(
    _entry,
    st.one_of(NAMES, JSON),
    st.one_of(st.integers(-5, 2**63), st.integers(0, 100), JSON),
    DIGESTS,
    st.one_of(st.just(...), st.none(), st.builds(lambda s: {"sha256": s, "size": 1}, DIGESTS), JSON),
)
# Mostly well-formed: the checks must let the good ones through, not only refuse.
PLAIN_SIBLINGS = st.builds(
    _entry,
    st.lists(st.sampled_from(["a", "b", "c.gguf", "d", "é"]), min_size=1, max_size=3).map("/".join),
    st.integers(0, 100),
    st.sampled_from(["a" * 40, "b" * 64]),
    st.sampled_from([..., None, {"sha256": "d" * 64, "size": 1}]),
)
LISTINGS = st.builds(
    lambda sha, siblings, extra: json.dumps({"sha": sha, "siblings": siblings, **extra}).encode(),
    st.one_of(st.just(COMMIT), st.just(COMMIT), st.just(COMMIT.upper()), st.just("../../x"), JSON),
    st.one_of(st.lists(PLAIN_SIBLINGS, min_size=1, max_size=6), st.lists(SIBLINGS, max_size=6), JSON),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
)


def _check_listing(body: bytes) -> None:
    try:
        commit, files = parse_listing(body, "w")
    except WeightsError as exc:
        error: WeightsError | None = exc
    else:
        error = None
    if error is not None:
        assert not error.retryable or error.reason.startswith("w: the hub named no commit")
        assert len(error.reason) < 1000
        return
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    assert 0 < len(files) <= MAX_LISTING_FILES
    names = {f.name for f in files}
    assert len(names) == len(files)
    assert sum(f.size for f in files) <= MAX_MODEL_BYTES
    for f in files:
        _check_name(f.name)
        assert 0 <= f.size <= MAX_FILE_BYTES
        assert BLOB.fullmatch(f"{f.algo}-{f.digest}")
        assert not any("/".join(f.name.split("/")[:i]) in names for i in range(1, f.name.count("/") + 1))


@FUZZ
@given(st.one_of(st.binary(max_size=400), JSON.map(lambda v: json.dumps(v).encode()), LISTINGS))
def test_parse_listing_gives_checked_files_or_its_own_error(body: bytes) -> None:
    _check_listing(body)


@FUZZ
@given(st.one_of(JSON, NAMES, st.just(COMMIT), st.just(COMMIT.upper())))
def test_a_stated_commit_is_forty_hex_digits_or_refused(value: Any) -> None:
    try:
        commit = check_commit(value, "w", "sha")
    except WeightsError as exc:
        error: WeightsError | None = exc
    else:
        error = None
    if error is not None:
        assert not error.retryable
        assert error.reason.startswith("w: the hub's sha ")
        return
    assert re.fullmatch(r"[0-9a-f]{40}", commit)


@FUZZ
@given(st.one_of(st.text(max_size=30), st.integers(-(10**30), 10**30).map(str)))
def test_a_stated_size_is_plain_bounded_digits_or_none(value: str) -> None:
    size = parse_size(value)
    assert size is None or (0 <= size <= MAX_FILE_BYTES and value.strip().isascii())


def test_sizes_python_would_take_are_refused() -> None:
    assert [parse_size(v) for v in ("12", " 12 ", "-5", "1_000", "٣", "+3", "", str(MAX_FILE_BYTES + 1))] == [
        12,
        12,
        None,
        None,
        None,
        None,
        None,
        None,
    ]


def test_the_largest_listing_allowed_is_parsed_in_bounded_memory() -> None:
    entry = {"size": 1, "blobId": "a" * 40, "lfs": None}
    body = json.dumps(
        {"sha": COMMIT, "siblings": [{**entry, "rfilename": f"d/f{i}"} for i in range(MAX_LISTING_FILES)]}
    )
    tracemalloc.start()
    try:
        _commit, files = parse_listing(body.encode(), "w")
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(files) == MAX_LISTING_FILES
    assert peak < 30 * len(body), (peak, len(body))
    # Past the bounds, refused before any of it is decoded.
    with pytest.raises(WeightsError, match=r"is over 33\.6 MB"):
        parse_listing(b" " * (MAX_LISTING_BYTES + 1), "w")
    with pytest.raises(WeightsError, match="maximum recursion depth"):
        parse_listing(
            b'{"sha": "' + COMMIT.encode() + b'", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "w"
        )
