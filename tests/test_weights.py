"""Weights staged by the node: a profile's `model` source parsed, then fetched with the real
huggingface_hub client from a Hugging Face-shaped hub on loopback, verified, committed by rename."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import anyio
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import ModelSource, Profile, SourceError, parse_source, validate_profile
from llmgw_core.events import ShardStatus
from llmgw_launcher.weights import Progress, Weights, WeightsError
from tests.hf_server import Hub, hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

GGUF = bytes(range(256)) * 40  # 10 kB: an LFS file, its etag is its sha256
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'  # small: its etag is its git blob id


@pytest.fixture
def hub() -> object:
    with hf_hub() as h:
        h.add("org/repo", {"tiny.gguf": GGUF, "config.json": CONFIG})
        yield h


def store(root: Path, hub: Hub, **kw: object) -> Weights:
    environ = {"HF_ENDPOINT": hub.url, **kw.pop("environ", {})}  # type: ignore[dict-item]
    return Weights(root / "models", environ=environ, progress_interval_s=0.01, **kw)  # type: ignore[arg-type]


def src(model: str, sha256: str = "") -> ModelSource:
    source = parse_source(model, sha256)
    assert source is not None
    return source


async def stage(
    weights: Weights, model: str, sha256: str = "", said: list[str] | None = None
) -> tuple[Path, list[str]]:
    said = [] if said is None else said
    path = await weights.stage(src(model, sha256), said.append)
    return path, said


def leftovers(root: Path) -> list[str]:
    """Anything half-written the store holds."""
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name.endswith((".partial", ".tmp")) or (".staging" in p.parts and p.is_file())
    )


# --- the source on the profile --------------------------------------------------------------


def test_sources_parse_into_what_the_node_stages() -> None:
    assert parse_source("tiny-chat") is None
    assert src("hf://Qwen/Qwen2-7B-GGUF/q4/model.gguf@v1.0") == ModelSource(
        kind="hf", repo="Qwen/Qwen2-7B-GGUF", file="q4/model.gguf", revision="v1.0"
    )
    assert src("hf://org/repo") == ModelSource(kind="hf", repo="org/repo", revision="main")
    sha = "a" * 64
    assert src("https://example.org/m/x.gguf", sha.upper()) == ModelSource(
        kind="url", url="https://example.org/m/x.gguf", sha256=sha
    )
    assert src("file:///models/x.gguf") == ModelSource(kind="file", path="/models/x.gguf")


@pytest.mark.parametrize(
    ("model", "sha256", "words"),
    [
        (
            "s3://bucket/x.gguf",
            "",
            "profile p: model 's3://bucket/x.gguf' has an unknown scheme 's3://'; use "
            "hf://<org>/<repo>[/<file>][@<revision>], https://… with model_sha256, or file:///path",
        ),
        (
            "hf://justrepo",
            "",
            "profile p: model 'hf://justrepo' must name a repository: hf://<org>/<repo>[/<file>]",
        ),
        ("hf://org/repo@", "", "profile p: model 'hf://org/repo@': the revision after '@' is empty"),
        (
            "hf://org/repo/../etc/passwd",
            "",
            "profile p: model 'hf://org/repo/../etc/passwd': the file '../etc/passwd' is not a plain path "
            "inside the repository: it has a '..' part",
        ),
        (
            "hf://org/repo@../../x",
            "",
            "profile p: model 'hf://org/repo@../../x': the revision '../../x' is not valid: "
            "it has a '..' part",
        ),
        (
            "hf://org/repo/a\\b.gguf",
            "",
            "profile p: model 'hf://org/repo/a\\\\b.gguf': the file 'a\\\\b.gguf' is not a plain path "
            "inside the repository: it has a backslash",
        ),
        (
            "hf://org/repo/x.gguf\0",
            "",
            "profile p: model 'hf://org/repo/x.gguf\\x00' has a NUL, a control character or a lone surrogate",
        ),
        (
            "https://example.org/m/..",
            "a" * 64,
            "profile p: model 'https://example.org/m/..': the file name '..' has a '..' part",
        ),
        (
            "https://example.org/x.gguf",
            "",
            "profile p: model 'https://example.org/x.gguf' needs model_sha256 (the file's sha256, 64 hex "
            "digits): a URL's bytes are verified before an engine reads them",
        ),
        ("https://example.org/x.gguf", "abc", "profile p: model_sha256 'abc' is not 64 hex digits"),
        (
            "file://models/x.gguf",
            "",
            "profile p: model 'file://models/x.gguf': a file:// model is on the node itself; write "
            "file:///path (three slashes), not a host 'models'",
        ),
        ("tiny", "a" * 64, "profile p: model_sha256 is set but model 'tiny' is not an https:// URL"),
    ],
)
def test_a_bad_source_is_refused_naming_the_field(model: str, sha256: str, words: str) -> None:
    with pytest.raises(SourceError) as caught:
        parse_source(model, sha256, profile="p")
    assert str(caught.value) == words
    profile = Profile(name="p", engine="llamacpp", model=model, model_sha256=sha256)
    assert words in validate_profile(profile, [], requires_gpus=False)


def test_a_profile_needs_a_model_path_or_a_source() -> None:
    assert validate_profile(Profile(name="p", engine="llamacpp"), [], requires_gpus=False) == [
        "profile p: model_path is empty; set it to the weights' path, or set model to "
        "hf://<org>/<repo>[/<file>], https://… (with model_sha256) or file:///path"
    ]
    sourced = Profile(name="p", engine="llamacpp", model="hf://org/repo/x.gguf")
    assert validate_profile(sourced, [], requires_gpus=False) == []
    # A source is not what clients ask for: the profile's name is served instead.
    assert sourced.served_name == "p"
    # A profile that uses none of the later fields keeps the digest it had before they existed.
    old = Profile(name="p", engine="llamacpp", model_path="/m/x.gguf")
    encoded = msgspec.to_builtins(old)
    for late in ("model_sha256", "adapters", "kv_events", "max_loras", "max_lora_rank"):
        del encoded[late]
    assert old.fingerprint() == hashlib.sha256(msgspec.json.encode(encoded, order="sorted")).hexdigest()[:16]


def test_progress_reads_in_the_nodes_words() -> None:
    progress = Progress(
        label="qwen-7b@a1b2c3",
        phase="downloading",
        file="model-00002-of-00004.safetensors",
        done=5_100_000_000,
        total=13_400_000_000,
    )
    assert progress.words() == (
        "weights qwen-7b@a1b2c3: downloading model-00002-of-00004.safetensors (38%, 5.1 of 13.4 GB)"
    )


# --- staging from the hub ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_hub_file_is_staged_verified_and_reported(tmp_path: Path, hub: Hub) -> None:
    commit = hub.state.repos["org/repo"].commit
    path, said = await stage(store(tmp_path, hub), "hf://org/repo/tiny.gguf")
    assert path == tmp_path / "models" / "hf" / "org" / "repo" / commit / "files" / "tiny.gguf"
    assert path.read_bytes() == GGUF
    assert said[0] == "weights repo: resolving"
    assert hub.state.served["tiny.gguf"] == len(GGUF)
    assert leftovers(tmp_path) == []
    # Staged once: the next shard that wants it asks the hub only what "main" is now.
    again, _ = await stage(store(tmp_path, hub), "hf://org/repo/tiny.gguf")
    assert again == path
    assert hub.state.served["tiny.gguf"] == len(GGUF)


@pytest.mark.anyio
async def test_what_a_launcher_left_mid_commit_is_swept_and_partials_resumed(
    tmp_path: Path, hub: Hub
) -> None:
    commit = hub.state.repos["org/repo"].commit
    root = tmp_path / "models"
    half = root / ".staging" / "0123" / "config.json"
    half.parent.mkdir(parents=True)
    half.write_bytes(b"{")
    link = root / "hf" / "org" / "repo" / commit / "files" / ".tiny.gguf.0123.tmp"
    link.parent.mkdir(parents=True)
    link.write_bytes(GGUF[:10])
    partial = root / "blobs" / f"sha256-{hashlib.sha256(GGUF).hexdigest()}.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(GGUF[:6000])
    path, _ = await stage(store(tmp_path, hub), "hf://org/repo/tiny.gguf")
    assert path.read_bytes() == GGUF
    assert hub.state.gets == [("tiny.gguf", "bytes=6000-")]
    assert leftovers(tmp_path) == []
    assert not (root / ".staging").exists()


@pytest.mark.anyio
async def test_a_whole_snapshot_is_staged_each_file_verified(tmp_path: Path, hub: Hub) -> None:
    path, _ = await stage(store(tmp_path, hub), "hf://org/repo")
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "tiny.gguf"]
    assert (path / "config.json").read_bytes() == CONFIG
    assert (path / "tiny.gguf").read_bytes() == GGUF
    blobs = sorted(p.name.split("-")[0] for p in (tmp_path / "models" / "blobs").iterdir())
    assert blobs == ["gitsha1", "sha256"]


@pytest.mark.anyio
async def test_shards_that_want_one_model_share_one_download(tmp_path: Path, hub: Hub) -> None:
    weights = store(tmp_path, hub)
    paths: list[Path] = []

    async def one() -> None:
        paths.append((await stage(weights, "hf://org/repo/tiny.gguf"))[0])

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    assert len(set(paths)) == 1
    assert hub.state.served["tiny.gguf"] == len(GGUF)
    assert [g for g, _ in hub.state.gets] == ["tiny.gguf"]


@pytest.mark.anyio
async def test_a_download_cut_off_midway_resumes_where_it_broke(tmp_path: Path, hub: Hub) -> None:
    hub.state.cut_once["tiny.gguf"] = 4000
    weights = store(tmp_path, hub)
    with pytest.raises(WeightsError) as caught:
        await stage(weights, "hf://org/repo/tiny.gguf")
    commit = hub.state.repos["org/repo"].commit
    assert caught.value.retryable
    assert caught.value.reason.startswith(f"weights repo@{commit[:6]}: tiny.gguf: the download ")
    assert "the next attempt resumes from there" in caught.value.reason
    assert not list((tmp_path / "models" / "hf").rglob("tiny.gguf")), "a half file was staged"
    path, _ = await stage(weights, "hf://org/repo/tiny.gguf")
    assert path.read_bytes() == GGUF
    assert hub.state.gets == [("tiny.gguf", ""), ("tiny.gguf", "bytes=4000-")]
    assert hub.state.served["tiny.gguf"] == len(GGUF)
    assert leftovers(tmp_path) == []


@pytest.mark.anyio
async def test_an_attempt_after_a_stall_says_how_far_the_last_one_got_while_it_resolves(
    tmp_path: Path, hub: Hub
) -> None:
    hub.state.cut_once["tiny.gguf"] = 4000
    weights = store(tmp_path, hub, timeout_s=0.5)
    with pytest.raises(WeightsError):
        await stage(weights, "hf://org/repo/tiny.gguf")
    # The next attempt waits on the hub's metadata: its shards hear how far the last one got.
    hub.state.hang_metadata = True
    said: list[str] = []
    with anyio.fail_after(30), pytest.raises(WeightsError):
        await stage(weights, "hf://org/repo/tiny.gguf", said=said)
    commit = hub.state.repos["org/repo"].commit
    assert said[-1] == (
        f"weights repo@{commit[:6]}: resolving again "
        "(tiny.gguf: 39%, 4.0 of 10.2 kB here, resumed from there)"
    )
    assert all("39%" in words for words in said), said


@pytest.mark.anyio
async def test_a_sha256_mismatch_is_discarded_never_staged(tmp_path: Path, hub: Hub) -> None:
    hub.state.wrong_sha.add("tiny.gguf")
    with pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub), "hf://org/repo/tiny.gguf")
    commit = hub.state.repos["org/repo"].commit
    stated = hashlib.sha256(b"not these bytes").hexdigest()
    assert caught.value.reason == (
        f"weights repo@{commit[:6]}: tiny.gguf: sha256 mismatch: expected {stated}, "
        f"got {hashlib.sha256(GGUF).hexdigest()}; the download is discarded"
    )
    assert caught.value.retryable
    assert not (tmp_path / "models" / "hf").exists()
    assert sorted(os.listdir(tmp_path / "models" / "blobs")) == []


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("model", "words"),
    [
        (
            "hf://org/nope/tiny.gguf",
            "weights nope: org/nope@main on {url}: repository org/nope not found (HTTP 404); "
            "if it is private, "
            "set HF_TOKEN to a token that can read it",
        ),
        (
            "hf://org/repo/tiny.gguf@v9",
            "weights repo: org/repo@v9 on {url}: revision v9 not found in org/repo; "
            "name a branch, tag or commit it has",
        ),
        (
            "hf://org/repo/missing.gguf",
            "weights repo: org/repo@main on {url}: file missing.gguf not found in org/repo",
        ),
        (
            "hf://org/private/tiny.gguf",
            "weights private: org/private@main on {url}: repository org/private not found (HTTP 401); "
            "if it is private, "
            "set HF_TOKEN to a token that can read it",
        ),
    ],
)
async def test_what_retrying_cannot_fix_fails_once_in_the_nodes_words(
    tmp_path: Path, hub: Hub, model: str, words: str
) -> None:
    hub.add("org/private", {"tiny.gguf": GGUF}, token="hf_right")
    with pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub), model)
    assert caught.value.reason == words.format(url=hub.url.removeprefix("http://"))
    assert not caught.value.retryable
    assert hub.state.gets == []


@pytest.mark.anyio
async def test_hf_token_reads_a_private_repository(tmp_path: Path, hub: Hub) -> None:
    hub.add("org/private", {"tiny.gguf": GGUF}, token="hf_right")
    path, _ = await stage(
        store(tmp_path, hub, environ={"HF_TOKEN": "hf_right"}), "hf://org/private/tiny.gguf"
    )
    assert path.read_bytes() == GGUF


@pytest.mark.anyio
async def test_a_full_disk_is_refused_before_the_first_byte(tmp_path: Path, hub: Hub) -> None:
    with pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub, free=lambda _p: 9000), "hf://org/repo/tiny.gguf")
    commit = hub.state.repos["org/repo"].commit
    assert caught.value.reason == (
        f"weights repo@{commit[:6]}: needs 10.2 kB, 9.0 kB free on {tmp_path / 'models'}; "
        "free space there (or stage the model elsewhere and use file://)"
    )
    assert caught.value.retryable
    assert hub.state.gets == []
    with pytest.raises(WeightsError) as budget:
        await stage(store(tmp_path, hub, budget_bytes=5000), "hf://org/repo/tiny.gguf")
    assert budget.value.reason == (
        f"weights repo@{commit[:6]}: needs 10.2 kB, 5.0 kB left of the node's 5.0 kB for weights on "
        f"{tmp_path / 'models'}; raise models_budget_bytes or remove staged models"
    )
    assert hub.state.gets == []


@pytest.mark.anyio
async def test_a_hub_that_hangs_costs_one_bounded_attempt(tmp_path: Path, hub: Hub) -> None:
    hub.state.hang = True
    said: list[str] = []
    with anyio.fail_after(30), pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub, timeout_s=0.5), "hf://org/repo/tiny.gguf", said=said)
    commit = hub.state.repos["org/repo"].commit
    assert caught.value.reason == (
        f"weights repo@{commit[:6]}: tiny.gguf: no data from {hub.url.removeprefix('http://')} for 0.5 s "
        "at 0.0 of 10.2 kB; the next attempt resumes from there"
    )
    assert caught.value.retryable
    # While it waited, the shards that want it were told what it waits for.
    assert said[0] == "weights repo: resolving"
    assert f"weights repo@{commit[:6]}: downloading tiny.gguf (0%, 0.0 of 10.2 kB)" in said
    assert leftovers(tmp_path) in ([], [f"models/blobs/sha256-{hashlib.sha256(GGUF).hexdigest()}.partial"])


@pytest.mark.anyio
@pytest.mark.parametrize("model", ["hf://org/repo/tiny.gguf", "hf://org/repo"])
async def test_a_hub_that_does_not_answer_its_metadata_costs_one_bounded_attempt(
    tmp_path: Path, hub: Hub, model: str
) -> None:
    hub.state.hang_metadata = True
    with anyio.fail_after(30), pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub, timeout_s=0.5), model)
    host = hub.url.removeprefix("http://")
    assert caught.value.reason == f"weights repo: org/repo@main on {host}: no answer within 0.5 s"
    assert caught.value.retryable


@pytest.mark.anyio
async def test_a_staged_model_is_used_when_the_hub_is_away(tmp_path: Path) -> None:
    with hf_hub() as h:
        h.add("org/repo", {"tiny.gguf": GGUF})
        commit = h.state.repos["org/repo"].commit
        weights = store(tmp_path, h, timeout_s=2)
        path, _ = await stage(weights, "hf://org/repo/tiny.gguf")
    # The hub is gone: a commit names the same bytes forever, and "main" is what was staged last.
    assert (await stage(weights, f"hf://org/repo/tiny.gguf@{commit}"))[0] == path
    assert (await stage(weights, "hf://org/repo/tiny.gguf"))[0] == path


@pytest.mark.anyio
async def test_a_url_is_staged_against_its_model_sha256(tmp_path: Path, hub: Hub) -> None:
    url = hub.add_plain("x.gguf", GGUF)
    good = hashlib.sha256(GGUF).hexdigest()
    path, _ = await stage(store(tmp_path, hub), url, good)
    assert path == tmp_path / "models" / "url" / good / "x.gguf"
    assert path.read_bytes() == GGUF
    bad = "0" * 64
    with pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub), url, bad)
    assert caught.value.reason == (
        f"weights x.gguf@000000: x.gguf: sha256 mismatch: expected {bad}, got {good}; "
        "the download is discarded"
    )
    with pytest.raises(WeightsError) as missing:
        await stage(store(tmp_path, hub), f"{hub.url}/files/none.gguf", good)
    assert (
        missing.value.reason
        == f"weights none.gguf@{good[:6]}: {hub.url}/files/none.gguf: HTTP 404, not found"
    )
    assert not missing.value.retryable


@pytest.mark.anyio
async def test_a_file_model_that_is_not_there_fails_once(tmp_path: Path, hub: Hub) -> None:
    with pytest.raises(WeightsError) as caught:
        await stage(store(tmp_path, hub), f"file://{tmp_path}/x.gguf")
    assert caught.value.reason == f"model file not found: {tmp_path}/x.gguf"
    assert not caught.value.retryable
    (tmp_path / "x.gguf").write_bytes(GGUF)
    assert (await stage(store(tmp_path, hub), f"file://{tmp_path}/x.gguf"))[0] == tmp_path / "x.gguf"


# --- through the launcher -------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_launcher_stages_before_the_engine_and_a_bad_source_costs_one_shard(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    commit = hub.state.repos["org/repo"].commit
    good = sim_profile(model="hf://org/repo/tiny.gguf")
    bad = sim_profile(model="hf://org/repo/missing.gguf")
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.w1", shard("node-a", "w1", good))
        await bus.put(bus.names.shards_bucket, "node-a.w2", shard("node-a", "w2", bad))
        await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=30)
        failed = await eventually(lambda: (s := events.last("w2")) and s.state == "failed" and s, timeout=30)
        assert failed.reason == (
            f"weights repo: org/repo@main on {hub.url.removeprefix('http://')}: "
            "file missing.gguf not found in org/repo"
        )
        assert not failed.retryable
        waiting = [s.reason for s in events.of("w1") if s.state == "waiting"]
        assert waiting[:1] == ["weights repo: resolving"], waiting
        assert events.states("w1") == ["pending", "waiting", "starting", "loading", "ready"]
    staged = tmp_path / "agent" / "models" / "hf" / "org" / "repo" / commit / "files" / "tiny.gguf"
    assert staged.read_bytes() == GGUF


@pytest.mark.anyio
async def test_a_shard_waiting_for_its_weights_says_how_far_they_are_and_stops_cleanly(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.state.hang = True
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    commit = hub.state.repos["org/repo"].commit
    config = agent_config(nats_url, prefix, tmp_path / "agent", weights_timeout_s=60.0)
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(
            bus.names.shards_bucket,
            "node-a.w3",
            shard("node-a", "w3", sim_profile(model="hf://org/repo/tiny.gguf")),
        )

        async def downloading() -> ShardStatus | None:
            got = await bus.get(bus.names.shard_status_bucket, "node-a.w3", ShardStatus)
            return got[0] if got and "downloading" in got[0].reason else None

        status = await eventually(downloading, timeout=30)
        assert status.state == "waiting"
        assert status.reason == f"weights repo@{commit[:6]}: downloading tiny.gguf (0%, 0.0 of 10.2 kB)"
        # Progress is a status, not an event: the events hold the transitions only.
        assert events.states("w3") == ["pending", "waiting"]
        # A shard no longer wanted stops waiting; nothing half-downloaded is staged.
        await bus.delete(bus.names.shards_bucket, "node-a.w3")
        await eventually(lambda: events.states("w3")[-1:] == ["stopped"], timeout=30)
    assert not (tmp_path / "agent" / "models" / "hf").exists()


# --- what the node holds, and placement ---------------------------------------------------------


@pytest.mark.anyio
async def test_the_node_reports_what_it_holds_as_profiles_name_it(tmp_path: Path, hub: Hub) -> None:
    from llmgw_installer.service import node_facts

    commit = hub.state.repos["org/repo"].commit
    url = hub.add_plain("x.gguf", GGUF)
    sha = hashlib.sha256(GGUF).hexdigest()
    weights = Weights(tmp_path / "agent" / "models", environ={"HF_ENDPOINT": hub.url})
    await stage(weights, "hf://org/repo/tiny.gguf")
    await stage(weights, "hf://org/repo")
    await stage(weights, url, sha)
    facts = node_facts(agent_config("nats://127.0.0.1:1", "p", tmp_path / "agent"))
    held = {k: v for k, v in facts.weights.items() if not k.startswith("/")}
    assert held == {
        "hf://org/repo@main": commit[:16],
        f"hf://org/repo@{commit}": commit[:16],
        "hf://org/repo/tiny.gguf@main": commit[:16],
        f"hf://org/repo/tiny.gguf@{commit}": commit[:16],
        f"sha256:{sha}": sha[:16],
    }
    for model, digest in [
        ("hf://org/repo/tiny.gguf", ""),
        (f"hf://org/repo/tiny.gguf@{commit}", ""),
        ("hf://org/repo", ""),
        (url, sha),
    ]:
        assert Profile(name="p", engine="vllm", model=model, model_sha256=digest).weights_key in held


def test_placement_prefers_the_node_that_holds_the_profiles_weights() -> None:
    from llmgw_placement.decide import Placement, decide
    from tests.test_placement_decide import DEP, node, profile

    p = profile(model_path="", model="hf://org/llama/model.safetensors")
    nodes = [
        node("gpu-01", used_gpus=frozenset({0, 1, 2, 3})),
        node("gpu-02", weights=frozenset({"hf://org/llama/model.safetensors@main"})),
        node("gpu-03"),
    ]
    decision = decide(DEP, p, nodes)
    assert isinstance(decision, Placement)
    assert decision.members[0].node == "gpu-02"
    # Held at another revision is not held.
    other = profile(model_path="", model="hf://org/llama/model.safetensors@v2")
    decision = decide(DEP, other, nodes)
    assert isinstance(decision, Placement)
    assert decision.members[0].node == "gpu-01"


@pytest.mark.anyio
async def test_a_hub_that_is_not_there_is_retried(tmp_path: Path) -> None:
    with hf_hub() as gone:
        url = gone.url
    weights = Weights(tmp_path / "models", environ={"HF_ENDPOINT": url}, timeout_s=2)
    with pytest.raises(WeightsError) as caught:
        await stage(weights, "hf://org/repo/tiny.gguf")
    host = url.removeprefix("http://")
    assert caught.value.reason.startswith(f"weights repo: org/repo@main on {host}: cannot reach the hub: ")
    assert caught.value.retryable
