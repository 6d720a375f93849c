"""Failover when a node is cut off by the network against when it is killed, in the same run,
each under steady requests through a gateway: how long until a replica is ready elsewhere, how
many requests failed, and how long from the heal (the killed node started again) until the
cluster has converged: the node's old engine stopped, the wanted count of replicas ready, and
no replica doubled (read as `tests/multihost/checker.py` reads a run: the replicas bucket and
each node's launcher records with their live pids; the checker itself runs over the whole
run's history at the end). Every process on a host of its own (network namespaces: needs
CAP_NET_ADMIN, `tests/multihost`).

    python -m bench.partitions [--quick]      prints the section and writes it to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from bench._report import write_alone
from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaRecord
from tests.cluster_support import sim_catalog
from tests.multihost.checker import check
from tests.multihost.fleet import Fleet
from tests.multihost.history import engines, read
from tests.multihost.hosts import Hosts, net_admin_problem, open_hosts

NODE_TIMEOUT_S = 3.0
CHAT = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
TITLE = "## Partitions: failover when a node is cut off, against killed"
WANTED = 1  # replicas of chat
CONVERGE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Round:
    failover_s: float
    failed: int
    sent: int
    converged_s: float | None  # None: not converged within CONVERGE_TIMEOUT_S


@dataclass
class Found:
    rounds: dict[str, list[Round]] = field(default_factory=lambda: {"cut": [], "killed": []})
    violations: list[str] = field(default_factory=list)


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


def _running(state_dirs: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every shard whose engine still runs, on the nodes whose launcher state is in `state_dirs`:
    {shard key: live pids}, from the launchers' records as the checker reads them."""
    found: dict[str, tuple[int, ...]] = {}
    for state_dir in state_dirs:
        for engine in engines(state_dir)[0]:
            if engine.running:
                found[engine.key] = engine.running
    return found


async def _converged(bus: Bus, state_dirs: list[Path], old: set[int], since: float) -> float | None:
    """Seconds from `since` until the engines of `old` (pids) are stopped, WANTED replicas of chat
    are ready, and exactly WANTED engines run across the nodes (none doubled); None if that does
    not hold within CONVERGE_TIMEOUT_S."""
    while time.monotonic() < since + CONVERGE_TIMEOUT_S:
        try:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
        except Exception:  # a reconnect: the next look
            found = {}
        ready = sum(1 for c in found.values() if c.value and c.value.state == "ready")
        running = _running(state_dirs)
        left = old & {pid for pids in running.values() for pid in pids}
        if ready == WANTED and len(running) == WANTED and not left:
            return time.monotonic() - since
        await anyio.sleep(0.1)
    return None


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


async def _round(net: Hosts, fleet: Fleet, bus: Bus, gateway: str, how: str) -> Round:
    """One fault of the node holding the replica: seconds to a ready replica elsewhere, requests
    failed and sent from the fault until 3 s after it, and seconds from the heal (the restart)
    to converged."""
    [(key, node)] = (await _ready(bus)).items()
    host = net["d" if node == "n1" else "e"]
    state_dirs = [net["d"].state / "n1", net["e"].state / "n2"]
    old = {pid for pids in _running([host.state / node]).values() for pid in pids}
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
    healed = time.monotonic()
    if how == "cut":
        host.heal()
    else:
        fleet.start_node(host.name, node)
    converged = await _converged(bus, state_dirs, old, healed)
    return Round(failover, sum(1 for s in during if s != 200), len(during), converged)


async def _measure(root: Path, rounds: int) -> Found:
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
        found = Found()
        async with fleet.bus() as bus:
            await _ready(bus)
            # Alternated, so that a busy moment of the machine falls on both.
            for _ in range(rounds):
                for how in ("cut", "killed"):
                    found.rounds[how].append(await _round(net, fleet, bus, gateway, how))
                    await anyio.sleep(NODE_TIMEOUT_S * 2)  # the healed or restarted node heard again
            history = await read(bus, [net["d"].state / "n1", net["e"].state / "n2"])
            found.violations = [str(v) for v in check(history)]
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
        f"replica is cut off or killed, alternately, {len(found.rounds['cut'])} times each. Figures: median "
        "(min–max) seconds from the fault to a ready replica elsewhere; requests sent from the fault "
        "until 3 s after it that failed; median (min–max) seconds from the heal (the killed node's "
        "agents started again) until converged: the node's old engine stopped, "
        f"{WANTED} replica of chat ready in the replicas bucket and {WANTED} engine running across "
        "the nodes' launcher records (none doubled), polled every 0.1 s.",
        "",
        "| the node | failover (s) | requests failed | requests sent | heal to converged (s) |",
        "|---|---|---|---|---|",
    ]
    for how, rows in found.rounds.items():
        lines.append(
            f"| {labels[how]} | {_spread([r.failover_s for r in rows])} | {sum(r.failed for r in rows)} | "
            f"{sum(r.sent for r in rows)} | {_spread([r.converged_s for r in rows])} |"
        )
    lines.append("")
    if found.violations:
        lines.append(f"The checker over the run's history: {len(found.violations)} violation(s):")
        lines += [f"- {v.splitlines()[0]}" for v in found.violations[:10]]
    else:
        lines.append(
            "The checker (`tests/multihost/checker.py`) over the run's history: no replica placed twice, "
            "no GPU held twice, no engine left running whose shard spec is gone."
        )
    return "\n".join(lines) + "\n"


def _spread(values: list[float | None]) -> str:
    """Median (min–max), and how many never came where some did not."""
    done = [v for v in values if v is not None]
    if not done:
        return f"none within {CONVERGE_TIMEOUT_S:g}"
    text = f"{statistics.median(done):.1f} ({min(done):.1f}–{max(done):.1f})"
    missed = len(values) - len(done)
    return text + (f", {missed} not within {CONVERGE_TIMEOUT_S:g}" if missed else "")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.partitions")
    parser.add_argument("--quick", action="store_true", help="one round of each")
    args = parser.parse_args()
    section = run(quick=args.quick)
    print(section)
    write_alone(section, "python -m bench.partitions" + (" --quick" if args.quick else ""))


if __name__ == "__main__":
    main()
