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


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
async def test_a_full_disk_evicts_the_least_recently_used_model_no_shard_uses(tmp_path: Path) -> None:
    """No budget set: the disk itself is the limit, and a model no shard uses makes room."""
    from llmgw_core.engines import parse_source
    from llmgw_launcher.weights import Eviction, Weights

    # 10.2 kB: three 4 kB pages on tmpfs, and its ref file one more: a and b take 8 of the
    # disk's 10 pages, and c fits only once a is gone.
    small = bytes(range(256)) * 40
    with hf_hub() as hub, small_disk(tmp_path / "models", "40k") as models:
        for name in ("a", "b", "c"):
            hub.add(f"org/{name}", {"m.gguf": bytes(b ^ ord(name) for b in small)})
        evicted: list[Eviction] = []
        weights = Weights(models, environ={"HF_ENDPOINT": hub.url}, on_evict=evicted.append)
        for name in ("a", "b", "c"):
            source = parse_source(f"hf://org/{name}/m.gguf")
            assert source is not None
            path = await weights.stage(source, lambda _w: None)
            assert path.read_bytes() == bytes(b ^ ord(name) for b in small)
        assert [e.key for e in evicted] == [f"hf://org/a/m.gguf@{hub.state.repos['org/a'].commit}"]
        assert evicted[0].freed == len(small)
        assert sorted(p.parts[-4] for p in (models / "hf").rglob("m.gguf")) == ["b", "c"]


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
async def test_a_disk_that_fills_under_a_staging_fails_the_attempt_in_the_nodes_words(tmp_path: Path) -> None:
    """The check counts the model's bytes, not the few of its metadata: a disk full to the last
    page fails the write of a ref file, and that is the attempt's failure, not a launcher error."""
    from llmgw_core.engines import parse_source
    from llmgw_launcher.weights import Weights, WeightsError

    small = bytes(range(256)) * 40
    with hf_hub() as hub, small_disk(tmp_path / "models", "16k") as models:
        hub.add("org/a", {"m.gguf": small})
        source = parse_source("hf://org/a/m.gguf")
        assert source is not None
        (models / "filler").write_bytes(b"\0" * 4000)
        with pytest.raises(WeightsError) as caught:
            await Weights(models, environ={"HF_ENDPOINT": hub.url}).stage(source, lambda _w: None)
        label = f"a@{hub.state.repos['org/a'].commit[:6]}"
        assert caught.value.reason == (
            f"weights {label}: cannot write in {models}: No space left on device; "
            "nothing half-written is used, and the next attempt tries again"
        )
        assert caught.value.retryable
