"""SGLang: `python -m sglang.launch_server`, multi-node through its own rendezvous."""

from __future__ import annotations

import os

from msgspec import Struct

from ..events import GPUInfo, Profile, ShardSpec
from ._env import generated_env, materialise
from ._types import BASE_API_PATHS, Command
from ._validate import validate_profile


class SGLangConfig(Struct, frozen=True, kw_only=True):
    # The interpreter of the Python environment SGLang is installed in.
    python: str = "python3"


class SGLang:
    name = "sglang"
    health_path = "/health"
    metrics_path = "/metrics"
    api_paths = BASE_API_PATHS | {"/v1/embeddings", "/v1/responses"}

    def __init__(self, config: SGLangConfig | None = None) -> None:
        self.config = config or SGLangConfig()

    def use_installed(self, path: str) -> bool:
        """Run the environment the installer built from its lock (`path`: its `bin/`)."""
        self.config = SGLangConfig(python=os.path.join(path, "python"))
        return True

    def validate(self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None) -> list[str]:
        return validate_profile(profile, gpus, shard)

    def serves_http(self, shard: ShardSpec) -> bool:
        # Only node rank 0 runs the HTTP server; the others run scheduler
        # processes and never answer on the port.
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        env = materialise(environ, generated_env(shard), profile.env)
        args: tuple[str, ...] = (
            "-m",
            "sglang.launch_server",
            "--model-path",
            profile.model_path,
            "--host",
            shard.host,
            "--port",
            str(shard.port),
            "--tp-size",
            str(profile.tp),
            "--pp-size",
            str(profile.pp),
            "--served-model-name",
            profile.served_name,
            "--enable-metrics",
        )
        if shard.world > 1:
            leader = shard.leader()
            args += (
                "--nnodes",
                str(shard.world),
                "--node-rank",
                str(shard.rank),
                "--dist-init-addr",
                f"{leader.addr}:{leader.port}",
            )
        return [Command(name="sglang", path=self.config.python, args=(*args, *profile.args), env=env)]
