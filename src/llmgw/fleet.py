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

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.engines import GPUInfo, ShardSpec
from llmgw_core.events import EngineState, Heartbeat, NodeFacts, NodeStatus, ShardStatus, now

SIM_ENGINE = EngineState(name="sim", state="configured", version="fleet")


@dataclass
class Fleet:
    bus: Bus
    nodes: list[str]
    gpus_per_node: int = 8
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    heartbeat_interval_s: float = 1.0
    ready: dict[str, ShardStatus] = field(default_factory=dict)
    ready_at: dict[str, float] = field(default_factory=dict)

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
        return NodeStatus(node=node, facts=facts, engines=(SIM_ENGINE,), probed_at=now(), updated_at=now())

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
        """One heartbeat per node per interval, spread over the interval."""
        while True:
            start = time.monotonic()
            for node in self.nodes:
                await self.bus.publish_core(
                    self.bus.names.heartbeat(node, "agent"), Heartbeat(node=node, service="agent", at=now())
                )
            await self.bus.nc.flush()
            await anyio.sleep(max(0.0, self.heartbeat_interval_s - (time.monotonic() - start)))

    async def answer_shards(self) -> None:
        """Every shard placed on a fleet node is reported ready at once; a removed one, stopped."""
        mine = set(self.nodes)
        async for change in self.bus.watch(self.bus.names.shards_bucket, ShardSpec):
            node, _, shard = change.key.partition(".")
            if node not in mine:
                continue
            if change.value is None:
                self.ready.pop(change.key, None)
                await self.bus.delete(self.bus.names.shard_status_bucket, change.key)
                continue
            spec = change.value
            status = ShardStatus(
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
                at=now(),
            )
            await self.bus.put(self.bus.names.shard_status_bucket, change.key, status)
            self.ready[change.key] = status
            self.ready_at[change.key] = time.monotonic()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.register()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.heartbeats)
            tg.start_soon(self.answer_shards)
            task_status.started()


def main(nodes: int, gpus: int, name: str, options: BusOptions) -> int:
    """Run the fleet until Ctrl-C, against the cluster at LLMGW_NATS_URL, as the `fleet` identity
    (`llmgw auth init --fleet`)."""
    from llmgw_core.access import prepare_node
    from llmgw_core.lifecycle import cancel_on_signal

    async def run() -> None:
        async with await Bus.connect(options, service="llmgw-fleet") as bus:
            await prepare_node(bus)
            fleet = Fleet(bus, [f"{name}-{i:05d}" for i in range(nodes)], gpus_per_node=gpus)
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_on_signal, tg.cancel_scope)
                await tg.start(fleet.run)
                print(
                    f"llmgw fleet: {nodes} simulated nodes with {gpus} GPUs each are up; Ctrl-C stops them",
                    flush=True,
                )

    anyio.run(run)
    return 0
