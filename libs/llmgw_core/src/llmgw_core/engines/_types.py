"""The data an engine adapter works on: profiles, shard specs, GPUs and commands.

All of it is plain msgspec data, so the same values travel on the bus (a
ShardSpec is the value of a key in the shards bucket) and feed the pure
functions that build argv and environments.
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import msgspec
from msgspec import Struct

# Names and ids that become subject or key tokens: their rules are in `llmgw_core.limits`.
from ..limits import Name, Token
from ._source import weights_key


class GPUInfo(Struct, frozen=True, kw_only=True):
    """One GPU as the node probe saw it."""

    index: int
    name: str
    uuid: str = ""
    # As nvidia-smi prints it ("8.0", "9.0"); kept as text because drivers
    # print "[N/A]" on some virtual GPUs and that must not reject a profile.
    compute_capability: str = ""
    memory_mb: int = 0


class Profile(Struct, frozen=True, kw_only=True):
    """How one model runs on one class of GPU, as the catalog states it."""

    name: Name
    engine: str
    # Where the engine reads the weights. With `model` naming a source (hf://, https://,
    # file://) the node stages them and the engine reads the staged path instead.
    model_path: str = ""
    # The served name, or where the weights come from (`llmgw_core.engines.parse_source`).
    model: str = ""
    gpu_class: str = ""
    tp: int = 1
    pp: int = 1
    nodes: int = 1
    gpus_per_node: int | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = {}
    served_model_name: str = ""
    health_timeout_s: float = 900.0
    # The sha256 an https:// `model` must have.
    model_sha256: str = ""

    @property
    def served_name(self) -> str:
        # A source is not a name a client would ask for.
        named = "" if "://" in self.model else self.model
        return self.served_model_name or named or self.name

    @property
    def weights_key(self) -> str:
        """How nodes name this profile's weights when they report holding them."""
        return weights_key(self.model, self.model_sha256, self.model_path)

    @property
    def per_node_gpus(self) -> int:
        """GPUs each node of the replica must give this profile.

        Unset (or not positive) on one node, it is TP x PP: vLLM and SGLang
        start tp x pp workers on one node, one GPU each. A multi-node profile
        must say it (validation refuses it otherwise).
        """
        if self.gpus_per_node is not None and self.gpus_per_node > 0:
            return self.gpus_per_node
        return self.tp * self.pp if self.nodes == 1 else 0

    def fingerprint(self) -> str:
        """A stable digest of everything that changes the processes started.

        Fields added later count only when set: a profile that does not use them keeps the
        digest it had before they existed, so an upgrade does not replace every replica.
        """
        fields = msgspec.to_builtins(self)
        for late, default in _LATE_DEFAULTS.items():
            if fields.get(late) == default:
                del fields[late]
        return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:16]


_LATE_DEFAULTS: dict[str, object] = {"model_sha256": ""}


class Member(Struct, frozen=True, kw_only=True):
    """One rank of a replica: where it runs and the port it uses between nodes.

    For rank 0 `port` is the rendezvous port (Ray head, SGLang dist-init,
    vLLM master); for other ranks it is their own listening port where the
    engine has one (llama.cpp's RPC server).
    """

    node: Name
    addr: str
    port: int = 0


class ShardSpec(Struct, frozen=True, kw_only=True):
    """The desired state of one shard: one rank of one replica on one node."""

    replica: Token
    shard: Token
    node: Name
    profile: Profile
    rank: int = 0
    gpus: tuple[int, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    members: tuple[Member, ...] = ()
    hcas: tuple[str, ...] = ()
    mgmt_iface: str = ""
    fabric: str = ""
    pool: str = ""
    profile_fp: str = ""
    deployment: str = ""
    # W3C traceparent of the placement that wrote this spec: the launcher's
    # spans join the trace that began with `ctl deploy`.
    traceparent: str = ""
    # Ports of the node's range that the launcher gave the shard beyond `port`,
    # as many as the engine's `extra_ports` asks for (a Ray head's client server).
    # Set by the launcher, like `port` when placement leaves it 0; never by placement.
    extra_ports: tuple[int, ...] = ()

    @property
    def world(self) -> int:
        return max(1, len(self.members))

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def leader(self) -> Member:
        """Rank 0's member entry; a one-node shard is its own leader."""
        if self.members:
            return self.members[0]
        return Member(node=self.node, addr=self.host, port=0)

    def me(self) -> Member:
        if self.members:
            return self.members[self.rank]
        return Member(node=self.node, addr=self.host, port=0)

    def process_view(self) -> ShardSpec:
        """The spec less the fields that do not change any process.

        Pool, fabric name, fingerprint, deployment and trace context are
        bookkeeping: a spec that differs only there is not a reason to restart
        a running engine.
        """
        return msgspec.structs.replace(self, pool="", fabric="", profile_fp="", deployment="", traceparent="")


class Address(Struct, frozen=True):
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class Command(Struct, frozen=True, kw_only=True):
    """One process of a shard, fully resolved: nothing is left to a shell."""

    name: str
    path: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    # Held until every address accepts a TCP connection: a Ray worker waits
    # for its head, a llama.cpp leader waits for its workers' RPC servers.
    wait_for: tuple[Address, ...] = ()

    @property
    def argv(self) -> list[str]:
        return [self.path, *self.args]

    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


# The OpenAI-style paths every engine serves; each adapter's `api_paths` names what its
# server answers beyond them, and the gateway refuses the rest with a 400 naming the engine.
BASE_API_PATHS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/completions"})


class Engine(Protocol):
    """What an engine adapter provides. Adapters build data; they never start a process."""

    @property
    def name(self) -> str: ...

    @property
    def health_path(self) -> str: ...

    @property
    def metrics_path(self) -> str: ...

    def validate(
        self, profile: Profile, gpus: list[GPUInfo], shard: ShardSpec | None = None
    ) -> list[str]: ...

    def commands(self, shard: ShardSpec, environ: dict[str, str] | None = None) -> list[Command]: ...

    def serves_http(self, shard: ShardSpec) -> bool: ...
