"""llama.cpp: `llama-server`, multi-node through ggml's RPC server on the worker ranks."""

from __future__ import annotations

import os

from msgspec import Struct

from ..adapters import Adapter
from ..events import GPUInfo, Profile, ShardSpec
from ._env import generated_env, materialise
from ._types import BASE_API_PATHS, Address, Command
from ._validate import validate_profile

# The RPC server was renamed; an install has one or the other.
RPC_SERVER_NAMES = ("ggml-rpc-server", "rpc-server")
# Addresses that mean "every interface": never where an RPC server listens.
WILDCARD_ADDRS = frozenset({"", "0.0.0.0", "::", "[::]"})


def device_order(shard: ShardSpec) -> tuple[str, ...]:
    """The leader's devices as llama.cpp orders them, which is the order `-ts` counts in.

    llama.cpp puts RPC devices first (in `--rpc` order), then the node's own GPUs
    (`llama_model_load` in src/llama.cpp: "add RPC servers at the front of the
    list"). Each worker's RPC server offers every GPU its CUDA_VISIBLE_DEVICES
    shows it, or its CPU when it has none; one `-ts` entry per device, so a
    worker with four GPUs is four entries. Workers are named by their address
    (what `--list-devices` prints for an RPC device), local GPUs as CUDA<n>
    (renumbered from 0 under CUDA_VISIBLE_DEVICES). The leader's CPU is not a
    device here: llama.cpp keeps it for what `-ngl` does not offload.
    """
    per_worker = len(shard.gpus) or 1
    remote = tuple(str(Address(m.addr, m.port)) for m in shard.members[1:] for _ in range(per_worker))
    return remote + tuple(f"CUDA{i}" for i in range(len(shard.gpus)))


class LlamaCppConfig(Struct, frozen=True, kw_only=True):
    bin_dir: str = ""
    server: str = "llama-server"
    rpc_server: str = "ggml-rpc-server"


class LlamaCpp:
    name = "llamacpp"
    health_path = "/health"
    metrics_path = "/metrics"
    # llama-server serves OpenAI's Responses API and Anthropic's Messages API beside chat and
    # completions. Not /v1/embeddings: it answers 501 without `--embeddings`, and with it
    # refuses every completion ("This server does not support completions. Start it without
    # `--embeddings`"), so llmgw never passes it to a chat profile, and the gateway answers an
    # embeddings request for llama.cpp with its own 400 naming what the engine serves.
    api_paths = BASE_API_PATHS | {"/v1/responses", "/v1/messages"}

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
        errors = validate_profile(profile, gpus, shard, requires_gpus=False)
        workers = shard.members[1:] if shard is not None else ()
        for rank, m in enumerate(workers, start=1):
            if shard is not None and m.addr.strip() in WILDCARD_ADDRS:
                errors.append(
                    f"shard {shard.shard}: rank {rank} ({m.node}) has address {m.addr or '(none)'!r}; "
                    "llama.cpp's RPC server is unauthenticated and listens only where the leader "
                    "reaches it, never on every interface: set that node's mgmt_addr to its own "
                    "address on the fabric's network"
                )
        return errors

    def serves_http(self, shard: ShardSpec) -> bool:
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        env = materialise(environ, generated_env(shard), profile.env)
        me = shard.me()
        if not shard.is_leader:
            # Workers expose their GPUs to the leader over ggml's RPC protocol;
            # the direction is the reverse of Ray: the leader connects to them.
            # The RPC server has no authentication: it listens on this rank's own
            # address as placement gave it (where the leader reaches it), never on
            # every interface (validate refuses a wildcard).
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
        workers = tuple(Address(m.addr, m.port) for m in shard.members[1:])
        devices = device_order(shard)
        if len(devices) > 1:
            # One node: TP splits each tensor across GPUs (row), PP gives each GPU
            # whole layers. Across nodes always layers: row split is a CUDA
            # feature of one node's GPUs and does not reach RPC devices. `-ts`
            # names every device: llama.cpp zero-fills the ones it omits, and
            # those get no layers at all.
            mode = "row" if profile.pp == 1 and not workers else "layer"
            args += ("-sm", mode, "-ts", ",".join("1" for _ in devices))
        if workers:
            args += ("--rpc", ",".join(str(w) for w in workers))
        args += lora_args(profile.adapters)
        return [
            Command(
                name="llama-server",
                path=self._bin(self.config.server),
                args=(*args, *profile.args),
                env=env,
                wait_for=workers,
            )
        ]


def lora_args(adapters: tuple[Adapter, ...]) -> tuple[str, ...]:
    """`--lora FILE` for each adapter the node staged (a file:// source: the launcher's link to
    it), in order: llama-server numbers them from 0 so, and the gateway finds each one's number
    by its file's name (`/lora-adapters`). `--lora-init-without-apply` says none applies unless
    a request asks; the gateway names every adapter's scale in each request all the same, as
    this build applies them at their scale to a request that names none."""
    paths = [a.source.removeprefix("file://") for a in adapters if a.source.startswith("file://")]
    if not paths:
        return ()
    return (*(x for path in paths for x in ("--lora", path)), "--lora-init-without-apply")
