"""vLLM: `vllm serve` on one node, Ray or vLLM's native multi-node mode across nodes."""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path
from typing import Literal

from msgspec import Struct

from ._env import generated_env, materialise
from ._types import Address, Command, GPUInfo, Profile, ShardSpec
from ._validate import validate_profile

# vLLM's own multi-node mode (`--nnodes/--node-rank/--master-addr`, `--headless`
# on the other ranks; vllm-project/vllm#23691) is in every release from 0.11.1.
NATIVE_MULTINODE_SINCE = (0, 11, 1)

Multinode = Literal["auto", "ray", "native"]


class VLLMConfig(Struct, frozen=True, kw_only=True):
    # The Python environment vLLM is installed in; `vllm` and `ray` are its scripts.
    bin_dir: str = ""
    # "auto": vLLM's native multi-node mode when the environment's vLLM has it
    # (read from its package metadata), a Ray cluster per replica otherwise.
    # "ray" or "native" force one (every node of a replica must agree).
    multinode: Multinode = "auto"


def installed_version(bin_dir: str) -> str | None:
    """The version of the `vllm` package in the environment whose scripts are in `bin_dir`.

    Read from the environment's own package metadata (`lib/python3.*/site-packages`
    next to `bin/`), so nothing is started: importing vLLM takes seconds and a GPU
    driver. None when there is no environment or no vLLM in it.
    """
    if not bin_dir:
        return None
    prefix = Path(bin_dir).parent
    paths = sorted(
        str(p)
        for pattern in ("lib/python3*/site-packages", "lib64/python3*/site-packages")
        for p in prefix.glob(pattern)
    )
    if not paths:
        return None
    for dist in importlib.metadata.distributions(name="vllm", path=paths):
        version = dist.version
        if version:
            return str(version)
    return None


def release_of(version: str) -> tuple[int, ...]:
    """`"0.11.1rc2.dev5+g1234.cu128"` -> (0, 11, 1): the release numbers, nothing after them."""
    match = re.match(r"v?(\d+(?:\.\d+)*)", version.strip())
    return tuple(int(n) for n in match.group(1).split(".")) if match else ()


def multinode_mode(config: VLLMConfig) -> Literal["ray", "native"]:
    """How this node runs a multi-node replica: the configured mode, or detected from the installed vLLM."""
    if config.multinode != "auto":
        return config.multinode
    version = installed_version(config.bin_dir)
    if version is not None and release_of(version) >= NATIVE_MULTINODE_SINCE:
        return "native"
    # Unknown or older: Ray, which every vLLM that runs on several nodes supports.
    return "ray"


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
        if shard.world > 1 and multinode_mode(self.config) == "ray":
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
            # The server waits for its own head too: started before the head
            # listens, `vllm serve` starts a Ray of its own (or sees only this
            # node's GPUs) instead of joining the replica's cluster.
            return [
                head,
                self._serve(
                    shard,
                    env,
                    ("--distributed-executor-backend", "ray"),
                    wait_for=(Address(leader.addr, leader.port),),
                ),
            ]
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

    def _serve(
        self,
        shard: ShardSpec,
        env: tuple[tuple[str, str], ...],
        extra: tuple[str, ...],
        wait_for: tuple[Address, ...] = (),
    ) -> Command:
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
        return Command(name="vllm", path=self._bin("vllm"), args=args, env=env, wait_for=wait_for)
