"""The installer service: probe the node, check its engines, report, heartbeat, recheck."""

from __future__ import annotations

import logging

import anyio
import anyio.abc
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.config import AgentConfig
from llmgw_core.errors import BusError
from llmgw_core.events import EngineInventory, EngineState, Heartbeat, NodeFacts, NodeStatus, now
from llmgw_core.probe import Probe

from .engines import configured_engines

log = logging.getLogger("llmgw.installer")

NO_AVX2 = "no AVX2: CPU inference runs several times slower on this node"


def node_facts(config: AgentConfig, probe: Probe | None = None) -> NodeFacts:
    probe = probe or Probe(config.node, model_paths=config.model_paths, mgmt_addr=config.mgmt_addr)
    facts = probe.facts()
    if config.simulate is not None:
        facts = msgspec.structs.replace(
            facts,
            gpus=config.simulate.gpu_list(),
            hcas=config.simulate.hcas,
            simulated=True,
            nvidia_driver=facts.nvidia_driver or ("sim" if config.simulate.gpu_list() else ""),
        )
    return facts


def warnings_for(facts: NodeFacts) -> tuple[str, ...]:
    return () if facts.has_avx2 else (NO_AVX2,)


class Installer:
    def __init__(self, config: AgentConfig, bus: Bus, probe: Probe | None = None) -> None:
        self.config = config
        self.bus = bus
        self.probe = probe
        self.facts: NodeFacts | None = None
        self.engines: tuple[EngineState, ...] = ()
        self.probed_at = 0.0

    async def converge_once(self) -> NodeStatus:
        """Probe, check every engine, and report; returns what was reported."""
        facts = await anyio.to_thread.run_sync(node_facts, self.config, self.probe)
        engines = tuple(await anyio.to_thread.run_sync(configured_engines, self.config))
        self.probed_at = now()
        names = self.bus.names
        node = self.config.node
        if facts != self.facts:
            await self.bus.publish(names.node_facts(node), facts)
        self.facts = facts
        self.engines = engines
        await self.bus.publish(
            names.node_engines(node), EngineInventory(node=node, probed_at=self.probed_at, engines=engines)
        )
        status = NodeStatus(
            node=node,
            facts=facts,
            engines=engines,
            probed_at=self.probed_at,
            warnings=warnings_for(facts),
            updated_at=now(),
        )
        await self.bus.put(names.nodes_bucket, node, status)
        for engine in engines:
            if not engine.runs:
                log.warning("engine %s is %s: %s", engine.name, engine.state, engine.detail)
        return status

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        await self.converge_once()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._heartbeat)
            task_status.started()
            while True:
                await anyio.sleep(self.config.recheck_interval_s)
                try:
                    await self.converge_once()
                except BusError as exc:
                    log.warning("recheck could not report: %s", exc)

    async def _heartbeat(self) -> None:
        subject = self.bus.names.heartbeat(self.config.node)
        while True:
            try:
                await self.bus.publish_core(
                    subject, Heartbeat(node=self.config.node, service="installer", at=now())
                )
            except Exception as exc:  # liveness must never take the installer down
                log.warning("heartbeat failed: %s", exc)
            await anyio.sleep(self.config.heartbeat_interval_s)
