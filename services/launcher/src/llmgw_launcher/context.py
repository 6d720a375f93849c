"""What every shard runner of a node shares: the node's facts, its shared members and settings."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from llmgw_core.engines import GPUInfo, Registry
from llmgw_core.events import ShardStatus

from .health import HealthProber
from .load import Scraper
from .ports import PortPool
from .records import RecordWriter
from .weights import Weights
from .workers import Workers


@dataclass
class Context:
    """What every runner on a node shares."""

    node: str
    state_dir: Path
    registry: Registry
    gpus: list[GPUInfo]
    records: RecordWriter
    publish: Callable[[ShardStatus], None]
    prober: HealthProber
    # The node's engine ports: handed out, given back.
    ports: PortPool
    mgmt_addr: str = "127.0.0.1"
    stop_grace_s: float = 10.0
    wait_timeout_s: float = 600.0
    backoff_s: float = 1.0
    backoff_cap_s: float = 60.0
    health_interval_s: float = 1.0
    # Engines run this many nice steps below the launcher (see AgentConfig.engine_nice).
    engine_nice: int = 0
    environ: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    # Points an adapter at the build the installer installed, if any.
    refresh_engine: Callable[[str], Awaitable[None]] = field(default=lambda _name: _nothing())
    # The threads that blocking work runs in (one for spawns, a few for files).
    workers: Workers = field(default_factory=Workers)
    # A ready engine's metrics are read this often for its load (0: never), through `scraper`;
    # a load that changed goes out by `publish_quietly` (the status bucket, no event).
    load_interval_s: float = 5.0
    scraper: Scraper | None = None
    publish_quietly: Callable[[ShardStatus], None] | None = None
    # Stages the weights a profile's `model` names (hf://, https://, file://) before its engine starts.
    weights: Weights | None = None
    # Told the path of a model file a shard found missing (see `modelfiles`).
    model_missing: Callable[[str], None] = field(default=lambda _path: None)
    # The host's memory in MB, what CPU profiles are fitted against (0: not known, not checked).
    memory_mb: int = 0


async def _nothing() -> None:
    return None
