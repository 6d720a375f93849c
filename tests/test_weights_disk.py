"""The node's disk and its weights: a download that cannot fit is refused before its first byte,
through the launcher, on every surface a staging's progress reaches, and retried until it fits."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus
from tests.hf_server import hf_hub
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

BIG = bytes(range(256)) * 400  # 102.4 kB


@contextlib.contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` at `path` (root only): a disk that really is this small."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
async def test_a_model_the_disk_cannot_hold_is_refused_in_the_nodes_words_and_retried(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with hf_hub() as hub, small_disk(tmp_path / "agent" / "models", "256k") as models:
        hub.add("org/big", {"model.gguf": BIG})
        commit = hub.state.repos["org/big"].commit
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        filler = models / "filler"
        filler.write_bytes(b"\0" * 200_000)
        free = shutil.disk_usage(models).free
        words = (
            f"weights big@{commit[:6]}: needs 102.4 kB, {free / 1000:.1f} kB free on {models}; "
            "free space there (or stage the model elsewhere and use file://)"
        )
        config = agent_config(nats_url, prefix, tmp_path / "agent")
        async with shard_events(bus) as events, running_launcher(config):
            spec = shard("node-a", "w1", sim_profile(model="hf://org/big/model.gguf"))
            await bus.put(bus.names.shards_bucket, "node-a.w1", spec)
            # Refused, then refused again after the backoff: each attempt checks the disk anew.
            await eventually(lambda: events.states("w1").count("failed") >= 2, timeout=30)
            failed = [s for s in events.of("w1") if s.state == "failed"]
            assert [s.reason for s in failed[:2]] == [words, words]
            assert all(s.retryable for s in failed)
            retry = next(s for s in events.of("w1") if s.state == "pending" and s.restarts == 1)
            assert retry.reason == f"attempt 2; last: {words}"
            got = await bus.get(bus.names.shard_status_bucket, "node-a.w1", ShardStatus)
            assert got is not None
            assert got[0].last_failure == words
            # Not one byte was asked of the hub for a download that could not fit.
            assert [g for g in hub.state.gets if g[0] == "model.gguf"] == []
            # Space freed: the next attempt stages it and the shard runs.
            filler.unlink()
            await eventually(lambda: events.states("w1")[-1:] == ["ready"], timeout=30)
        staged = models / "hf" / "org" / "big" / commit / "files" / "model.gguf"
        assert staged.read_bytes() == BIG
        assert hub.state.served["model.gguf"] == len(BIG)


async def test_downloads_under_way_keep_their_space_from_the_next(tmp_path: Path) -> None:
    """Two downloads that each fit, but not both: the second is refused while the first runs
    (without the reservation both passed the check and the disk filled midway)."""
    import anyio

    from llmgw_core.engines import parse_source
    from llmgw_launcher.weights import Weights, WeightsError

    with hf_hub() as hub:
        hub.add("org/one", {"m.gguf": BIG})
        hub.add("org/two", {"m.gguf": BIG[::-1]})
        two = hub.state.repos["org/two"].commit
        hub.state.hang = True
        weights = Weights(
            tmp_path / "models", environ={"HF_ENDPOINT": hub.url}, free=lambda _p: 150_000, timeout_s=60
        )
        said: list[str] = []
        one, second = parse_source("hf://org/one/m.gguf"), parse_source("hf://org/two/m.gguf")
        assert one is not None
        assert second is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(weights.stage, one, said.append)
            await eventually(lambda: any("downloading" in w for w in said), timeout=30)
            with pytest.raises(WeightsError) as caught:
                await weights.stage(second, lambda _w: None)
            tg.cancel_scope.cancel()
        assert caught.value.reason == (
            f"weights two@{two[:6]}: needs 102.4 kB, 47.6 kB free on {tmp_path / 'models'} "
            "(102.4 kB more kept for downloads under way); "
            "free space there (or stage the model elsewhere and use file://)"
        )
        assert caught.value.retryable
