"""Failover when a node is cut off by the network against when it is killed, in the same run,
each under steady requests through a gateway: how long until a replica is ready elsewhere, and
how many requests failed. Every process on a host of its own (network namespaces: needs
CAP_NET_ADMIN, `tests/multihost`).

    python -m bench.partitions [--quick]      prints the section and writes it to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import httpx

from bench.__main__ import ROOT, machine, replace_section
from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from tests.cluster_support import sim_catalog
from tests.multihost.fleet import Fleet
from tests.multihost.hosts import Hosts, net_admin_problem, open_hosts

NODE_TIMEOUT_S = 3.0
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TITLE = "## Partitions: failover when a node is cut off, against killed"


async def _ready(bus: Bus, timeout: float = 120) -> dict[str, str]:
    """The one ready replica of chat: {key: node}."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
        except Exception:  # the bucket not made yet, a reconnect
            found = {}
        ready = {k: c.value.members[0].node for k, c in found.items() if c.value and c.value.state == "ready"}
        if len(ready) == 1:
            return ready
        await anyio.sleep(0.05)
    raise TimeoutError("no replica of chat ready")


async def _load(url: str, stop: anyio.Event, results: list[tuple[float, int]]) -> None:
    """A request every 0.1 s, whatever the ones before became (each given 30 s), until `stop`;
    returns once every one sent is answered or failed."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=1000)) as client:

        async def one() -> None:
            sent = time.monotonic()
            try:
                status = (await client.post(f"{url}/v1/chat/completions", json=CHAT)).status_code
            except httpx.HTTPError:
                status = 0
            results.append((sent, status))

        async with anyio.create_task_group() as tg:
            while not stop.is_set():
                tg.start_soon(one)
                await anyio.sleep(0.1)


async def _round(net: Hosts, fleet: Fleet, bus: Bus, gateway: str, how: str) -> tuple[float, int, int]:
    """One fault of the node holding the replica: seconds to a ready replica elsewhere, and
    requests failed and sent from the fault until 3 s after it."""
    [(key, node)] = (await _ready(bus)).items()
    host = net["d" if node == "n1" else "e"]
    stop, results = anyio.Event(), list[tuple[float, int]]()
    async with anyio.create_task_group() as tg:
        tg.start_soon(_load, gateway, stop, results)
        await anyio.sleep(2)
        at = time.monotonic()
        if how == "cut":
            host.cut()
        else:
            host.stop()  # kill -9 its agents and every engine they started
        while True:
            moved = await _ready(bus)
            if key not in moved:
                break
            await anyio.sleep(0.05)
        failover = time.monotonic() - at
        await anyio.sleep(3)
        stop.set()
    during = [s for t, s in results if at <= t <= at + failover + 3]
    if how == "cut":
        host.heal()
    else:
        fleet.start_node(host.name, node)
    return failover, sum(1 for s in during if s != 200), len(during)


async def _measure(root: Path, rounds: int) -> dict[str, list[tuple[float, int, int]]]:
    net = open_hosts(root, ("a", "b", "c", "p", "d", "e", "g"))
    fleet = Fleet(net, prefix="b" + uuid.uuid4().hex[:10], node_timeout_s=NODE_TIMEOUT_S)
    try:
        fleet.start_nats(("a", "b", "c"))
        fleet.start_placement(
            "p", "p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}]
        )
        fleet.start_node("d", "n1")
        fleet.start_node("e", "n2")
        fleet.start_gateway("g", "g1")
        gateway = await fleet.gateway_url("g1")
        found: dict[str, list[tuple[float, int, int]]] = {"cut": [], "killed": []}
        async with fleet.bus() as bus:
            await _ready(bus)
            # Alternated, so that a busy moment of the machine falls on both.
            for _ in range(rounds):
                for how in ("cut", "killed"):
                    found[how].append(await _round(net, fleet, bus, gateway, how))
                    await anyio.sleep(NODE_TIMEOUT_S * 2)  # the healed or restarted node heard again
        return found
    finally:
        fleet.close()
        net.close()


def run(quick: bool = False) -> str:
    problem = net_admin_problem()
    if problem:
        return f"{TITLE}\n\nNot measured: {problem}.\n"
    with tempfile.TemporaryDirectory() as d:
        found = anyio.run(_measure, Path(d), 1 if quick else 3)
    labels = {"cut": "cut off (iptables DROP, both ways)", "killed": "killed (`kill -9`, its engines too)"}
    lines = [
        TITLE,
        "",
        f"`python -m bench.partitions`: 3-server NATS, placement, gateway and two nodes each on a host of "
        f"its own (network namespaces), one sim replica, node_timeout {NODE_TIMEOUT_S:g} s, heartbeat "
        f"0.3 s; a request every 0.1 s through the gateway (30 s each); the node holding the "
        f"replica is cut off or killed, alternately, {len(found['cut'])} times each. Figures: median "
        "(min–max) seconds from the fault to a ready replica elsewhere; requests sent from the fault "
        "until 3 s after it that failed.",
        "",
        "| the node | failover (s) | requests failed | requests sent |",
        "|---|---|---|---|",
    ]
    for how, rows in found.items():
        times = [r[0] for r in rows]
        lines.append(
            f"| {labels[how]} | {statistics.median(times):.1f} ({min(times):.1f}–{max(times):.1f}) | "
            f"{sum(r[1] for r in rows)} | {sum(r[2] for r in rows)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.partitions")
    parser.add_argument("--quick", action="store_true", help="one round of each")
    args = parser.parse_args()
    section = run(quick=args.quick)
    print(section)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    title, _, body = section.partition("\n")
    stamp = f"Run on its own by `python -m bench.partitions` on {when}, on {machine()}."
    path = ROOT / "BENCHMARKS.md"
    path.write_text(replace_section(path.read_text(), title, f"{title}\n\n{stamp}\n{body}"))


if __name__ == "__main__":
    main()
