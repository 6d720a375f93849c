"""llama.cpp: `llama-server`, multi-node through ggml's RPC server on the worker ranks."""

from __future__ import annotations

import os

from msgspec import Struct

from ._env import generated_env, materialise
from ._types import Address, Command, GPUInfo, Profile, ShardSpec
from ._validate import validate_profile

# The RPC server was renamed; an install has one or the other.
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")


class LlamaCppConfig(Struct, frozen=True, kw_only=True):
    bin_dir: str = ""
    server: str = "llama-server"
    rpc_server: str = "ggml-rpc-server"


class LlamaCpp:
    name = "llamacpp"
    health_path = "/health"
    metrics_path = "/metrics"

    def __init__(self, config: LlamaCppConfig | None = None) -> None:
        self.config = config or LlamaCppConfig()

    def use_installed(self, path: str) -> bool:
        """Run the build installed in `path` (the directory holding llama-server)."""
        rpc = next(
            (n for n in RPC_SERVER_NAMES if os.path.exists(os.path.join(path, n))),
            self.config.rpc_server,
        )
        self.config = LlamaCppConfig(bin_dir=path, server=self.config.server, rpc_server=rpc)
        return True

    def _bin(self, name: str) -> str:
        return os.path.join(self.config.bin_dir, name) if self.config.bin_dir else name

    def validate(self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None) -> list[str]:
        return validate_profile(profile, gpus, shard, requires_gpus=False)

    def serves_http(self, shard: ShardSpec) -> bool:
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        env = materialise(environ, generated_env(shard), profile.env)
        me = shard.me()
        if not shard.is_leader:
            # Workers expose their GPUs to the leader over ggml's RPC protocol;
            # the direction is the reverse of Ray: the leader connects to them.
            return [
                Command(
                    name="rpc-server",
                    path=self._bin(self.config.rpc_server),
                    args=("--host", me.addr, "--port", str(me.port)),
                    env=env,
                )
            ]
        args: tuple[str, ...] = (
            "-m",
            profile.model_path,
            "--host",
            shard.host,
            "--port",
            str(shard.port),
            "--alias",
            profile.served_name,
            "-ngl",
            "999",
            "--metrics",
        )
        if len(shard.gpus) > 1:
            # TP splits each tensor across GPUs (row); PP gives each GPU whole layers.
            mode = "row" if profile.pp == 1 else "layer"
            args += ("-sm", mode, "-ts", ",".join("1" for _ in shard.gpus))
        workers = tuple(Address(m.addr, m.port) for m in shard.members[1:])
        if workers:
            args += ("--rpc", ",".join(str(w) for w in workers))
        return [
            Command(
                name="llama-server",
                path=self._bin(self.config.server),
                args=(*args, *profile.args),
                env=env,
                wait_for=workers,
            )
        ]
