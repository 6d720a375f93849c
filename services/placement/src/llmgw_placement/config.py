"""`server.yaml`: engines, pools, fabrics, catalog, deployments, timing."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

from llmgw_core.adapter_rules import adapters_problem, folded
from llmgw_core.adapters import Adapter
from llmgw_core.config import NatsConfig
from llmgw_core.engines import Profile
from llmgw_core.events import Autoscale, Deployment, EngineSpec
from llmgw_core.limits import REPLICAS_CEILING, Aliases, Name, replicas_problem
from llmgw_core.validate import autoscale_problem, deployments_problem

# The llama.cpp build every node gets unless server.yaml says otherwise.
DEFAULT_ENGINES = (EngineSpec(name="llamacpp", version="b11434", source="github:ggml-org/llama.cpp"),)


class ProfileConfig(Profile, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A catalog entry in server.yaml: a typo (`tpp: 2`) is an error here, not a silent default."""

    def wire(self) -> Profile:
        return Profile(**msgspec.structs.asdict(self))


class AutoscaleConfig(Autoscale, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`autoscale:` of a deployment in server.yaml: a typo (`max_replica: 4`) is an error here."""

    def wire(self) -> Autoscale:
        return Autoscale(**msgspec.structs.asdict(self))


class DeploymentConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: Name
    profile: Name
    replicas: Annotated[int, Meta(ge=0)] = 1
    pool: str = ""
    strategy: Literal["binpack", "spread"] = "binpack"
    aliases: Aliases = ()
    autoscale: AutoscaleConfig | None = None

    def wire(self) -> Deployment:
        fields = msgspec.structs.asdict(self)
        fields["autoscale"] = self.autoscale.wire() if self.autoscale is not None else None
        return Deployment(**fields)


class AdapterConfig(Adapter, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An adapter in server.yaml (`adapters:`): a typo (`sacle: 2`) is an error here."""

    def wire(self) -> Adapter:
        return Adapter(**msgspec.structs.asdict(self))


class AutoscalerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How placement follows demand (docs/autoscaling.md): its windows, its step, its drains."""

    # Demand averaged over this long decides the count in the steady state.
    stable_window_s: Annotated[float, Meta(gt=0)] = 60.0
    # Demand averaged over this long decides it when it asks for `panic_factor` times the count.
    panic_window_s: Annotated[float, Meta(gt=0)] = 6.0
    panic_factor: Annotated[float, Meta(ge=1)] = 2.0
    # One step up at most multiplies the count by this (and adds at least one replica).
    max_step_factor: Annotated[float, Meta(ge=1)] = 2.0
    # A gateway's report older than this many of its intervals is dropped from the sum.
    demand_stale_intervals: Annotated[float, Meta(gt=0)] = 3.0
    # A draining replica is removed when every gateway says it has nothing in flight on it,
    # or after this long whatever they say.
    drain_timeout_s: Annotated[float, Meta(ge=0)] = 30.0


class FabricConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Node id patterns (fnmatch) of the nodes on this fabric.
    nodes: tuple[str, ...]
    # The InfiniBand adapters (mlx5_0, …) that reach this fabric, on every node of it.
    hcas: tuple[str, ...] = ()


class HttpConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8080
    # Bearer tokens (`llmgw auth init` writes both): reads and writes, and reads only.
    token_file: str = ""
    read_token_file: str = ""
    # Serve without tokens: anyone who reaches the port may change deployments.
    insecure: bool = False
    # The gateway as a browser reaches it (`http://gateway.example:8000`), for the cluster
    # page's chat box: the browser sends its request there itself, with a key the user types
    # (the gateway's `http: cors_origins` must name this page's origin). "": no chat box.
    gateway_url: str = ""


class ServerConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    nats: NatsConfig = NatsConfig()
    engines: tuple[EngineSpec, ...] = DEFAULT_ENGINES
    # Pool name -> node id patterns. A deployment with no pool may use every node.
    pools: dict[str, tuple[str, ...]] = {}
    fabrics: dict[str, FabricConfig] = {}
    catalog: tuple[ProfileConfig, ...] = ()
    deployments: tuple[DeploymentConfig, ...] = ()
    # LoRA adapters, each on its base profile of the catalog (docs/adapters.md).
    adapters: tuple[AdapterConfig, ...] = ()
    heartbeat_interval_s: float = 1.0
    node_timeout_s: float = 5.0
    http: HttpConfig = HttpConfig()
    # Rendezvous and RPC ports that multi-node replicas get on their nodes.
    dist_port_range: tuple[int, int] = (30000, 39999)
    identity: str = ""
    # The most replicas one deployment may ask for; a larger count is refused where it enters.
    max_replicas: Annotated[int, Meta(ge=0, le=REPLICAS_CEILING)] = 10_000
    # How often the leader removes records and shard specs in the buckets that are not its
    # own (a write that landed after its writer lost the lease).
    reconcile_interval_s: float = 15.0
    # A node whose launcher is silent while its installer still beats is restarting an agent
    # (an upgrade), not lost: its replicas' readiness is `unknown` and the gateway goes on
    # routing to their engines for this long before they are placed elsewhere. A node whose
    # installer is silent too is lost after node_timeout_s, as ever.
    launcher_grace_s: Annotated[float, Meta(ge=0)] = 60.0
    autoscaler: AutoscalerConfig = AutoscalerConfig()
    # A replica the gateways judge failing its requests (5xx, no answer) while its engine says
    # it is healthy is marked `degraded` at once, and restarted (removed and placed again)
    # after this long marked.
    unhealthy_restart_s: Annotated[float, Meta(ge=0, le=86_400)] = 60.0

    def __post_init__(self) -> None:
        # Refused at load, naming the entry: placement would only dead-letter it after seeding.
        for i, dep in enumerate(self.deployments):
            problem = replicas_problem(dep.name, dep.replicas, self.max_replicas)
            if problem is not None:
                raise ValueError(f"{problem} - at `$.deployments[{i}].replicas`")
            if dep.autoscale is not None:
                problem = autoscale_problem(dep.name, dep.autoscale, self.max_replicas)
                if problem is not None:
                    raise ValueError(f"{problem} - at `$.deployments[{i}].autoscale`")
        # A model name routes to one deployment: aliases that meet another's names are refused here.
        found = deployments_problem(self.deployments)
        if found is not None:
            raise ValueError(f"{found[1]} - at `$.deployments[{found[0]}]`")
        for i, profile in enumerate(self.catalog):
            if profile.adapters:
                raise ValueError(
                    f"profile {profile.name}: adapters are listed under `adapters:`, each with its "
                    f"`base:` - at `$.catalog[{i}].adapters`"
                )
        # Against the file's own catalog where it has one; a file of adapters alone (`ctl apply`)
        # is checked against the cluster's catalog when it is applied.
        found = adapters_problem(self.adapters, self.profiles(), self.deployments) if self.catalog else None
        if found is not None:
            raise ValueError(f"{found[1]} - at `$.adapters[{found[0]}]`")

    def profiles(self) -> dict[str, Profile]:
        """The catalog as it is stored: each profile holding the adapters whose base it is."""
        catalog = {p.name: p.wire() for p in self.catalog}
        return folded(catalog, (a.wire() for a in self.adapters)) if self.adapters else catalog
