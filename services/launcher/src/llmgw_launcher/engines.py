"""The engine adapters of this node: those the operator configured, and the installer's builds."""

from __future__ import annotations

import os
import time
from collections.abc import Collection

from llmgw_core.config import AgentConfig
from llmgw_core.engines import (
    VLLM,
    LlamaCpp,
    LlamaCppConfig,
    Registry,
    SGLang,
    SGLangConfig,
    VLLMConfig,
    default_registry,
)
from llmgw_core.installed import installed

from .workers import Workers

# An engine the operator did not configure is looked for among the installer's builds at
# most this often.
ENGINE_REFRESH_S = 5.0


def registry_for(config: AgentConfig) -> Registry:
    """The adapters, pointed at the engines the operator configured on this node."""
    registry = default_registry()
    for name, engine in config.engines.items():
        if name == "vllm":
            # Ray's sessions under the node's own state dir, one directory per replica.
            ray_temp_root = os.path.join(os.path.abspath(config.state_dir), "ray")
            registry.add(
                VLLM(VLLMConfig(bin_dir=engine.path, multinode=engine.multinode, ray_temp_root=ray_temp_root))
            )
        elif name == "sglang":
            registry.add(SGLang(SGLangConfig(python=os.path.join(engine.path, "python"))))
        elif name == "llamacpp":
            adapter = LlamaCpp(LlamaCppConfig(bin_dir=engine.path))
            adapter.use_installed(engine.path)
            registry.add(adapter)
    return registry


class InstalledBuilds:
    """Points the adapter of an engine the operator did not configure at the installer's build,
    once there is one.

    The installer's markers are files, read in a worker thread, at most once per
    ENGINE_REFRESH_S for each engine: fifty shards placed at once need one look,
    not fifty, and a build installed a moment ago is picked up by the next attempt
    at the latest.
    """

    def __init__(
        self, registry: Registry, configured: Collection[str], state_dir: str, workers: Workers
    ) -> None:
        self.registry = registry
        self.configured = configured
        self.state_dir = state_dir
        self.workers = workers
        self._looked: dict[str, float] = {}

    async def refresh(self, name: str) -> None:
        if name in self.configured:
            return
        at = time.monotonic()
        if at - self._looked.get(name, -ENGINE_REFRESH_S) < ENGINE_REFRESH_S:
            return
        self._looked[name] = at
        build = (await self.workers.files(installed, self.state_dir)).get(name)
        if build is not None:
            self.registry.use_installed(name, build.bin_dir)
