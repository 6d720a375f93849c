"""`llmgw fleet`: thousands of simulated node agents in one process, for scale tests.

Each simulated node speaks the real protocol over the real NATS server: it
writes its NodeStatus (simulated GPUs, the sim engine configured), sends
heartbeats, and answers every shard placed on it with a `ready` ShardStatus.
No engine process runs: what is measured is llmgw's control plane.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import anyio
import anyio.abc

from llmgw_core.bus import Bus, BusOptions, Writes
from llmgw_core.engines import GPUInfo, ShardSpec
from llmgw_core.errors import BusError, ConfigError
from llmgw_core.events import EngineState, Heartbeat, NodeFacts, NodeStatus, ShardStatus, now

# Not a value of `Fleet._unwritten` (whose values may be None: a removed shard).
_GONE = object()

SIM_ENGINE = EngineState(name="sim", state="configured", version="fleet")


@dataclass
class Fleet:
    bus: Bus
    nodes: list[str]
    gpus_per_node: int = 8
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    heartbeat_interval_s: float = 1.0
    # Tests only: how far the simulated nodes' clocks run ahead of this machine's (negative:
    # behind), in every time they stamp (heartbeats, statuses), as a node whose time sync broke.
    clock_skew_s: float = 0.0
    ready: dict[str, ShardStatus] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)
    # Answers not yet written (NATS was away): spec, or None for a removed shard.
    _unwritten: dict[str, ShardSpec | None] = field(default_factory=dict)
    _wake: anyio.Event = field(default_factory=anyio.Event)

    def status(self, node: str, index: int) -> NodeStatus:
        gpus = tuple(
            GPUInfo(
                index=i, name=self.gpu_name, uuid=f"GPU-{node}-{i}", compute_capability="9.0", memory_mb=81559
            )
            for i in range(self.gpus_per_node)
        )
        facts = NodeFacts(
            node=node,
            os_id="fleet",
            arch="x86_64",
            cpu_flags=("avx2",),
            cores=64,
            gpus=gpus,
            mgmt_addr=f"10.{index // 65536 % 256}.{index // 256 % 256}.{index % 256}",
            simulated=True,
            nvidia_driver="sim",
        )
        at = self.now()
        return NodeStatus(node=node, facts=facts, engines=(SIM_ENGINE,), probed_at=at, updated_at=at)

    def now(self) -> float:
        """The simulated nodes' wall clock (`clock_skew_s` off this machine's)."""
        return now() + self.clock_skew_s

    async def register(self) -> None:
        """Every node's status in the nodes bucket, a few writes in flight at a time."""
        limiter = anyio.CapacityLimiter(64)

        async def one(index: int, node: str) -> None:
            async with limiter:
                await self.bus.put(self.bus.names.nodes_bucket, node, self.status(node, index))

        async with anyio.create_task_group() as tg:
            for index, node in enumerate(self.nodes):
                tg.start_soon(one, index, node)

    async def heartbeats(self) -> None:
        """One heartbeat per node per interval, spread evenly over the interval (a real fleet's
        nodes are not in step; one burst of every node at once is not what a placement meets)."""
        slices = max(1, min(len(self.nodes), int(self.heartbeat_interval_s / 0.01)))
        per_slice = -(-len(self.nodes) // slices)
        while True:
            start = time.monotonic()
            for i in range(slices):
                for node in self.nodes[i * per_slice : (i + 1) * per_slice]:
                    try:
                        await self.bus.publish_core(
                            self.bus.names.heartbeat(node, "agent"),
                            Heartbeat(node=node, service="agent", at=self.now()),
                        )
                    except BusError:
                        break  # NATS is away: the next interval tries again
                due = start + (i + 1) * self.heartbeat_interval_s / slices
                await anyio.sleep(max(0.0, due - time.monotonic()))

    async def answer_shards(self) -> None:
        """Every shard placed on a fleet node is reported ready at once; a removed one, stopped.

        The shards placed in one control step are answered in one commit (an atomic batch),
        as the many launchers of a real fleet write at the same time. A write that fails
        while NATS is away is retried until it lands, so the fleet converges after an
        outage like a real launcher does."""
        mine = set(self.nodes)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._write_answers)
            async for change in self.bus.watch(self.bus.names.shards_bucket, ShardSpec):
                node, _, _ = change.key.partition(".")
                if node in mine:
                    self._unwritten[change.key] = change.value
                    self._wake.set()

    async def _write_answers(self) -> None:
        names = self.bus.names
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            while self._unwritten:
                pending = dict(self._unwritten)
                writes = Writes()
                answers: dict[str, ShardStatus | None] = {}
                for key, spec in pending.items():
                    if spec is None:
                        writes.delete(names.shard_status_bucket, key)
                        answers[key] = None
                    else:
                        status = answers[key] = self._ready(key, spec, self.now())
                        writes.put(names.shard_status_bucket, key, status)
                try:
                    await self.bus.commit(writes)
                except BusError:
                    await anyio.sleep(0.5)  # NATS is away: try again
                    continue
                at = time.monotonic()
                for key, answer in answers.items():
                    if answer is None:
                        self.ready.pop(key, None)
                    else:
                        self.ready[key] = answer
                        self.ready_at[key] = at
                    if self._unwritten.get(key, _GONE) is pending[key]:
                        del self._unwritten[key]

    @staticmethod
    def _ready(key: str, spec: ShardSpec, at: float) -> ShardStatus:
        node, _, shard = key.partition(".")
        return ShardStatus(
            node=node,
            shard=shard,
            replica=spec.replica,
            deployment=spec.deployment,
            state="ready",
            port=8000,
            url=f"http://{spec.host}:8000" if spec.is_leader else "",
            profile_fp=spec.profile_fp,
            pool=spec.pool,
            fabric=spec.fabric,
            rank=spec.rank,
            at=at,
        )

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.register()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeats)
            tg.start_soon(self.answer_shards)
            task_status.started()


def shard_of(names: list[str], shard: str) -> list[str]:
    """The I-th of N contiguous parts of `names`, for `--shard I/N`."""
    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ConfigError(f"--shard {shard}: expected I/N with 0 <= I < N, e.g. 0/4")
    size = -(-len(names) // n)
    return names[i * size : (i + 1) * size]


def main(nodes: int, gpus: int, name: str, options: BusOptions, *, shard: str = "0/1") -> int:
    """Run the fleet until Ctrl-C, against the cluster at LLMGW_NATS_URL, as the `fleet` identity
    (`llmgw auth init --fleet`)."""
    from llmgw_core.bus import prepare_node
    from llmgw_core.lifecycle import cancel_on_signal
    from llmgw_core.limits import name_problem

    # The last id is the longest: if it is a node id, every one is.
    problem = name_problem("node id", f"{name}-{max(0, nodes - 1):05d}") if nodes else None
    if problem is not None:
        raise ConfigError(f"--name: {problem}")
    mine = shard_of([f"{name}-{i:05d}" for i in range(nodes)], shard)

    async def run() -> None:
        async with await Bus.connect(options, service="llmgw-fleet") as bus:
            await prepare_node(bus)
            fleet = Fleet(bus, mine, gpus_per_node=gpus)
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_signal, tg.cancel_scope)
                await tg.start(fleet.run)
                print(
                    f"llmgw fleet: {len(mine)} simulated nodes with {gpus} GPUs each are up "
                    f"(part {shard}); Ctrl-C stops them",
                    flush=True,
                )

    anyio.run(run)
    return 0
