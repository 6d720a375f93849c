"""Every message llmgw puts on the bus: KV values and events.

Schema evolution (old readers must accept new writers):
- new fields go last and have defaults; a field is never retyped;
- unknown fields are ignored on decode (msgspec's default; never forbid them);
- every value is tagged with `kind` so a misrouted message fails loudly.

Times are Unix seconds (float) in UTC, as the writer's clock saw them.
"""

from __future__ import annotations

import hashlib
import time
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

# Names and ids that become subject or key tokens: their rules are in `llmgw_core.limits`.
from .adapters import ADAPTERS_MAX, Adapter, AdapterQuota, ServedAdapter
from .limits import Aliases, Name, Token
from .sources import ModelRef, ModelSource, SourceError, node_file, parse_model, staged_key, weights_key

__all__ = [
    "Autoscale",
    "Demand",
    "Deployment",
    "DeploymentDemand",
    "DeploymentStatus",
    "DesiredEngines",
    "EngineInventory",
    "EngineLoad",
    "EngineSpec",
    "EngineState",
    "GPUInfo",
    "Heartbeat",
    "InstallProgress",
    "Judgement",
    "Liveness",
    "Member",
    "ModelShape",
    "NetInterface",
    "NodeFacts",
    "NodeIntent",
    "NodeLifecycle",
    "NodeLiveness",
    "NodeReason",
    "NodeStatus",
    "PlacementDecision",
    "Profile",
    "ReplicaInFlight",
    "ReplicaJudgement",
    "ReplicaRecord",
    "ReplicaStatus",
    "ScaleDecision",
    "ShardFailure",
    "ShardLogs",
    "ShardLogsRequest",
    "ShardSpec",
    "ShardState",
    "ShardStatus",
    "WeightsEvicted",
    "WeightsOffer",
    "WeightsQuery",
    "decoder",
    "encode",
    "now",
]


def now() -> float:
    return time.time()


class Message(Struct, frozen=True, kw_only=True, tag_field="kind", tag=True):
    """Base of every bus message; `kind` is the class name."""


# --- profiles and shard specs: what placement asks a node to run --------------


# The bounds of a node's own figures: a GPU of 10**400 MB, or a host of -1 cores, is a broken
# or hostile status, never a machine; a node status that carries one does not decode.
NODE_MAX_GPUS = 4096  # a GPU's index
NODE_MAX_MB = 2**30  # 1 PiB of GPU or host memory
NODE_MAX_CORES = 2**20
GPUIndex = Annotated[int, Meta(ge=0, lt=NODE_MAX_GPUS)]
NodeMB = Annotated[int, Meta(ge=0, le=NODE_MAX_MB)]


class GPUInfo(Struct, frozen=True, kw_only=True):
    """One GPU as the node probe saw it."""

    index: GPUIndex
    name: str
    uuid: str = ""
    # As nvidia-smi prints it ("8.0", "9.0"); kept as text because drivers
    # print "[N/A]" on some virtual GPUs and that must not reject a profile.
    compute_capability: str = ""
    memory_mb: NodeMB = 0


class Profile(Struct, frozen=True, kw_only=True):
    """How one model runs on one class of GPU, as the catalog states it.

    `model` is read as one value (`model_ref`: the served name, or the source, or why neither),
    parsed once per text where a profile first enters (a config loaded, an API write, `ctl
    apply`, a spec decoded from the bus) and kept (`sources.parse_model`); its readers take
    `source`, `served_name` or the keys, never the text.
    """

    name: Name
    engine: str
    # Where the engine reads the weights. With `model` naming a source (hf://, https://,
    # file://) the node stages them and the engine reads the staged path instead.
    model_path: str = ""
    # The served name, or where the weights come from (`llmgw_core.sources`): read as `model_ref`.
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
    # LoRA adapters served on this profile's replicas (`llmgw_core.adapters`), sorted by name:
    # each node stages their files, and the engine loads them beside the base.
    adapters: Annotated[tuple[Adapter, ...], Meta(max_length=ADAPTERS_MAX)] = ()
    # vLLM: publish the engine's KV cache events (on a port of the node's range) for the
    # launcher to relay what each replica holds into the routing state (docs/gateway.md).
    kv_events: bool = False
    # vLLM (and the simulator): adapters one replica holds at once, and the largest rank it
    # serves (`--max-loras`, `--max-lora-rank`); 0: llmgw's defaults (`adapters.max_loras`).
    max_loras: Annotated[int, Meta(ge=0, le=ADAPTERS_MAX)] = 0
    max_lora_rank: Annotated[int, Meta(ge=0, le=512)] = 0

    @property
    def model_ref(self) -> ModelRef:
        """`model` parsed: the served name it gives, or the source it names, or why neither."""
        return parse_model(self.model, self.model_sha256, self.name)

    @property
    def source(self) -> ModelSource | None:
        """Where the node stages the weights from; None where `model` is the served name (the
        weights are at `model_path`). Raises SourceError, naming the profile, for a source that
        cannot be staged."""
        ref = self.model_ref
        if ref.error is not None:
            # A new error each time: the kept one raised again would gather every raiser's frames.
            raise SourceError(ref.error.words, profile=ref.error.profile)
        return ref.source

    @property
    def served_name(self) -> str:
        # A source is not a name a client would ask for.
        return self.served_model_name or self.model_ref.name or self.name

    @property
    def weights_key(self) -> str:
        """How nodes name this profile's weights when they report holding them."""
        return weights_key(self.model, self.model_sha256, self.model_path)

    @property
    def staged_key(self) -> str:
        """`weights_key` where the node stages the weights itself, else "" (`ModelRef.staged_key`)."""
        return staged_key(self.model, self.model_sha256)

    @property
    def node_file(self) -> str:
        """The file the node must already hold for this profile (see `ModelRef.node_file`), or ""."""
        return node_file(self.model, self.model_sha256, self.model_path)

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
        digest it had before they existed, so an upgrade does not replace every replica. An
        adapter's limits never count: the gateways enforce them, no process is started with
        them, and a replica replaced for one would drop its requests and its cache for nothing.
        """
        fields = msgspec.to_builtins(self)
        for late, default in _LATE_DEFAULTS.items():
            if fields.get(late) == default:
                del fields[late]
        for adapter in fields.get("adapters", ()):
            adapter.pop("rpm", None)
            adapter.pop("tpm", None)
        return hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:16]


_LATE_DEFAULTS: dict[str, object] = {
    "model_sha256": "",
    "adapters": (),
    "kv_events": False,
    "max_loras": 0,
    "max_lora_rank": 0,
}


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


# --- node ---------------------------------------------------------------


class NetInterface(Struct, frozen=True, kw_only=True):
    name: str
    # With their prefix length: "10.0.0.1/24", "fe80::1/64".
    addresses: tuple[str, ...] = ()
    mac: str = ""
    up: bool = True


# The bounds of a model's figures. The biggest models are a few TB of weights, a few hundred
# layers and heads, and a few million tokens of context: a figure past these (or below 0) is a
# broken or hostile header, never a model. A weight of -10**15 bytes fits any GPU, and one of
# 10**400 overflows every float the estimate divides it into. `llmgw_core.fit` refuses such a
# header before a node reports it, and a node status that carries one does not decode.
MODEL_MAX_BYTES = 2**50  # 1 PiB of weights (and as many elements)
MODEL_MAX_COUNT = 2**20  # layers, KV heads, a head's dimensions
MODEL_MAX_TOKENS = 2**32  # a trained context
MODEL_MAX_DTYPE = 64
ModelBytes = Annotated[int, Meta(ge=0, le=MODEL_MAX_BYTES)]
ModelCount = Annotated[int, Meta(ge=0, le=MODEL_MAX_COUNT)]
ModelTokens = Annotated[int, Meta(ge=0, le=MODEL_MAX_TOKENS)]


class ModelShape(Struct, frozen=True, kw_only=True):
    """What the memory estimate needs to know of a model, read from its metadata
    (`llmgw_core.fit.read_shape`); a node reports it for each model it holds.

    Every figure is bounded (`MODEL_MAX_*`): decoding checks the bounds, building one in
    memory does not (`llmgw_core.fit.shape_problem` checks a shape built so)."""

    format: Literal["gguf", "safetensors"]
    # Bytes of every weight tensor as stored (a GGUF's quantised blocks; safetensors' dtypes).
    weight_bytes: ModelBytes
    n_layer: ModelCount
    n_head_kv: ModelCount
    head_dim_k: ModelCount
    head_dim_v: ModelCount
    # The context the model was trained for: the default when a profile sets none.
    context_length: ModelTokens
    # Elements of floating-point tensors, which vLLM casts to its `--dtype`; 0 for GGUF.
    float_params: ModelBytes = 0
    # Bytes of the other tensors (quantised weights and scales), kept as stored.
    other_bytes: ModelBytes = 0
    # The checkpoint's dtype from config.json (`torch_dtype`), vLLM's `--dtype auto`.
    dtype: Annotated[str, Meta(max_length=MODEL_MAX_DTYPE)] = ""


class NodeFacts(Message, frozen=True):
    node: Name
    os_id: str = ""
    os_version: str = ""
    kernel: str = ""
    arch: str = ""
    cpu_model: str = ""
    cpu_flags: tuple[str, ...] = ()
    cores: Annotated[int, Meta(ge=0, le=NODE_MAX_CORES)] = 0
    memory_mb: NodeMB = 0
    nvidia_driver: str = ""
    cuda_driver: str = ""
    gpus: tuple[GPUInfo, ...] = ()
    hcas: tuple[str, ...] = ()
    interfaces: tuple[NetInterface, ...] = ()
    mgmt_addr: str = ""
    weights: dict[str, str] = {}
    simulated: bool = False
    # The interface that holds mgmt_addr: shards pin NCCL's and Gloo's bootstrap to it.
    mgmt_iface: str = ""
    # The shape of each model in `weights` whose metadata the node could read (the same
    # keys): read once, when the node staged it. The shape is the model's, not the node's,
    # so placement fits a profile with it on every node (`llmgw_core.fit`).
    shapes: dict[str, ModelShape] = {}

    @property
    def has_avx2(self) -> bool:
        if self.arch not in ("x86_64", "amd64", ""):
            return True
        return "avx2" in self.cpu_flags


EngineStateName = Literal["installing", "installed", "configured", "broken", "failed"]


class EngineState(Struct, frozen=True, kw_only=True):
    name: str
    state: EngineStateName
    # The version as `engines:` names it (llama.cpp's build tag, `b11434`); an engine
    # configured on the node without one in `engines:` reports its own version here.
    version: str = ""
    path: str = ""
    detail: str = ""
    # What the engine says of itself (`llama-server --version`): `0.6.0-dev (build 11434,
    # commit 6a5e2f1)`, so that a build that is not the one named shows beside the name.
    engine_version: str = ""
    # Why this engine cannot use the node's GPUs, in the node's words, when it is a CPU
    # build on a node with GPUs (`driver supports CUDA 12.2; b11434 has CUDA builds 12.8,
    # 13.4 only`). Placement gives such a node only CPU profiles of the engine.
    cpu_only: str = ""

    @property
    def runs(self) -> bool:
        return self.state in ("installed", "configured")


class EngineInventory(Message, frozen=True):
    node: Name
    probed_at: float
    engines: tuple[EngineState, ...] = ()


class InstallProgress(Message, frozen=True):
    node: Name
    engine: str
    step: str
    message: str
    outcome: Literal["running", "done", "failed"] = "running"
    bytes_done: int = 0
    bytes_total: int = 0
    at: float = 0.0


class WheelsHeld(Struct, frozen=True):
    """Engine wheels of one lock a node serves its peers, or fetches now (docs/installer.md,
    "Wheels shared between nodes"). `lock` is the sha256 of the lock as the installer renders it;
    `url` the node's wheel server for it, on its own `mgmt_addr`; `since` when it began fetching."""

    lock: Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
    state: Literal["held", "fetching"]
    url: Annotated[str, Meta(max_length=256)] = ""
    since: float = 0.0


# Locks whose wheels one node reports: a node holds the wheels of the locks it installed.
WHEELS_MAX = 16


class NodeStatus(Message, frozen=True):
    """The value of `<node>` in the nodes bucket: everything placement needs to know."""

    node: Name
    facts: NodeFacts
    engines: tuple[EngineState, ...] = ()
    probed_at: float = 0.0
    install: str = ""
    warnings: tuple[str, ...] = ()
    updated_at: float = 0.0
    wheels: Annotated[tuple[WheelsHeld, ...], Meta(max_length=WHEELS_MAX)] = ()


class NodeIntent(Message, frozen=True):
    """The value of `<node>` in the node-intent bucket: what the operator wants of a node.

    Written by `llmgw ctl cordon|drain` and the API; no key is an uncordoned node. A cordoned
    node takes no new replica (its own keep running); a draining one also has each of its
    replicas placed elsewhere, the old one stopped only once the new one is ready."""

    node: Name
    drain: bool = False
    # Who asked, when (UTC wall clock) and why: every refusal on the node quotes them.
    by: str = ""
    at: float = 0.0
    reason: str = ""
    # `llmgw ctl delete node`: the leader forgets the node (its status, shard statuses and this
    # key) once it judges it lost and holds no replica on it; ctl may not write node statuses.
    forget: bool = False

    def words(self) -> str:
        """`cordoned by ops at 2026-12-02 00:40:00 UTC: disk swap` (how refusals quote it)."""
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.at)) if self.at else "an unknown time"
        verb = "draining" if self.drain else "cordoned"
        return f"{verb} by {self.by or 'an operator'} at {when}" + (f": {self.reason}" if self.reason else "")

    def state(self, replicas_left: int) -> str:
        """What every surface shows of the node: `cordoned by …`, `draining (2 replicas left) by …`,
        `drained by …` once no replica of it is left."""
        words = self.words()
        if not self.drain:
            return words
        if replicas_left:
            plural = "" if replicas_left == 1 else "s"
            return words.replace("draining", f"draining ({replicas_left} replica{plural} left)", 1)
        return words.replace("draining", "drained", 1)


class NodeLifecycle(Message, frozen=True):
    """A node's lifecycle changed (placement tells it): `cordoned by …`, `draining (2 replicas
    left) by …`, `drained by …`, `uncordoned`, or `deleted` (a lost node forgotten)."""

    node: Name
    state: str
    at: float = 0.0


class WeightsEvicted(Message, frozen=True):
    """A staged model the node removed to make room (`<prefix>.events.node.<node>.weights`):
    no shard of the node used it, and it was the least recently used."""

    node: Name
    # As a profile's `weights_key` names it: `hf://org/repo/file@<commit>`, `sha256:<hex>`.
    key: str
    path: str
    freed_bytes: int = 0
    last_used_at: float = 0.0
    reason: str = ""
    at: float = 0.0


class WeightsQuery(Message, frozen=True):
    """A node staging a blob asks the cluster's nodes for it (`<prefix>.weights.who.<node>`,
    plain NATS; only node identities may ask or answer). It carries the asker's own offer
    (where it will serve the blob, and a token for it): the nodes that want the same blob at
    the same time learn of each other from it, and one of them fetches the origin.

    The asker is the subject's node, which nats-server lets only that node's identity publish;
    `node` repeats it, and a query whose `node` differs is dropped."""

    node: Name
    blob: str  # `sha256-<hex>` or `gitsha1-<hex>`, as the store names it
    size: int = 0
    url: str = ""
    token: str = ""


class WeightsOffer(Message, frozen=True):
    """A node's answer (`<prefix>.weights.offer.<asker>.<node>`): it holds the blob (verified),
    or fetches it now (from the origin or a peer), or wants it too; where to read it, with a
    token that node accepts for a while.

    The offering node is the subject's last token, not `node` (an offer whose `node` differs is
    dropped), and `url` must be `http://<mgmt_addr>:<port>/blobs/<blob>` with the `mgmt_addr`
    that node reports in its status, else the offer is ignored (docs/weights.md)."""

    node: Name
    blob: str
    state: Literal["held", "origin", "peer", "wanting"]
    url: str = ""
    token: str = ""
    have: int = 0
    size: int = 0


class Heartbeat(Message, frozen=True):
    node: Name
    service: str
    at: float
    # Who sends it (see `llmgw_core.claims`): one node id is one machine, and two
    # senders that claim the same node are told apart by these. Empty from an agent
    # older than them.
    host: str = ""
    boot_id: str = ""
    pid: int = 0
    # Random, one per running service: a restarted agent is a new instance.
    instance: str = ""
    started_at: float = 0.0
    # The sender waits while another instance works for this node: it runs nothing,
    # so its beats say nothing about the node's engines.
    standby: bool = False
    # A launcher's: the model files (`Profile.node_file`) its shards found missing on the node
    # and that are still missing; placement places the profiles that read them elsewhere.
    missing_models: tuple[str, ...] = ()


class NodeLiveness(Struct, frozen=True, kw_only=True, array_like=True):
    """One node as placement judges it (array-like: 10,000 of them fit one NATS message)."""

    node: str
    alive: bool
    # Seconds since its launcher was last heard; -1 if not since the judging placement started.
    silent_s: float
    # Seconds since its installer was last heard; -1 likewise.
    installer_silent_s: float = -1.0
    # `n1 is claimed by two machines: …` while two machines send its heartbeats, else "".
    claimed: str = ""
    # Its launcher is silent but its installer beats: for how much longer its engines are
    # routed to before its replicas are placed elsewhere (-1: not in that grace).
    grace_left_s: float = -1.0
    # The model files its launcher reports missing: profiles reading them are placed elsewhere.
    missing_models: tuple[str, ...] = ()
    # Its launcher beats but its installer has missed a few heartbeats: what the node's status
    # says of its install is the installer's last word, not news (`installer_silent_s` says
    # for how long; -1 there: not heard since the judging placement started).
    installer_stale: bool = False
    # The node's clock minus placement's, in seconds, while they differ by more than
    # `CLOCK_OFFSET_S` (0 otherwise): every time the node stamps is off by this much.
    clock_offset_s: float = 0.0

    def installer_short(self) -> str:
        """`installer silent 53 s` while the installer is stale, else ""."""
        if not self.installer_stale:
            return ""
        if self.installer_silent_s < 0:
            return "installer not heard since placement started"
        return f"installer silent {int(self.installer_silent_s)} s"

    def problems(self) -> tuple[str, ...]:
        """What placement says is wrong with the node, each in one line: `installer on node-b
        silent for 53 s: install progress stale`, `clock 600 s ahead of placement's`."""
        said = []
        if self.installer_stale:
            if self.installer_silent_s < 0:
                silent = "not heard since placement started"
            else:
                silent = f"silent for {int(self.installer_silent_s)} s"
            said.append(f"installer on {self.node} {silent}: install progress stale")
        clock = self.clock_words()
        if clock:
            said.append(clock)
        return tuple(said)

    def clock_words(self) -> str:
        """`clock 600 s ahead of placement's` (or `behind`) while the offset is a warning, else ""."""
        if not self.clock_offset_s:
            return ""
        way = "ahead of" if self.clock_offset_s > 0 else "behind"
        return f"clock {abs(round(self.clock_offset_s))} s {way} placement's"

    def install_shown(self, install: str) -> str:
        """The node's install progress as its status keeps it, marked stale while the installer is
        silent: `downloading … (92%, 6 MB of 7 MB), stale: no word for 53 s`."""
        if not install or not self.installer_stale:
            return install
        if self.installer_silent_s < 0:
            return f"{install}, stale: no word since placement started"
        return f"{install}, stale: no word for {int(self.installer_silent_s)} s"

    def shard_reading(self, state: str) -> str:
        """A shard of this node as it reads now: its stored state is the node's last word, so a
        lost node's shard is `unknown (node lost 13 s ago)`, never the `ready` it last said."""
        if self.alive:
            return state
        if self.silent_s < 0:
            return "unknown (node lost; not heard since placement started)"
        return f"unknown (node lost {int(self.silent_s)} s ago)"


# A node whose clock differs from placement's by more than this is warned of; the warning ends
# once the offset is back under CLOCK_OFFSET_END_S (a clock near the line does not flap).
CLOCK_OFFSET_S = 2.0
CLOCK_OFFSET_END_S = 1.5


class Liveness(Message, frozen=True):
    """The reply to `<prefix>.placement.liveness`."""

    placement: str
    leader: bool
    nodes: tuple[NodeLiveness, ...] = ()
    at: float = 0.0
    # Why this placement cannot act on what is written now, in one line (`NATS store full: …:
    # writes refused since 18:24:09`); empty when it can.
    cannot_write: str = ""


# --- engines the control plane wants ----------------------------------------


# A lock's text (a few hundred kB for vLLM's full wheel set with every wheel's sha256): one
# stored value holds every desired engine, and nats-server refuses a value over 1 MiB.
LOCK_MAX_BYTES = 512 << 10


class EngineSpec(Struct, frozen=True, kw_only=True):
    name: str
    version: str = ""
    # "github:<owner>/<repo>" (default for llamacpp), "mirror:<url or dir>",
    # or "configured": the engine is the one agent.yaml names under engines:
    # (checked like an installed one); nothing is downloaded. For vLLM and SGLang: "" (the
    # package index), an index URL, or a wheelhouse directory.
    source: str = ""
    # vLLM and SGLang: the build (`cpu`, `cu128`); "" lets each node work it out.
    variant: Annotated[str, Meta(max_length=32)] = ""
    # vLLM and SGLang: the lock (`llmgw engines lock`) the node installs, as text; nothing is
    # resolved on a node. Parsed by the installer (`llmgw_installer.lock`), which bounds it.
    lock: Annotated[str, Meta(max_length=LOCK_MAX_BYTES)] = ""


class DesiredEngines(Message, frozen=True):
    engines: tuple[EngineSpec, ...] = ()
    traceparent: str = ""


# --- shards -----------------------------------------------------------------

ShardState = Literal["pending", "starting", "waiting", "loading", "ready", "failed", "stopping", "stopped"]


class EngineLoad(Struct, frozen=True, kw_only=True):
    """What a ready engine said on its metrics endpoint: requests being generated, requests
    queued, and the fraction of its KV cache in use (None where the engine does not say:
    llama.cpp's server has no such gauge)."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None
    # When it was read (wall clock, like `ShardStatus.at`).
    at: float = 0.0

    @property
    def summary(self) -> str:
        """`2 running, 1 waiting, KV 37%`; `KV n/a` where the engine has no such gauge."""
        kv = "n/a" if self.kv_cache_usage is None else f"{self.kv_cache_usage * 100:.0f}%"
        return f"{self.running} running, {self.waiting} waiting, KV {kv}"

    @staticmethod
    def combined(loads: list[EngineLoad]) -> EngineLoad | None:
        """The load of a replica from its shards' (only the ranks that serve have one):
        requests added up, the fullest KV cache."""
        if not loads:
            return None
        kvs = [x.kv_cache_usage for x in loads if x.kv_cache_usage is not None]
        return EngineLoad(
            running=sum(x.running for x in loads),
            waiting=sum(x.waiting for x in loads),
            kv_cache_usage=max(kvs) if kvs else None,
            at=min(x.at for x in loads),
        )


class ShardFailure(Struct, frozen=True, kw_only=True):
    """How one attempt of a shard ended, as fields. Readers format it where they show it
    (`llmgw_core.failures`); none parses a failure back out of text."""

    # What ended the attempt, in one line and without the log: "sim (pid 12) exited with
    # code 42", "no health answer within 120 s from http://… (last: connection refused)".
    reason: str
    # The exit status of the process whose exit ended the attempt, as subprocess gives it:
    # its code, or minus the signal that killed it (-9: SIGKILL). None where no collected
    # exit ended it (a health timeout, a process adopted or reaped elsewhere).
    exit: int | None = None
    # The failing attempt's own last log lines (an earlier attempt's never explain it).
    log_tail: tuple[str, ...] = ()
    # Which attempt failed: 1 for the first start, restarts + 1 after.
    attempt: Annotated[int, Meta(ge=0)] = 0
    at: float = 0.0


class ShardStatus(Message, frozen=True):
    node: Name
    shard: Token
    replica: str
    state: ShardState
    reason: str = ""
    retryable: bool = True
    pids: tuple[int, ...] = ()
    port: int = 0
    url: str = ""
    profile_fp: str = ""
    pool: str = ""
    fabric: str = ""
    restarts: int = 0
    rank: int = 0
    at: float = 0.0
    deployment: str = ""
    # The last failure of this shard ("exited with code 42; last log lines: …", "killed by
    # SIGKILL", "no health answer within 120 s"), with the failing attempt's own log lines;
    # kept across restarts until the shard is ready again.
    last_failure: str = ""
    last_failure_at: float = 0.0
    # The engine's load, read from its metrics while it is ready; None otherwise.
    load: EngineLoad | None = None
    # The last failure as fields (`last_failure` holds the same as text, for readers that
    # predate them); None while there is none.
    failure: ShardFailure | None = None
    # The profile's LoRA adapters the node refused, one line each ("adapter legal refused: …
    # not an adapter"): the engine runs without them (docs/adapters.md).
    adapters_refused: Annotated[tuple[str, ...], Meta(max_length=ADAPTERS_MAX)] = ()
    # The adapters its engine loaded, in the order it numbers them (llama.cpp's `lora` ids).
    adapters: Annotated[tuple[ServedAdapter, ...], Meta(max_length=ADAPTERS_MAX)] = ()
    # An engine that loads adapters at run time (vLLM): the adapters staged and checked that it
    # may be asked to load (`adapters` says which it holds now), sorted by name.
    adapters_loadable: Annotated[tuple[Name, ...], Meta(max_length=ADAPTERS_MAX)] = ()


# --- deployments and replicas -------------------------------------------------


class Autoscale(Struct, frozen=True, kw_only=True):
    """The bounds a deployment's replica count follows demand within (docs/autoscaling.md).
    They are desired state, what the operator wrote; the count placement chooses inside them
    is not written back, and never overwrites them."""

    # 0: the deployment may scale to zero, a request for it held by the gateway until a
    # replica is ready.
    min_replicas: Annotated[int, Meta(ge=0)] = 1
    max_replicas: Annotated[int, Meta(ge=1)] = 1
    # Requests in flight (sent and queued) per replica that the count aims at.
    target_in_flight: Annotated[float, Meta(gt=0)] = 4.0
    # How long demand must stay below what fewer replicas would carry before one is stopped.
    scale_down_after_s: Annotated[float, Meta(ge=0)] = 300.0


class Deployment(Message, frozen=True):
    name: Name
    profile: str
    # The count when `autoscale` is None; ignored while it is set.
    replicas: Annotated[int, Meta(ge=0)] = 1
    pool: str = ""
    strategy: Literal["binpack", "spread"] = "binpack"
    traceparent: str = ""
    # Other names clients may send as `model` to reach this deployment through the gateway
    # (the served model's own name, a friendly name); the deployment's name always works.
    aliases: Aliases = ()
    autoscale: Autoscale | None = None


# `unknown`: a launcher of the replica has gone silent, so nothing says whether it still serves.
# `draining`: about to be stopped; gateways send it nothing new and its requests finish first.
ReplicaState = Literal[
    "placing",
    "starting",
    "ready",
    "degraded",
    "failed",
    "unplaceable",
    "stopping",
    "unknown",
    "draining",
]


class ReplicaRecord(Message, frozen=True):
    """The value of `<deployment>.<replica>` in the replicas bucket."""

    deployment: Name
    replica: Token
    profile: str
    profile_fp: str
    state: ReplicaState
    members: tuple[Member, ...] = ()
    shards: tuple[str, ...] = ()
    reason: str = ""
    url: str = ""
    fabric: str = ""
    pool: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    # When it entered `state`.
    since: float = 0.0
    # Engine restarts over its shards, and the last failure of any of them (kept until the
    # replica is ready again), as its shards' launchers reported them.
    restarts: int = 0
    last_failure: str = ""
    # Its profile's engine (`vllm`, `llamacpp`, …): which API paths the gateway may send it.
    engine: str = ""
    # `last_failure` as fields, from the shard that failed last.
    failure: ShardFailure | None = None


class ReplicaStatus(Message, frozen=True):
    """A replica's state transition, as an event."""

    deployment: Name
    replica: Token
    state: ReplicaState
    reason: str = ""
    url: str = ""
    at: float = 0.0


class NodeReason(Struct, frozen=True, kw_only=True):
    """Why placement cannot put a replica on `node`: the operator's words, and what refused it
    (`kind`, one of `llmgw_core.failures.REFUSAL_KINDS`), which readers act on instead of the
    words. "" from a placement that predates kinds (`failures.readying` reads its words)."""

    node: str
    reason: str
    kind: str = ""


class DeploymentStatus(Message, frozen=True):
    """A deployment as placement sees it: published on `<prefix>.events.deployment.<name>`
    whenever any count or the refusal changes (the stream keeps the last per subject)."""

    deployment: Name
    desired: int
    ready: int = 0
    # Placed but not ready: placing, starting, degraded, unknown or failed and being retried.
    pending: int = 0
    # Replicas placement could not place now.
    unplaceable: int = 0
    # One line: "chat: 3 of 10 ready; 7 cannot be placed: node-a 0 of 2 GPUs free, …".
    summary: str = ""
    # Every node's reason for the refusal, when some replicas cannot be placed.
    reasons: tuple[NodeReason, ...] = ()
    at: float = 0.0
    # Why a change cannot proceed while the replicas run on: `rolling update blocked: no node
    # fits the new profile: …`, `drain of node-a blocked: no other node fits: …`; else "".
    blocked: str = ""
    # The limits of its profile's LoRA adapters that have any, which every gateway enforces
    # (docs/adapters.md): said here since gateways may not read the catalog.
    adapter_quotas: Annotated[tuple[AdapterQuota, ...], Meta(max_length=ADAPTERS_MAX)] = ()


class ScaleDecision(Message, frozen=True):
    """Placement changed an autoscaled deployment's count, with why: published on
    `<prefix>.events.scale.<deployment>`."""

    deployment: Name
    before: Annotated[int, Meta(ge=0)]
    after: Annotated[int, Meta(ge=0)]
    # "scaled 1 → 3: 11.2 requests in flight per replica over 60 s, target 4";
    # "scaled to 0 after 300 s without requests".
    reason: str
    at: float = 0.0


# --- demand, from the gateways -------------------------------------------------


class ReplicaInFlight(Struct, frozen=True, kw_only=True, array_like=True):
    replica: str
    in_flight: Annotated[int, Meta(ge=0)]


class DeploymentDemand(Struct, frozen=True, kw_only=True):
    deployment: str
    # Sent to a replica and not yet answered in full.
    in_flight: Annotated[int, Meta(ge=0)] = 0
    # Held by the gateway, waiting for a replica that can take it.
    queued: Annotated[int, Meta(ge=0)] = 0
    # Requests that arrived since the gateway's previous report (a rate, over its interval).
    arrived: Annotated[int, Meta(ge=0)] = 0
    # In flight per replica, for each replica with any: a draining replica absent from a
    # report made after it began draining has none left at that gateway.
    replicas: tuple[ReplicaInFlight, ...] = ()


class Demand(Message, frozen=True):
    """One gateway's demand, on `<prefix>.demand.<gateway>` (plain NATS, not stored): every
    second, and at once when it starts holding a request for a deployment with no ready
    replica. Placement sums the latest report of each gateway heard within a few intervals."""

    gateway: Token
    deployments: tuple[DeploymentDemand, ...] = ()
    # Seconds between this gateway's reports: a report older than a few of them is dropped.
    interval_s: float = 1.0
    at: float = 0.0


# The most of an engine's own words a judgement carries (the body of its failed answer).
JUDGEMENT_WORDS_MAX = 300
# Replicas one gateway judges in one report; counts it may give for one replica.
JUDGED_MAX = 10_000
JUDGED_COUNT_MAX = 1_000_000_000


class ReplicaJudgement(Struct, frozen=True, kw_only=True):
    """What one gateway saw of one replica's answers over its outlier window."""

    deployment: Name
    replica: Token
    # Attempts sent to it in the window, and those that failed: a 5xx answer, a connection
    # refused or reset, or no first byte within the read timeout (a 4xx is the client's).
    requests: Annotated[int, Meta(ge=0, le=JUDGED_COUNT_MAX)] = 0
    failed: Annotated[int, Meta(ge=0, le=JUDGED_COUNT_MAX)] = 0
    # Failures in a row, up to the report.
    consecutive: Annotated[int, Meta(ge=0, le=JUDGED_COUNT_MAX)] = 0
    # Seconds from the window's first failure to the report.
    failing_for_s: Annotated[float, Meta(ge=0, le=86_400)] = 0.0
    # Whether the gateway judges it an outlier (too many failures in a row, or too low a
    # success rate), whether or not it could take it out of routing; and whether it did.
    failing: bool = False
    ejected: bool = False
    # The last failure: its HTTP status (0: no answer) and the engine's own words, cut short.
    status: Annotated[int, Meta(ge=0, le=999)] = 0
    words: Annotated[str, Meta(max_length=JUDGEMENT_WORDS_MAX)] = ""


class Judgement(Message, frozen=True):
    """One gateway's judgement of the replicas it sent requests to, on
    `<prefix>.judgement.<gateway>` (plain NATS, not stored): with its demand report, for each
    replica that failed in its window, and once more with zeros once it stopped failing.
    Placement sums the latest report of each gateway heard within a few intervals, as it sums
    demand, and marks a replica any gateway judges failing `degraded`, then restarts it."""

    gateway: Token
    replicas: Annotated[tuple[ReplicaJudgement, ...], Meta(max_length=JUDGED_MAX)] = ()
    interval_s: float = 1.0
    at: float = 0.0


class PlacementDecision(Message, frozen=True):
    deployment: Name
    replica: str
    outcome: Literal["placed", "refused"]
    nodes: tuple[str, ...] = ()
    reasons: tuple[NodeReason, ...] = ()
    at: float = 0.0


# --- logs on request -------------------------------------------------------------


class ShardLogsRequest(Message, frozen=True):
    """A request on `<prefix>.launcher.<node>.logs` for a shard's log lines."""

    shard: Token
    # The last N lines (0: as many as fit the reply, about 1 MB).
    tail: Annotated[int, Meta(ge=0)] = 100
    # One of the shard's processes by name (`ShardLogs.processes`); default its last, the engine.
    process: str = ""
    # To follow a log: the `offset` of the previous reply; the lines written since come back.
    offset: Annotated[int, Meta(ge=-1)] = -1


class ShardLogs(Message, frozen=True):
    """The launcher's reply: the lines, or `error` saying why none (an unknown shard, say)."""

    node: str
    shard: str
    process: str = ""
    processes: tuple[str, ...] = ()
    lines: tuple[str, ...] = ()
    # Where the next follow request starts (a byte offset in the process's log).
    offset: int = 0
    error: str = ""


# --- encoding ---------------------------------------------------------------

_encoder = msgspec.json.Encoder(order="deterministic")
_decoders: dict[type[Struct], msgspec.json.Decoder[Struct]] = {}


def encode(msg: Struct) -> bytes:
    return _encoder.encode(msg)


T = TypeVar("T", bound=Struct)


def decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    """The one Decoder for `kind`, created on first use and reused."""
    found = _decoders.get(kind)
    if found is None:
        found = msgspec.json.Decoder(kind)
        _decoders[kind] = found
    return found  # type: ignore[return-value]
