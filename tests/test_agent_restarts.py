"""An agent restart is not a node failure: real placement, installer, launcher and sim engine
processes on the session's NATS, a gateway in front, and clients sending all along."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from llmgw import ctl
from llmgw_core.bus import Bus
from llmgw_core.events import NodeStatus, ReplicaRecord
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.control_support import all_ready, replicas
from tests.test_gateway import running_gateway
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]


async def nodes_that_run_sim(bus: Bus, n: int) -> bool:
    found = await bus.entries(bus.names.nodes_bucket, NodeStatus)
    running = [
        k
        for k, c in found.items()
        if c.value is not None and any(e.name == "sim" and e.runs for e in c.value.engines)
    ]
    assert len(running) == n, sorted(found)
    return True


async def launcher_back(c: Cluster, bus: Bus, node: str, before: dict[str, ReplicaRecord]) -> bool:
    """The node's new launcher works (its log says it adopted every shard) and every replica is
    ready again at the URL it had."""
    adopted = c.log(f"launcher-{node}").count(": adopted pids ")
    on_node = sum(1 for r in before.values() for m in r.members if m.node == node)
    assert adopted >= on_node, (node, adopted, on_node)
    now = await all_ready(bus, len(before))
    assert {k: r.url for k, r in now.items()} == {k: r.url for k, r in before.items()}
    return True


async def test_an_agent_upgrade_on_every_node_in_turn_costs_no_request(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a launcher away for 10 s had every replica on its node removed and placed
    again (2.9 s of 503s). Each node's launcher is killed and started again in turn, while
    clients send through the gateway: every request answers, no replica is placed again, and no
    engine is restarted. `solo` has one replica: while its launcher is away it is served at the
    URL its engine was last heard ready at."""
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("n1", gpus=2)
        c.start_node("n2", gpus=2)
        # Both nodes known before the first placement, so `chat` is spread over both.
        await eventually(lambda: nodes_that_run_sim(bus, 2), timeout=60, interval=0.3)
        c.start_placement(
            "p1",
            [sim_catalog()],
            [
                {"name": "chat", "profile": "tiny", "replicas": 2, "strategy": "spread"},
                {"name": "solo", "profile": "tiny", "replicas": 1},
            ],
        )
        async with running_gateway(c) as (url, _):
            before = await eventually(lambda: all_ready(bus, 3), timeout=90, interval=0.3)
            assert {m.node for k, r in before.items() if k.startswith("chat.") for m in r.members} == {
                "n1",
                "n2",
            }
            pids = {node: c.engine_pids(node) for node in ("n1", "n2")}
            outcomes: list[tuple[str, int, str]] = []
            done = anyio.Event()

            async def client(model: str) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                    while not done.is_set():
                        r = await http.post(
                            "/v1/chat/completions",
                            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
                        )
                        outcomes.append((model, r.status_code, "" if r.status_code == 200 else r.text))
                        await anyio.sleep(0.02)

            async with anyio.create_task_group() as tg:
                for model in ("chat", "chat", "solo"):
                    tg.start_soon(client, model)
                await eventually(lambda: len(outcomes) >= 10, timeout=30)
                for node in ("n1", "n2"):
                    c.kill(f"launcher-{node}")
                    sent = len(outcomes)

                    # Away long enough for placement to call its replicas' readiness unknown (and
                    # for the gateway to have sent there meanwhile), as an upgrade would be.
                    async def unknown(node: str = node) -> bool:
                        found = await replicas(bus)
                        on_node = [r for r in found.values() if node in {m.node for m in r.members}]
                        assert on_node
                        assert all(r.state == "unknown" and r.url for r in on_node), on_node
                        return True

                    await eventually(unknown, timeout=30, interval=0.1)

                    # Past node_timeout (2 s), and judged alive still: its installer beats.
                    async def past_node_timeout(node: str = node) -> bool:
                        judged = await ctl.liveness(bus)
                        assert judged is not None
                        live = next(n for n in judged.nodes if n.node == node)
                        assert live.alive, live
                        assert live.silent_s > c.node_timeout_s + 0.5, live
                        assert 0 <= live.installer_silent_s < 1.0, live
                        return True

                    await eventually(past_node_timeout, timeout=30, interval=0.1)
                    await eventually(lambda sent=sent: len(outcomes) >= sent + 10, timeout=30)
                    c.respawn(f"launcher-{node}")
                    await eventually(
                        lambda node=node: launcher_back(c, bus, node, before), timeout=90, interval=0.3
                    )
                await eventually(lambda: len(outcomes) >= sent + 10, timeout=30)
                done.set()

            failed = [o for o in outcomes if o[1] != 200]
            assert failed == [], failed[:5]
            assert len(outcomes) >= 40
            assert {m for m, _, _ in outcomes} == {"chat", "solo"}
            assert set(await all_ready(bus, 3)) == set(before), "no replica was placed again"
            assert {node: c.engine_pids(node) for node in ("n1", "n2")} == pids, "no engine restarted"
