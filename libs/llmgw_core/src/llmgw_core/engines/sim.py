"""The simulated engine's adapter: `python -m llmgw_core.sim`; profile args set its behaviour."""

from __future__ import annotations

import sys

from msgspec import Struct

from ..adapter_rules import max_lora_rank, max_loras
from ..events import GPUInfo, Profile, ShardSpec
from ._env import generated_env, materialise
from ._types import BASE_API_PATHS, Address, Command
from ._validate import validate_profile
from .vllm import kv_events_args, kv_events_wanted


class SimConfig(Struct, frozen=True, kw_only=True):
    # The interpreter that has llmgw_core installed; the agent's own by default.
    python: str = ""


class Sim:
    name = "sim"
    health_path = "/health"
    metrics_path = "/metrics"
    api_paths = BASE_API_PATHS | {"/v1/embeddings", "/v1/messages"}

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()

    def validate(self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None) -> list[str]:
        return validate_profile(profile, gpus, shard, requires_gpus=False)

    def extra_ports(self, shard: ShardSpec) -> int:
        """A profile with `kv_events`: one port, where its KV events go, as vLLM's."""
        return 1 if kv_events_wanted(shard) else 0

    def serves_http(self, shard: ShardSpec) -> bool:
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        env = materialise(environ, generated_env(shard), profile.env)
        python = self.config.python or sys.executable
        leader = shard.leader()
        if not shard.is_leader:
            # Like a Ray worker: held until the leader's rendezvous port answers.
            return [
                Command(
                    name="sim-worker",
                    path=python,
                    args=(
                        "-m",
                        "llmgw_core.sim",
                        "--rank",
                        str(shard.rank),
                        "--world",
                        str(shard.world),
                        "--leader",
                        f"{leader.addr}:{leader.port}",
                    ),
                    env=env,
                    wait_for=(Address(leader.addr, leader.port),),
                )
            ]
        args: tuple[str, ...] = (
            "-m",
            "llmgw_core.sim",
            "--host",
            shard.host,
            "--port",
            str(shard.port),
            "--model",
            profile.served_name,
        )
        if shard.world > 1:
            args += ("--world", str(shard.world), "--dist-port", str(leader.port))
        if profile.adapters:
            # Loaded at run time, as vLLM's are (`sim._lora`).
            args += ("--max-loras", str(max_loras(profile)), "--max-lora-rank", str(max_lora_rank(profile)))
        # vLLM's own KV events flags (`vllm.kv_events_args`): the sim publishes as vLLM does.
        args += kv_events_args(shard)
        return [Command(name="sim", path=python, args=(*args, *profile.args), env=env)]
