"""Staged models that no shard uses are evicted least recently used first, under the node's
`models_budget_bytes`; a model a shard uses never is; each eviction is said (log and event)."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.engines import ModelSource, parse_source
from llmgw_core.events import WeightsEvicted, decoder
from llmgw_launcher.weights import Eviction, Weights, WeightsError
from tests.hf_server import Hub, hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

SIZE = 10240


def model(n: int) -> bytes:
    return bytes((i * n) % 251 for i in range(SIZE))


@pytest.fixture
def hub() -> object:
    with hf_hub() as h:
        for name in ("a", "b", "c"):
            h.add(f"org/{name}", {"m.gguf": model(ord(name))})
        yield h


def src(name: str) -> ModelSource:
    source = parse_source(f"hf://org/{name}/m.gguf")
    assert source is not None
    return source


def view(root: Path, hub: Hub, name: str) -> Path:
    commit = hub.state.repos[f"org/{name}"].commit
    return root / "hf" / "org" / name / commit / "files" / "m.gguf"


async def test_the_least_recently_used_model_no_shard_uses_goes_first(tmp_path: Path, hub: Hub) -> None:
    root = tmp_path / "models"
    using: list[ModelSource] = []
    evicted: list[Eviction] = []
    weights = Weights(
        root,
        environ={"HF_ENDPOINT": hub.url},
        budget_bytes=25_000,
        in_use=lambda: list(using),
        on_evict=evicted.append,
    )

    async def stage(name: str) -> Path:
        return await weights.stage(src(name), lambda _w: None)

    await stage("a")
    await stage("b")
    await stage("a")  # a used again: b is now the least recently used
    await stage("c")
    assert [e.key for e in evicted] == [f"hf://org/b/m.gguf@{hub.state.repos['org/b'].commit}"]
    c_label = f"c@{hub.state.repos['org/c'].commit[:6]}"
    assert evicted[0].words == (
        f"weights {evicted[0].key}: evicted from {root} (10.2 kB freed): no shard of this node uses it, "
        f"it was the least recently used, and {c_label} needs 10.2 kB"
    )
    assert not view(root, hub, "b").exists()
    assert view(root, hub, "a").read_bytes() == model(ord("a"))
    assert len(list((root / "blobs").iterdir())) == 2, "the evicted model's blob stayed"

    # a is the least recently used now, but a shard uses it: c goes instead.
    using.append(src("a"))
    await stage("b")
    assert [e.key.split("/")[3] for e in evicted] == ["b", "c"]
    assert view(root, hub, "a").exists()
    assert view(root, hub, "b").read_bytes() == model(ord("b"))

    # Every model in use: nothing may go, and the staging is refused in the node's words.
    using.append(src("b"))
    with pytest.raises(WeightsError) as caught:
        await stage("c")
    assert caught.value.reason == (
        f"weights {c_label}: needs 10.2 kB, 4.5 kB left of the node's 25.0 kB for weights on {root}; "
        "raise models_budget_bytes or remove staged models"
    )
    assert [e.key.split("/")[3] for e in evicted] == ["b", "c"]
    assert view(root, hub, "a").exists()
    assert view(root, hub, "b").exists()


async def test_the_launcher_evicts_only_what_no_shard_uses_and_says_so(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    root = tmp_path / "agent" / "models"
    said: list[WeightsEvicted] = []

    async def on_msg(msg: Msg) -> None:
        said.append(decoder(WeightsEvicted).decode(msg.data))

    sub = await bus.nc.subscribe(bus.names.node_weights("node-a"), cb=on_msg)
    config = agent_config(nats_url, prefix, tmp_path / "agent", models_budget_bytes=25_000)
    try:
        async with shard_events(bus) as events, running_launcher(config):

            async def run(name: str, model_name: str) -> None:
                spec = shard("node-a", name, sim_profile(model=f"hf://org/{model_name}/m.gguf"))
                await bus.put(bus.names.shards_bucket, f"node-a.{name}", spec)
                await eventually(lambda: events.states(name)[-1:] == ["ready"], timeout=30)

            await run("w1", "a")  # a stays in use throughout
            await run("w2", "b")
            await bus.delete(bus.names.shards_bucket, "node-a.w2")
            await eventually(lambda: events.states("w2")[-1:] == ["stopped"], timeout=30)
            # a is the least recently used, but w1 runs it: b goes to make room for c.
            await run("w3", "c")
            event = await eventually(lambda: said and said[0], timeout=30)
            assert event.key == f"hf://org/b/m.gguf@{hub.state.repos['org/b'].commit}"
            assert event.node == "node-a"
            assert event.freed_bytes == SIZE
            assert event.path == str(view(root, hub, "b"))
            assert event.reason.startswith(f"weights {event.key}: evicted from {root} (10.2 kB freed)")
            assert events.states("w1")[-1] == "ready"
            assert view(root, hub, "a").read_bytes() == model(ord("a"))
            assert not view(root, hub, "b").exists()
            assert len(said) == 1
    finally:
        await sub.unsubscribe()
