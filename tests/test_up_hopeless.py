"""`llmgw up` stops waiting for an engine that will not start, and says why in its words: a
failure its launcher does not retry, or HOPELESS_RESTARTS failed starts with none ready,
rather than an hour's wait (`--model`) on an engine that exits at every start."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import msgspec
import pytest

from llmgw.supervise import GaveUp
from llmgw.up import DEPLOYMENT, HOPELESS_RESTARTS, Progress, _wait_ready, hopeless
from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord, ShardStatus

LAST = "llama-server (pid 41) exited with code 1; last log lines: llama_model_load: error loading model"


def _shard(**kw: object) -> ShardStatus:
    fields = {"node": "local-1", "shard": "chat-r0-0", "replica": "r0", "state": "starting"}
    return msgspec.convert(fields | {"deployment": DEPLOYMENT, "at": time.time()} | kw, ShardStatus)


def test_an_engine_is_hopeless_after_its_failed_starts_or_a_failure_not_retried() -> None:
    assert hopeless(_shard()) == ""
    assert hopeless(_shard(restarts=HOPELESS_RESTARTS - 1, last_failure=LAST)) == ""
    assert hopeless(_shard(restarts=HOPELESS_RESTARTS, last_failure=LAST)) == (
        f"{HOPELESS_RESTARTS} starts failed, the last: {LAST}"
    )
    # Ready after its failures: it started.
    assert hopeless(_shard(state="ready", restarts=5, last_failure=LAST)) == ""
    # Its launcher does not retry it (a model file it cannot read): at once.
    assert hopeless(_shard(state="failed", retryable=False, reason="model file not found")) == (
        "model file not found"
    )
    assert hopeless(_shard(state="failed", retryable=True, reason="exited")) == ""


def _record(replica: str, profile: str, fp: str) -> ReplicaRecord:
    return ReplicaRecord(
        deployment=DEPLOYMENT,
        replica=replica,
        profile=profile,
        profile_fp=fp,
        state="starting",
        updated_at=time.time(),
    )


@pytest.mark.anyio
async def test_up_gives_up_on_the_engine_at_once_with_its_words(bus: Bus, tmp_path: Path) -> None:
    progress = Progress(started=time.time() - 1)
    # The replica an earlier run asked for (another profile) fails for good as it is replaced:
    # not this run's engine.
    await bus.put(bus.names.replicas_bucket, "chat.r0", _record("r0", "tiny-chat", "old"))
    refused = "profile tiny-chat: needs 1 GPUs per node, node has 0"
    old = _shard(state="failed", retryable=False, reason=refused, profile_fp="old")
    await bus.put(bus.names.shard_status_bucket, "local-1.chat-r0-0", old)
    await bus.put(bus.names.replicas_bucket, "chat.r1", _record("r1", "tiny", "new"))
    with anyio.move_on_after(1):
        await _wait_ready(bus, tmp_path, [], progress, time.monotonic() + 3600, 3600, "tiny")
    assert progress.hopeless == ""
    # This run's engine exits at each start.
    failing = _shard(
        shard="chat-r1-0", replica="r1", state="pending", restarts=HOPELESS_RESTARTS, last_failure=LAST
    )
    await bus.put(
        bus.names.shard_status_bucket, "local-1.chat-r1-0", msgspec.structs.replace(failing, profile_fp="new")
    )
    began = time.monotonic()
    with pytest.raises(GaveUp) as gave_up:
        with anyio.fail_after(10):
            await _wait_ready(bus, tmp_path, [], progress, time.monotonic() + 3600, 3600, "tiny")
    assert time.monotonic() - began < 5
    assert str(gave_up.value) == (
        f"the engine of deployment {DEPLOYMENT} will not start: replica r1 on local-1: "
        f"{HOPELESS_RESTARTS} starts failed, the last: {LAST}; see {tmp_path}"
    )
