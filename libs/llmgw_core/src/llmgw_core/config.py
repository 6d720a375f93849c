"""`agent.yaml` (installer and launcher on a node), decoded into typed structs.

Every setting has a default that works on one machine. An error names the
file, the path inside it and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec
from msgspec import Struct

from .bus import BusOptions
from .errors import ConfigError
from .events import GPUInfo
from .limits import Name, document_problem

T = TypeVar("T", bound=Struct)


# The `nats:` section: the bus client's own options, decoded strictly.
NatsConfig = BusOptions


class Simulate(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Pretend hardware, so a laptop can run a GPU cluster's rules."""

    gpus: tuple[GPUInfo, ...] = ()
    hcas: tuple[str, ...] = ()
    # Simulated GPUs of one model: "8x NVIDIA H100 80GB HBM3" style shorthand.
    gpu_count: int = 0
    gpu_name: str = "NVIDIA H100 80GB HBM3"
    gpu_capability: str = "9.0"
    gpu_memory_mb: int = 81559
    # The host's memory in MB (0: the machine's own), what CPU profiles are fitted against.
    memory_mb: int = 0

    def gpu_list(self) -> tuple[GPUInfo, ...]:
        if self.gpus:
            return self.gpus
        return tuple(
            GPUInfo(
                index=i,
                name=self.gpu_name,
                uuid=f"GPU-sim-{i:02d}",
                compute_capability=self.gpu_capability,
                memory_mb=self.gpu_memory_mb,
            )
            for i in range(self.gpu_count)
        )


class ConfiguredEngine(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An engine the operator installed on purpose and names here.

    vLLM and SGLang: `path` is the Python environment's bin directory.
    llama.cpp: `path` is the directory holding llama-server.
    """

    path: str
    # vLLM across nodes: "auto" uses vLLM's own multi-node mode when the
    # environment's vLLM has it (0.11.1 and later), Ray otherwise; "ray" or
    # "native" force one. Every node of a replica must end up with the same.
    multinode: Literal["auto", "ray", "native"] = "auto"


class AgentConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    node: Name
    state_dir: str = ".llmgw/agent"
    nats: NatsConfig = NatsConfig()
    # The address other nodes and clients reach this node on. "": the IPv4 address of
    # `mgmt_iface`, else of the interface the default route leaves by (probe.pick_mgmt_addr);
    # loopback only on a host with no other. `mgmt_iface` "": the interface holding it.
    mgmt_addr: str = ""
    mgmt_iface: str = ""
    # Engines get HTTP and rendezvous ports from this range when a shard leaves them to the node.
    port_range: tuple[int, int] = (20000, 29999)
    model_paths: tuple[str, ...] = ()
    simulate: Simulate | None = None
    engines: dict[str, ConfiguredEngine] = {}
    heartbeat_interval_s: float = 1.0
    recheck_interval_s: float = 600.0
    allow_os_packages: bool = True
    github_api: str = "https://api.github.com"
    mirror: str = ""
    # Unpacking an engine archive: at most this many bytes in all, and no member
    # over this multiple of the archive's own size (a bomb of zeros is refused
    # before it is written).
    unpack_max_bytes: int = 4 << 30
    unpack_max_ratio: float = 100.0
    # Launcher timing.
    stop_grace_s: float = 10.0
    wait_timeout_s: float = 600.0
    # A failed shard is restarted after a jittered wait between these two (llmgw_core.retry).
    restart_backoff_s: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    restart_backoff_cap_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    health_interval_s: float = 1.0
    # The launcher reads its node's shard specs afresh this often (jittered by a fifth) and
    # acts on what its watch missed: a watch that stays alive and delivers nothing would keep
    # an engine serving after its replica moved. Each read opens one short-lived consumer on
    # the shards bucket: raise it on a fleet of thousands of nodes; 0: never.
    spec_resync_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # A ready engine's metrics are read this often for its load (running and waiting
    # requests, KV-cache use), and its status rewritten only when the load changed; 0: never.
    load_interval_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    # Engines run this many nice steps below the node agent (0: at its own priority),
    # their sessions too, so that engines keeping every core busy cannot starve the
    # agent's heartbeats, probes and stops; engines lose only the little CPU the agent
    # uses. Engines compete among themselves the same either way.
    engine_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    # Prometheus /metrics of each agent on mgmt_addr; 0 turns it off (the default,
    # so that several simulated nodes can share one machine).
    installer_metrics_port: int = 0
    launcher_metrics_port: int = 0
    # Weights a profile's `model` names are staged in <state_dir>/models: at most this many bytes
    # in all (0: as much as the disk has free), a download given up after this many seconds
    # without a byte (the next attempt resumes it).
    models_budget_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    weights_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    # The node serves the weights it holds to the cluster's other nodes on mgmt_addr at this
    # port (0: any free port; the port travels in its answers on the bus), at most this many
    # bytes a second in all transfers (0: as fast as they go), and asks them before the origin,
    # waiting this long for their answers; false: neither serves nor asks.
    weights_peers: bool = True
    weights_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    weights_serve_bytes_s: Annotated[int, msgspec.Meta(ge=0)] = 0
    weights_peer_window_s: Annotated[float, msgspec.Meta(gt=0)] = 0.3

    def __post_init__(self) -> None:
        if self.restart_backoff_cap_s < self.restart_backoff_s:
            raise ValueError(
                f"restart_backoff_cap_s ({self.restart_backoff_cap_s:g}) is below restart_backoff_s "
                f"({self.restart_backoff_s:g}): the cap is the longest wait between restarts; "
                "raise it or lower restart_backoff_s"
            )

    @property
    def state_path(self) -> Path:
        return Path(self.state_dir)


def load(path: str | Path, kind: type[T]) -> T:
    """Decode a YAML file into `kind`, or raise ConfigError naming the file and the path in it."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from exc
    return loads(raw, kind, source=str(p))


def loads(raw: bytes | str, kind: type[T], *, source: str = "<config>") -> T:
    # Nesting thousands deep crashes the decoder, and aliases can stand for millions of
    # values: measured before decoding.
    problem = document_problem(raw.encode() if isinstance(raw, str) else raw)
    if problem:
        raise ConfigError(f"{source}: {problem}")
    try:
        return msgspec.yaml.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(_syntax_error(raw, source, exc)) from exc


def _syntax_error(raw: bytes | str, source: str, exc: msgspec.DecodeError) -> str:
    """`server.yaml:2:6: not valid YAML: mapping values are not allowed here`: the file, line
    and column, where msgspec's own message names only `"<byte string>"`."""
    import yaml

    try:
        yaml.safe_load(raw)
    except yaml.MarkedYAMLError as marked:
        mark = marked.problem_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        context = ""
        at = marked.context_mark
        if (
            marked.context
            and at is not None
            and (mark is None or (at.line, at.column) != (mark.line, mark.column))
        ):
            context = f" ({marked.context} at line {at.line + 1}, column {at.column + 1})"
        return f"{where}: not valid YAML: {marked.problem}{context}"
    except yaml.YAMLError:
        pass
    said = str(exc).replace('"<byte string>"', source).replace('"<unicode string>"', source)
    return f"{source}: not valid YAML: {said}"
