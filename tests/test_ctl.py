"""`llmgw ctl` against a real cluster (NATS, placement, installer and launcher processes, sim
engines), run as the operator runs it: its stdout, its stderr and its exit code. `ctl` runs it
by its `main` in this process (a process costs a second of imports, several on a busy machine,
and the suites call it hundreds of times); the cases a script depends on run it as a process."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.test_cli import in_process
from tests.test_ctl_scale import watching
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]

# Exits with code 42 before it is ever healthy, every attempt.
CRASHY = sim_catalog("--load-time", "30", "--exit-after", "0.4", "--exit-code", "42", name="crashy")


def ctl(
    c: Cluster, *args: str, timeout: float = 60, process: bool = False
) -> subprocess.CompletedProcess[str]:
    """`llmgw ctl --prefix <the cluster's> ARGS` as the operator: in this process, or as a
    process of its own where `process`."""
    if not process:
        return in_process("ctl", "--prefix", c.prefix, *args, env=c.ctl_env(), timeout=timeout)
    return subprocess.run(
        [*CTL, "--prefix", c.prefix, *args], capture_output=True, text=True, env=c.ctl_env(), timeout=timeout
    )


def ok(c: Cluster, *args: str) -> str:
    done = ctl(c, *args)
    assert done.returncode == 0, (args, done.returncode, done.stderr)
    return done.stdout


def as_json(c: Cluster, *args: str) -> Any:
    return json.loads(ok(c, *args, "-o", "json"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_ctl_reads_writes_and_fails_as_a_script_expects(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement(
            "p1",
            [sim_catalog(), CRASHY],
            [{"name": "chat", "profile": "tiny", "replicas": 1}, {"name": "crashy", "profile": "crashy"}],
        )

        async def chat_ready() -> list[Any]:
            listed = as_json(c, "get", "replicas")
            assert [
                (r["deployment"], r["replica"], r["state"]) for r in listed if r["deployment"] == "chat"
            ] == [("chat", "r0", "ready")], listed
            return listed

        listed = await eventually(chat_ready, timeout=60, interval=0.5)
        chat = next(r for r in listed if r["deployment"] == "chat")
        # The records as placement wrote them: msgspec builtins, `kind` included.
        assert chat["kind"] == "ReplicaRecord"
        assert chat["members"][0]["node"] == "node-1"
        assert chat["url"].startswith("http://127.0.0.1:")
        assert chat["since"] > 0
        one = as_json(c, "get", "replicas", "chat.r0")
        assert (one["deployment"], one["replica"], one["state"]) == ("chat", "r0", "ready")
        table = ok(c, "get", "replicas").splitlines()
        assert table[0].split() == ["REPLICA", "STATE", "NODES", "SINCE", "RESTARTS", "REASON"]
        assert table[1].split()[:3] == ["chat/r0", "ready", "node-1"] or any(
            line.split()[:3] == ["chat/r0", "ready", "node-1"] for line in table[1:]
        )
        deployments = as_json(c, "get", "deployments")
        assert [d["name"] for d in deployments] == ["chat", "crashy"]
        assert deployments[0]["deployment"]["profile"] == "tiny"

        # Logs: the engine's own lines, through the node's launcher.
        logs = ok(c, "logs", "chat-r0-0", "--tail", "5").splitlines()
        assert 1 <= len(logs) <= 5
        assert any(line.startswith("llmgw-sim: serving tiny on http://127.0.0.1:") for line in logs), logs

        # A shard whose engine exits with code 42, again and again: the last failure is that
        # attempt's, with that attempt's own log lines only.
        async def crashed_twice() -> dict[str, Any]:
            shards = [s for s in as_json(c, "get", "shards") if s["deployment"] == "crashy"]
            assert len(shards) == 1, shards
            assert shards[0]["restarts"] >= 2, shards
            assert "exited with code 42" in shards[0]["last_failure"], shards
            return dict(shards[0])

        crashy = await eventually(crashed_twice, timeout=60, interval=0.5)
        failure = crashy["last_failure"]
        assert failure.startswith("sim (pid ")
        assert failure.count("llmgw-sim: exiting with code 42 after 0.4s") == 1, failure
        assert failure.count("llmgw-sim: serving") == 1, failure
        assert "--- llmgw: attempt" not in failure
        assert crashy["last_failure_at"] > 0
        # The same failure as fields, and the table's column made of them.
        fields = crashy["failure"]
        assert (fields["exit"], fields["log_tail"][-1]) == (42, "llmgw-sim: exiting with code 42 after 0.4s")
        assert fields["reason"] == failure.split(";", 1)[0], fields
        assert fields["attempt"] >= 1, fields
        wide = ok(c, "get", "shards", "-o", "wide").splitlines()
        [row] = [line for line in wide if "crashy" in line]
        assert re.search(r"  sim \(pid \d+\) exited with code 42$", row), row

        async def described() -> str:
            text = ok(c, "describe", "deployment", "crashy")
            assert "exited with code 42" in text, text
            return text

        text = await eventually(described, timeout=30, interval=0.5)
        assert "Name:         crashy" in text
        assert "Replicas:     1 desired" in text
        story = text.split("Last failure of ", 1)[1].split("\nEvents:", 1)[0]
        assert re.match(r"r0 \(attempt \d+, exit code 42\):\n  sim \(pid \d+\) exited with code 42", story), (
            story
        )
        assert story.count("llmgw-sim: exiting with code 42 after 0.4s") == 1, text
        assert "shard" in text.split("Events:", 1)[1]

        # A node's whole story: its GPUs by class and compute capability, its adapters, its shards.
        node = ok(c, "describe", "node", "node-1")
        assert "HCAs:         none" in node, node
        gpus = node.split("GPUs:", 1)[1].split("Engines:", 1)[0]
        assert gpus.split("\n")[1].split() == ["INDEX", "CLASS", "NAME", "CC", "MEMORY"], gpus
        assert "H100-80G" in gpus, gpus
        assert "chat-r0-0" in node.split("Shards:", 1)[1], node

        # Events of one deployment, as JSON lines.
        lines = [json.loads(x) for x in ok(c, "events", "--deployment", "chat", "-o", "json").splitlines()]
        assert {e["event"]["kind"] for e in lines} >= {"ReplicaStatus", "ShardStatus"}
        assert all(e["subject"].startswith(f"{prefix}.events.") for e in lines)
        assert all("crashy" not in e["subject"] for e in lines)

        # Errors a script can tell apart.
        missing = ctl(c, "get", "deployments", "nope", process=True)
        assert (missing.returncode, missing.stderr) == (
            3,
            "llmgw: no deployment nope (`llmgw ctl get deployments` lists them)\n",
        )
        assert ctl(c, "describe", "deployment", "nope").returncode == 3
        assert ctl(c, "logs", "nope-r0-0").returncode == 3
        assert ctl(c, "scale", "nope", "--replicas", "2").returncode == 3
        bad_name = ctl(c, "deploy", "a.b", "--profile", "tiny")
        assert bad_name.returncode == 2
        assert bad_name.stderr.startswith("llmgw: deployment 'a.b' is not a valid name")
        negative = ctl(c, "deploy", "chat", "--profile", "tiny", "--replicas", "-1")
        assert (negative.returncode, negative.stderr) == (
            2,
            "llmgw: --replicas -1: a replica count is 0 or more\n",
        )
        assert ctl(c, "get", "bogus").returncode == 2
        unknown = ctl(c, "deploy", "more", "--profile", "huge")
        assert (unknown.returncode, unknown.stderr) == (
            4,
            "llmgw: unknown profile 'huge' for deployment more: the catalog has crashy, tiny\n",
        )
        for done in (missing, bad_name, negative, unknown):
            assert "Traceback" not in done.stderr
        started = time.monotonic()
        unreachable = ctl(c, "--nats-url", f"nats://127.0.0.1:{closed_port()}", "get", "nodes", process=True)
        assert unreachable.returncode == 5, unreachable.stderr
        assert unreachable.stderr.startswith("llmgw: llmgw-ctl: cannot connect to NATS at nats://127.0.0.1:")
        assert len(unreachable.stderr.splitlines()) == 1
        assert time.monotonic() - started < 15  # 3 s to connect, plus the interpreter's start

        # Beyond capacity (2 GPUs, both held): a warning with the shortfall, and the request stands.
        more = ctl(c, "deploy", "more", "--profile", "tiny", "--replicas", "3")
        assert more.returncode == 0, more.stderr
        assert more.stdout == "deployment more: 3 x tiny requested\n"
        assert "cannot be placed" in more.stderr or "short by" in more.stderr, more.stderr
        assert ok(c, "delete", "deployment", "more") == "deployment more deleted: its replicas stop\n"
        assert ok(c, "delete", "deployment", "crashy") == "deployment crashy deleted: its replicas stop\n"


async def test_get_watch_prints_a_changed_row_within_a_second(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        await eventually(
            lambda: [r for r in as_json(c, "get", "replicas") if r["state"] == "ready"],
            timeout=60,
            interval=0.5,
        )
        printed: list[tuple[float, str]] = []
        changed: dict[str, float] = {}
        async with (
            await anyio.open_process(
                [*CTL, "--prefix", prefix, "get", "replicas", "--watch"], env=c.ctl_env()
            ) as watcher,
            anyio.create_task_group() as tg,
        ):

            async def read_lines(stdout: anyio.abc.ByteReceiveStream) -> None:
                buffer = b""
                async for chunk in stdout:
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    printed.extend((time.monotonic(), line.decode()) for line in lines)

            async def note_changes() -> None:
                async for change in bus.watch(bus.names.replicas_bucket, ReplicaRecord):
                    changed.setdefault(
                        f"{change.key}@{change.value.state if change.value else '-'}", time.monotonic()
                    )

            with watching(watcher):
                assert watcher.stdout is not None
                tg.start_soon(read_lines, watcher.stdout)
                tg.start_soon(note_changes)
                await eventually(lambda: any(line.startswith("chat/r0") for _, line in printed), timeout=60)
                assert printed[0][1].split() == ["REPLICA", "STATE", "NODES", "SINCE", "RESTARTS", "REASON"]
                ok(c, "scale", "chat", "--replicas", "2")
                ready = await eventually(
                    lambda: [t for t, line in printed if line.split()[:2] == ["chat/r1", "ready"]], timeout=60
                )
                seen = changed["chat.r1@ready"]
                assert ready[0] - seen < 1.0, f"printed {ready[0] - seen:.2f}s after the change"
                tg.cancel_scope.cancel()
