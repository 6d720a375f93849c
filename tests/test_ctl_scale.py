"""`llmgw ctl` at 500-1,000 nodes and as a new user meets it: `get -w` rows under their header,
no replay of long-gone deletes, a state said once, bounded event and describe lines, names
completed where a name goes, an observer's refusal said once."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import anyio.abc
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    NodeReason,
    PlacementDecision,
    ReplicaStatus,
)
from tests.auth_support import session_for
from tests.waiting import eventually


@contextlib.contextmanager
def watching(process: anyio.abc.Process) -> Iterator[None]:
    """Terminate `process` when the block ends, passed or failed: a `ctl -w` left running held
    the test at its `async with` until the test timeout."""
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()


CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]


def refusal(nodes: int) -> tuple[NodeReason, ...]:
    """A fleet's refusal: every node full but a few lost, as placement words them."""
    return tuple(
        NodeReason(
            node=f"sim-{i:05d}",
            reason=f"lost {30 + i % 3} s ago" if i % 250 == 7 else "0 of 8 GPUs free, profile needs 1",
        )
        for i in range(nodes)
    )


# --- pure: what is printed -------------------------------------------------------------------


def test_a_refusal_by_1000_nodes_is_one_bounded_event_line_grouped_by_reason() -> None:
    """Regression: one `refused` event line listed every node's reason (26,797 characters at
    500 nodes)."""
    from llmgw.ctl._read import Stamped
    from llmgw.ctl._views import event_line

    decision = PlacementDecision(deployment="chat", replica="r3", outcome="refused", reasons=refusal(1000))
    line = event_line(Stamped(time=0.0, subject="x", event=decision))
    assert len(line) < 400, len(line)
    assert line.endswith(
        "placement   chat/r3  refused on 1000 nodes: 996 x 0 of 8 GPUs free, profile needs 1 "
        "(sim-00000, sim-00001, sim-00002, …); 2 x lost 31 s ago (sim-00007, sim-00757); "
        "1 x lost 32 s ago (sim-00257); 1 x lost 30 s ago (sim-00507)"
    ), line
    # A few nodes: every node's reason, as before.
    few = PlacementDecision(deployment="chat", replica="r0", outcome="refused", reasons=refusal(2))
    assert event_line(Stamped(time=0.0, subject="x", event=few)).endswith(
        "chat/r0  refused: sim-00000: 0 of 8 GPUs free, profile needs 1; "
        "sim-00001: 0 of 8 GPUs free, profile needs 1"
    )


def test_a_draining_replica_says_draining_once() -> None:
    """Regression: `replica chat/r1 draining: draining: scaled down` in `events` and on the page."""
    from llmgw.ctl._read import Stamped
    from llmgw.ctl._views import event_line
    from llmgw_core.events import encode
    from llmgw_placement.page import event_line as page_line

    status = ReplicaStatus(deployment="chat", replica="r1", state="draining", reason="draining: scaled down")
    assert event_line(Stamped(time=0.0, subject="x", event=status)).endswith("chat/r1  draining: scaled down")
    assert page_line("x", encode(status)) == "replica chat/r1 draining: scaled down"
    failed = ReplicaStatus(deployment="chat", replica="r0", state="failed", reason="sim exited with code 42")
    assert page_line("x", encode(failed)) == "replica chat/r0 failed: sim exited with code 42"


def test_describe_groups_a_refusal_by_reason_and_explain_keeps_every_node() -> None:
    from llmgw.ctl._read import Cluster
    from llmgw.ctl._views import describe_deployment

    status = DeploymentStatus(
        deployment="chat",
        desired=4,
        ready=0,
        pending=0,
        unplaceable=4,
        summary="chat: 0 of 4 ready; 4 cannot be placed: 1000 nodes refused: …",
        reasons=refusal(1000),
    )
    c = Cluster(
        nodes={},
        judged=None,
        deployments={"chat": Deployment(name="chat", profile="tiny", replicas=4)},
        statuses={"chat": status},
        replicas={},
        shards={},
        catalog={},
    )
    text = describe_deployment("chat", c, [], now=100.0)
    assert max(len(line) for line in text.splitlines()) < 200, text
    assert len(text.splitlines()) < 30, text
    refusal_part = text.split("Refusal", 1)[1].split("\n\n", 1)[0]
    assert refusal_part.splitlines() == [
        " (1000 nodes, by reason; `llmgw ctl explain chat` lists every node's):",
        "  NODES  REASON                             FOR EXAMPLE",
        "  996    0 of 8 GPUs free, profile needs 1  sim-00000, sim-00001, sim-00002, …",
        "  2      lost 31 s ago                      sim-00007, sim-00757",
        "  1      lost 32 s ago                      sim-00257",
        "  1      lost 30 s ago                      sim-00507",
    ], refusal_part


def test_a_cpu_profile_reads_as_cpu_not_one_gpu() -> None:
    from llmgw.ctl._views import describe_profile, profile_row
    from llmgw_core.engines import Profile

    cpu = Profile(name="small", engine="llamacpp", model_path="/models/x.gguf")
    assert profile_row(cpu)[3:5] == ["CPU", "0"]
    said = describe_profile(cpu, {})
    assert "GPU class:    (none: runs on CPUs)" in said
    assert "1 GPU" not in said
    gpu = Profile(name="big", engine="sim", model_path="sim://x", gpu_class="H100-80G", tp=2)
    assert profile_row(gpu)[3:5] == ["H100-80G", "2"]


def test_a_watched_row_starts_each_cell_under_its_column() -> None:
    from llmgw.ctl._views import REPLICA_HEADERS, table, under

    first = ["chat/r0", "ready", "node-1", "5 s", "0", "-"]
    printed = table(REPLICA_HEADERS, [first]).splitlines()
    header = printed[0]
    starts = [header.index(h) for h in REPLICA_HEADERS]
    later = ["chat/r1", "ready", "node-2", "1 s", "0", "-"]
    # As the table would have printed it among its rows.
    assert under(header, later) == table(REPLICA_HEADERS, [first, later]).splitlines()[2]
    # A cell longer than its column pushes only its neighbour; the rest stay under their titles.
    long = under(header, ["chat/r0", "degraded", "n", "1 s", "3", "why"])
    assert long.index("1 s") == starts[3], (header, long)
    assert long.index("why") == starts[5], (header, long)


# --- through a real nats-server -------------------------------------------------------------


def ctl_env(nats_url: str, prefix: str, tmp_path: Path, identity: str = "ctl") -> dict[str, str]:
    """`llmgw ctl`'s environment as `identity` (on the session's server, its own nkey)."""
    env = {**os.environ, "LLMGW_NATS_URL": nats_url}
    session = session_for(nats_url)
    if session is not None:
        auth = session.identities(prefix, tmp_path / "auth")
        env["LLMGW_NATS_URL"] = session.url
        env["LLMGW_NATS_NKEY"] = str(auth.seed(identity))
    else:
        env["LLMGW_NATS_INSECURE"] = "1"
    return env


async def lines_of(process: anyio.abc.Process, into: list[str]) -> None:
    assert process.stdout is not None
    buffer = b""
    async for chunk in process.stdout:
        buffer += chunk
        *done, buffer = buffer.split(b"\n")
        into.extend(line.decode() for line in done)


@pytest.mark.anyio
@pytest.mark.timeout(120)
async def test_watch_prints_rows_under_the_header_and_only_deletes_of_rows_it_showed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: `get -w` printed each changed row two characters a column right of its
    header, and `NAME deleted` for every deployment deleted long before it started."""
    deployments = bus.names.deployments_bucket
    for gone in ("gone-1", "gone-2"):
        await bus.put(deployments, gone, Deployment(name=gone, profile="tiny"))
        await bus.delete(deployments, gone)
    await bus.put(deployments, "chat-a", Deployment(name="chat-a", profile="tiny", replicas=2))
    env = ctl_env(nats_url, prefix, tmp_path)
    printed: list[str] = []
    async with (
        await anyio.open_process([*CTL, "--prefix", prefix, "get", "deployments", "-w"], env=env) as watcher,
        anyio.create_task_group() as tg,
    ):
        # Ended however the test ends: the process's exit is waited for on the way out.
        with watching(watcher):
            tg.start_soon(lines_of, watcher, printed)
            await eventually(lambda: len(printed) >= 2, timeout=45)
            header = printed[0]
            assert header.split() == ["NAME", "PROFILE", "DESIRED", "READY", "PENDING", "UNPLACEABLE", "POOL"]
            assert printed[1].split() == ["chat-a", "tiny", "2", "-", "-", "-", "-"]
            await bus.put(deployments, "chat-b", Deployment(name="chat-b", profile="tiny", replicas=3))
            await bus.delete(deployments, "chat-a")
            await eventually(lambda: any("deleted" in line for line in printed), timeout=10)
            tg.cancel_scope.cancel()
    starts = [header.index(word) for word in header.split()]
    changed = next(line for line in printed[2:] if line.startswith("chat-b"))
    assert [changed.index(cell, at) for cell, at in zip(changed.split(), starts, strict=True)] == starts, (
        header,
        changed,
    )
    assert printed[2:] == [changed, "chat-a  deleted"], printed
    assert not any("gone" in line for line in printed), printed


@pytest.mark.anyio
@pytest.mark.timeout(60)
async def test_an_observers_refusal_is_said_once_on_one_line(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    if session_for(nats_url) is None:
        pytest.skip("a server without identities refuses no one")
    env = ctl_env(nats_url, prefix, tmp_path, identity="observer")
    for watching in ([], ["--watch"]):
        done = subprocess.run(
            [*CTL, "--prefix", prefix, "get", "deployments", *watching],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        # Said once, by ctl, with what it tried: not also by the bus client's own report of it.
        assert done.returncode == 4, (watching, done.stderr)
        [line] = done.stderr.splitlines()
        assert line.startswith(
            f"llmgw: llmgw-ctl: cannot read {prefix}-deployments >: nats-server refused observer"
        ), watching
