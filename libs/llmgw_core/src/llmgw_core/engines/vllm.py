"""vLLM: `vllm serve` on one node, Ray or vLLM's native multi-node mode across nodes."""

from __future__ import annotations

import os
from typing import Literal

from msgspec import Struct

from ._env import generated_env, materialise
from ._types import Address, Command, GPUInfo, Profile, ShardSpec
from ._validate import validate_profile


class VLLMConfig(Struct, frozen=True, kw_only=True):
    # The Python environment vLLM is installed in; `vllm` and `ray` are its scripts.
    bin_dir: str = ""
    # "ray": a Ray cluster per replica (head on rank 0, workers join it).
    # "native": vLLM's own multi-node mode (vLLM >= 0.11.1: --nnodes/--node-rank).
    multinode: Literal["ray", "native"] = "ray"


class VLLM:
    name = "vllm"
    health_path = "/health"
    metrics_path = "/metrics"

    def __init__(self, config: VLLMConfig | None = None) -> None:
        self.config = config or VLLMConfig()

    def _bin(self, name: str) -> str:
        return os.path.join(self.config.bin_dir, name) if self.config.bin_dir else name

    def validate(self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None) -> list[str]:
        return validate_profile(profile, gpus, shard)

    def serves_http(self, shard: ShardSpec) -> bool:
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        gen = generated_env(shard)
        if shard.world > 1:
            # vLLM binds its distributed runtime to this address; the default
            # guess is the first interface, which on GPU servers is often not
            # the one the peers can reach.
            gen["VLLM_HOST_IP"] = shard.me().addr
        env = materialise(environ, gen, profile.env)
        leader = shard.leader()
        if shard.world > 1 and self.config.multinode == "ray":
            if not shard.is_leader:
                return [
                    Command(
                        name="ray-worker",
                        path=self._bin("ray"),
                        args=(
                            "start",
                            f"--address={leader.addr}:{leader.port}",
                            f"--node-ip-address={shard.me().addr}",
                            "--block",
                        ),
                        env=env,
                        wait_for=(Address(leader.addr, leader.port),),
                    )
                ]
            head = Command(
                name="ray-head",
                path=self._bin("ray"),
                args=(
                    "start",
                    "--head",
                    f"--port={leader.port}",
                    f"--node-ip-address={leader.addr}",
                    "--block",
                ),
                env=env,
            )
            return [head, self._serve(shard, env, ("--distributed-executor-backend", "ray"))]
        # vLLM 0.11.1 stopped guessing Ray when a cluster is around: say which
        # executor to use every time, so an upgrade does not change behaviour.
        extra: tuple[str, ...] = ("--distributed-executor-backend", "mp")
        if shard.world > 1:
            extra += (
                "--nnodes",
                str(shard.world),
                "--node-rank",
                str(shard.rank),
                "--master-addr",
                leader.addr,
                "--master-port",
                str(leader.port),
            )
            if not shard.is_leader:
                extra += ("--headless",)
        return [self._serve(shard, env, extra)]

    def _serve(self, shard: ShardSpec, env: tuple[tuple[str, str], ...], extra: tuple[str, ...]) -> Command:
        profile = shard.profile
        args = (
            "serve",
            profile.model_path,
            "--host",
            shard.host,
            "--port",
            str(shard.port),
            "--served-model-name",
            profile.served_name,
            "--tensor-parallel-size",
            str(profile.tp),
            "--pipeline-parallel-size",
            str(profile.pp),
            *extra,
            *profile.args,
        )
        return Command(name="vllm", path=self._bin("vllm"), args=args, env=env)
