"""An engine's port belongs to the engine: a process that holds it (and answers /health like
an engine) never makes a shard ready, and the gateway never sends it a request."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus
from llmgw_launcher import ports
from tests.cluster_support import cluster, sim_catalog
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.test_gateway import running_gateway
from tests.test_sim_engine import free_port
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(180)]

SQUATTER = Path(__file__).with_name("squatter.py")


@contextlib.contextmanager
def squatter(where: Path, port: int) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """`python squat.py PORT LOG` in `where`, listening on 127.0.0.1:`port`; and the file that
    lists the paths of the requests it got."""
    shutil.copy(SQUATTER, where / "squat.py")
    requests = where / "squatter-requests.txt"
    requests.touch()
    proc = subprocess.Popen(
        [sys.executable, "squat.py", str(port), str(requests)],
        cwd=where,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "squatting", "the squatter did not start"
        yield proc, requests
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def held_words(port: int, proc: subprocess.Popen[str], requests: Path) -> str:
    return f"port {port} is held by pid {proc.pid} ({sys.executable} squat.py {port} {requests})"


def test_the_listening_socket_is_found_with_its_owner(tmp_path: Path) -> None:
    port = free_port()
    with squatter(tmp_path, port) as (proc, requests):
        [found] = [x for x in ports.listeners(port) or [] if x.addr == "127.0.0.1"]
        assert ports.owner(found.inode) == proc.pid
        assert ports.held(port, "127.0.0.1") == held_words(port, proc, requests)
        assert ports.held(port, "0.0.0.0") == held_words(port, proc, requests)
        # Another address of the host is not where the squatter listens.
        assert ports.held(port, "127.0.0.2") is None
        # Its own process tree owns it; the test's process (its parent) is not in that tree.
        assert ports.foreign(port, "127.0.0.1", [proc.pid]) is None
        assert ports.foreign(port, "127.0.0.1", [99999999]) == held_words(port, proc, requests)
    assert ports.held(port, "127.0.0.1") is None


async def test_a_shard_is_not_started_on_a_port_another_process_holds(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a process already listening on an engine's port answered /health, the shard
    was ready 86 ms into loading, and the engine then died with "Address already in use".

    Each wait is for the launcher's own transition, never for an engine's cold start to beat a
    deadline: that start (a Python process importing its web server) took 20 s and more on a
    loaded 2-core machine, past the profile's health timeout, and each timeout cost another
    cold start. The engine here has `health_s` to answer; the test waits for the outcome the
    launcher gives its attempt, whichever it is, and says it."""
    port = free_port()
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    health_s = 120.0
    spec = shard("node-a", "s1", sim_profile(health_timeout_s=health_s), port=port)
    async with shard_events(bus) as events, running_launcher(config):
        with squatter(tmp_path, port) as (proc, requests):
            await bus.put(bus.names.shards_bucket, "node-a.s1", spec)
            failed = await eventually(
                lambda: [s for s in events.of("s1") if s.state == "failed"][1:], timeout=30
            )
            for s in failed:
                assert s.reason == held_words(port, proc, requests)
                assert s.retryable
                assert s.pids == (), "an engine was started on a port another process holds"
            assert "ready" not in events.states("s1")
            assert requests.read_text() == "", "the launcher sent the squatter requests"
        # Once the port is free again, the next attempt starts the engine on it: `loading` at the
        # port with the engine's pid (a spawn away, after at most one restart backoff).
        loading = await eventually(
            lambda: next((s for s in events.of("s1") if s.state == "loading"), None), timeout=30
        )
        assert (loading.port, len(loading.pids)) == (port, 1)

        def outcome() -> ShardStatus | None:
            after = events.of("s1")[events.of("s1").index(loading) + 1 :]
            return next((s for s in after if s.state in ("ready", "failed")), None)

        # That engine's attempt ends by the launcher's own deadline: ready, or failed in its words.
        ended = await eventually(outcome, timeout=health_s + 30)
        assert (ended.state, ended.reason) == ("ready", "")
        assert (ended.port, ended.pids) == (port, loading.pids)


async def test_a_squatter_that_answers_health_never_gets_a_user_request(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """A process takes the engine's port after the launcher picked it and before the engine
    bound it (this engine binds 8 s after it starts, as engines that load weights first do), and
    answers /health 200. The shard fails with who holds the port, never ready there; the gateway
    sends it nothing; the next attempt runs on another port and serves."""
    async with shard_events(bus) as events:
        with cluster(tmp_path, nats_url, prefix) as c:
            c.start_placement(
                "p1",
                [sim_catalog("--listen-after", "8")],
                [{"name": "chat", "profile": "tiny", "replicas": 1}],
            )
            c.start_node("n1", gpus=1)
            loading = await eventually(
                lambda: next((s for s in events.items if s.state == "loading"), None), timeout=60
            )
            port = loading.port
            with squatter(tmp_path, port) as (proc, requests):
                # Each request held half a second for a ready replica, then answered 503: the
                # gateway is asked again and again while the squatter holds the port.
                async with running_gateway(c, more={"hold_timeout_s": 0.5}) as (url, _):
                    answers: list[httpx.Response] = []
                    async with httpx.AsyncClient(base_url=url, timeout=30) as client:

                        async def answered() -> httpx.Response | None:
                            r = await client.post(
                                "/v1/chat/completions",
                                json={"model": "chat", "messages": [{"role": "user", "content": "hi"}]},
                            )
                            answers.append(r)
                            return r if r.status_code == 200 else None

                        done = await eventually(answered, timeout=90, interval=0.3)
                assert done.json()["choices"][0]["message"]["content"]
                assert len(answers) > 1, "the gateway was never asked while the squatter held the port"
                assert not [r.text for r in answers if "foreign" in r.text], (
                    "the gateway routed to the squatter"
                )
                failed = [s for s in events.items if s.state == "failed"]
                assert failed, events.items
                assert failed[0].reason == held_words(port, proc, requests)
                assert not [s for s in events.items if s.state == "ready" and s.port == port]
                ready = [s for s in events.items if s.state == "ready"]
                assert ready
                assert ready[-1].port != port
                got = requests.read_text().split()
                assert got, "the squatter was never probed: the race was not reproduced"
                assert set(got) == {"/health"}, f"the squatter got user requests: {got}"
