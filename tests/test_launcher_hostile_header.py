"""A model staged from a hub whose header is hostile fails its shard once, in bounded words.

Read before through the `gguf` package, such a header was retried for ever (its reader's
surprise at every attempt) or started an engine on a broken file. Now the launcher reads the
header within bounds before any engine starts, and the shard fails for good with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_core.bus import Bus
from tests.hf_server import hf_hub
from tests.test_fit_hostile import LLAMA_KVS, gguf, tensor_info
from tests.waiting import eventually, passes

# A tensor whose data lies 2**60 bytes past a header of a 256-byte data section.
BOMB = gguf(LLAMA_KVS, [tensor_info("w", [64], offset=2**60)], data=256)
# A file of another kind under a model's name: no header to refuse, started as before.
NOTES = bytes(range(256)) * 4


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_a_hostile_header_fails_its_shard_once_with_the_reason_and_starts_no_engine(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nats.aio.msg import Msg

    from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile

    beats: list[bytes] = []

    async def on_beat(msg: Msg) -> None:
        beats.append(msg.data)

    with hf_hub() as hub:
        hub.add("org/evil", {"bomb.gguf": BOMB, "notes.gguf": NOTES})
        commit = hub.state.repos["org/evil"].commit
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        await bus.nc.subscribe(bus.names.heartbeat("node-a", "launcher"), cb=on_beat)
        config = agent_config(nats_url, prefix, tmp_path / "agent")
        bomb = sim_profile(model="hf://org/evil/bomb.gguf", model_path="")
        notes = sim_profile(model="hf://org/evil/notes.gguf", model_path="")
        async with shard_events(bus) as events, running_launcher(config):
            await bus.put(bus.names.shards_bucket, "node-a.bomb", shard("node-a", "bomb", bomb))
            await bus.put(bus.names.shards_bucket, "node-a.notes", shard("node-a", "notes", notes))
            await eventually(lambda: events.states("notes")[-1:] == ["ready"], timeout=60)
            await eventually(lambda: events.states("bomb")[-1:] == ["failed"], timeout=60)
            # Several heartbeats (and restart backoffs) later, still the one attempt.
            await passes(lambda: len(beats), 4, timeout=30)
            last = events.last("bomb")
            assert last is not None
            staged = tmp_path / "agent" / "models" / "hf" / "org" / "evil" / commit / "files" / "bomb.gguf"
            assert last.reason == (
                f"model hf://org/evil/bomb.gguf@main: {staged}: GGUF header: tensor data runs to "
                "1,152,921,504,606,847,232 bytes past the header, past the 256 bytes the file holds there; "
                "the file is broken or not a model: fix it at its source"
            )
            assert (last.retryable, last.pids, last.restarts) == (False, (), 0)
            assert [s for s in events.states("bomb") if s == "failed"] == ["failed"], events.states("bomb")
    # No engine was started for it: only the other shard has process logs.
    assert sorted(p.name for p in (tmp_path / "agent" / "logs").iterdir()) == ["node-a.notes"]


def test_a_reason_from_outside_is_bounded_in_a_shards_status() -> None:
    from llmgw_launcher.attempt import REASON_MAX
    from llmgw_launcher.attempt import bounded as _bounded

    long = "x" * 10_000_000
    said = _bounded(long)
    assert len(said) < REASON_MAX + 40
    assert said.endswith("… (10,000,000 characters)")
    assert _bounded("short") == "short"
