"""A chaos soak of a whole llmgw cluster on this machine: `python -m tests.chaos --seed N --seconds S`.

Real processes throughout: a nats-server, two placements, three nodes (installer
and launcher each, sim engines on simulated GPUs). For `--seconds`, faults are
drawn from the seed: `kill -9` and SIGSTOP/SIGCONT of agents, placements and
NATS, and deployments created, scaled, deleted and their profiles edited.
Every fault is printed with its time, so a run is replayed by its seed. Then
faults stop, everything killed is started again, and the soak checks what an
operator would: every deployment at its count and ready, no engine process
without a shard, no GPU held by two shards, both placements alive, no
replica id placed twice.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anyio
import msgspec

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.errors import BusError
from llmgw_core.events import Deployment, PlacementDecision, ReplicaRecord
from llmgw_core.natsd import NatsServer
from llmgw_launcher.records import Records
from tests.cluster_support import Cluster, sim_catalog

NODES = ("node-a", "node-b", "node-c")
DEPLOYMENTS = ("chat", "code", "docs")
GPUS_PER_NODE = 4


class Soak:
    def __init__(self, root: Path, seed: int, seconds: float) -> None:
        self.root = root
        self.rng = random.Random(seed)
        self.seed = seed
        self.seconds = seconds
        self.nats = NatsServer(store_dir=root / "nats", log_path=root / "nats.log")
        self.faults: list[str] = []
        self.t0 = time.monotonic()
        self.stopped: set[str] = set()

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.2f}s] {text}"
        self.faults.append(line)
        print(line, flush=True)

    async def run(self) -> list[str]:
        """Run the soak; returns the problems found (empty when the cluster converged)."""
        self.nats.start()
        prefix = f"chaos{self.seed}"
        c = Cluster(root=self.root, nats_url=self.nats.url, prefix=prefix)
        bus = await Bus.connect(BusOptions(url=self.nats.url, prefix=prefix, insecure=True), service="chaos")
        try:
            await bus.ensure()
            for node in NODES:
                c.start_node(node, gpus=GPUS_PER_NODE)
            deployments = [{"name": "chat", "profile": "tiny", "replicas": 2}]
            c.start_placement("p1", [sim_catalog()], deployments)
            c.start_placement("p2", [sim_catalog()], deployments)
            print(
                f"chaos soak: seed {self.seed}, {self.seconds:g} s of faults, logs in {self.root}", flush=True
            )
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline:
                await self.fault(c, bus)
                await anyio.sleep(self.rng.uniform(0.5, 3.0))
            self.say("faults stop; everything stopped or killed starts again")
            self.heal(c)
            problems = await self.converged(bus, c)
            return problems
        finally:
            with anyio.CancelScope(shield=True):
                await bus.close()
            for name in list(self.stopped):
                self._signal(c, name, signal.SIGCONT)
            c.close()
            self.nats.stop()

    # --- faults -------------------------------------------------------------------

    def processes(self, c: Cluster) -> list[str]:
        return sorted(c.argv)

    def _signal(self, c: Cluster, name: str, sig: signal.Signals) -> None:
        if name == "nats":
            assert self.nats.proc is not None
            os.kill(self.nats.proc.pid, sig)
            return
        proc = c.procs.get(name)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    async def fault(self, c: Cluster, bus: Bus) -> None:
        roll = self.rng.random()
        if roll < 0.35:
            await self.desired_state_change(bus)
            return
        name = self.rng.choice([*self.processes(c), "nats"])
        if name in self.stopped:
            self._signal(c, name, signal.SIGCONT)
            self.stopped.discard(name)
            self.say(f"SIGCONT {name}")
        elif roll < 0.7:
            self.say(f"kill -9 {name}")
            if name == "nats":
                assert self.nats.proc is not None
                self.nats.proc.kill()
                self.nats.stop()
                await anyio.sleep(self.rng.uniform(0.5, 4.0))
                self.nats.start()
                self.say("nats started again")
            else:
                c.kill(name)
                await anyio.sleep(self.rng.uniform(0.2, 3.0))
                c.respawn(name)
                self.say(f"{name} started again")
        else:
            self._signal(c, name, signal.SIGSTOP)
            self.stopped.add(name)
            self.say(f"SIGSTOP {name}")

    async def desired_state_change(self, bus: Bus) -> None:
        name = self.rng.choice(DEPLOYMENTS)
        roll = self.rng.random()
        try:
            if roll < 0.55:
                replicas = self.rng.randint(0, 2)
                await bus.put(
                    bus.names.deployments_bucket,
                    name,
                    Deployment(name=name, profile="tiny", replicas=replicas),
                )
                self.say(f"deploy {name} x{replicas}")
            elif roll < 0.8:
                await bus.delete(bus.names.deployments_bucket, name)
                self.say(f"delete {name}")
            else:
                tps = self.rng.choice([50, 100, 200])
                profile = msgspec.convert(sim_catalog("--tokens-per-second", str(tps)), Profile)
                await bus.put(bus.names.catalog_bucket, "tiny", profile)
                self.say(f"catalog: tiny at {tps} tokens/s")
        except BusError as exc:
            self.say(f"(the change was refused while NATS is away: {exc})")

    def heal(self, c: Cluster) -> None:
        for name in sorted(self.stopped):
            self._signal(c, name, signal.SIGCONT)
        self.stopped.clear()
        if self.nats.proc is None or self.nats.proc.poll() is not None:
            self.nats.start()
        for name in self.processes(c):
            proc = c.procs.get(name)
            if proc is None or proc.poll() is not None:
                c.respawn(name)

    # --- the end state --------------------------------------------------------------

    async def converged(self, bus: Bus, c: Cluster, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        problems: list[str] = []
        while time.monotonic() < deadline:
            try:
                problems = await self.check(bus, c)
            except BusError as exc:
                problems = [f"cannot read the cluster: {exc}"]
            if not problems:
                self.say("converged")
                return []
            await anyio.sleep(1.0)
        return problems

    async def check(self, bus: Bus, c: Cluster) -> list[str]:
        problems = []
        deployments = {
            k: v.value
            for k, v in (await bus.entries(bus.names.deployments_bucket, Deployment)).items()
            if v.value
        }
        records = [
            v.value for v in (await bus.entries(bus.names.replicas_bucket, ReplicaRecord)).values() if v.value
        ]
        shards = {
            k: v.value for k, v in (await bus.entries(bus.names.shards_bucket, ShardSpec)).items() if v.value
        }
        ready = Counter(r.deployment for r in records if r.state == "ready")
        for name, dep in sorted(deployments.items()):
            if ready[name] != dep.replicas:
                problems.append(f"{name}: {ready[name]} of {dep.replicas} ready")
        for r in records:
            if r.deployment not in deployments:
                problems.append(f"replica {r.deployment}.{r.replica} of a deleted deployment")
        held: Counter[tuple[str, int]] = Counter((s.node, g) for s in shards.values() for g in s.gpus)
        problems += [f"GPU {g} of {n} held by {k} shards" for (n, g), k in held.items() if k > 1]
        for node in NODES:
            running, _ = Records(self.root / node).load_all()
            for key, record in sorted(running.items()):
                alive = [p.pid for p in record.procs if _alive(p.pid)]
                if alive and key not in shards:
                    problems.append(f"engine pids {alive} on {node} run shard {key}, which is not placed")
        for name in ("placement-p1", "placement-p2"):
            proc = c.procs.get(name)
            if proc is None or proc.poll() is not None:
                problems.append(f"{name} is not running")
        placed = await _placed(bus)
        dupes = [k for k, n in Counter(placed).items() if n > 1]
        problems += [f"replica id {k} placed {Counter(placed)[k]} times" for k in dupes]
        return problems


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _placed(bus: Bus) -> list[str]:
    """`deployment.replica` of every placement decision that placed, from the events stream."""
    decisions = await bus.history(bus.names.placement_event("*"), PlacementDecision)
    return [f"{d.deployment}.{d.replica}" for d in decisions if d.outcome == "placed"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--seed", type=int, default=random.randrange(1 << 20))
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--dir", default="", help="where logs go (default: a new temporary directory)")
    args = parser.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="llmgw-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    problems = anyio.run(Soak(root, args.seed, args.seconds).run)
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    print(f"chaos soak seed {args.seed}: {'converged' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
