"""Pure: what `llmgw ctl` prints, from what it read. Tables, JSON-ready views, event lines."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

import msgspec

from llmgw_core import failures
from llmgw_core.engines import Profile
from llmgw_core.events import (
    Deployment,
    DeploymentStatus,
    EngineInventory,
    EngineLoad,
    EngineState,
    InstallProgress,
    NodeFacts,
    NodeLifecycle,
    NodeLiveness,
    NodeStatus,
    PlacementDecision,
    ReplicaRecord,
    ReplicaStatus,
    ScaleDecision,
    ShardStatus,
)

from ._read import Cluster, Stamped


class NodeView(msgspec.Struct, frozen=True, kw_only=True):
    """`get nodes -o json`: a node's status (its installer's) with placement's judgement."""

    node: str
    # alive, lost, or unknown (no placement answered, or it has not heard the node since it started)
    state: str
    # Seconds since placement last heard its launcher; -1 when not since placement started or unknown.
    silent_s: float
    status: NodeStatus
    # `n1 is claimed by two machines: …` while placement hears two machines send its beats.
    claimed: str = ""
    # `cordoned by ops at …: why`, `draining (1 replica left) by …`, `drained by …`; "" when
    # the operator asked nothing of it.
    intent: str = ""
    # The model files its launcher reports missing, as placement heard them.
    missing_models: tuple[str, ...] = ()
    # What placement says is wrong with the node, each in one line (`installer on node-b silent
    # for 53 s: install progress stale`, `clock 600 s ahead of placement's`).
    problems: tuple[str, ...] = ()
    # The install progress as shown: the status's, marked stale while the installer is silent.
    install: str = ""
    # `clock 600 s ahead of placement's` while placement warns of the node's clock, else "".
    clock: str = ""
    # The node's clock minus placement's while that is a warning (0 otherwise): what the node
    # stamps is moved back by it, so that ages are placement's, never the node's.
    clock_offset_s: float = 0.0


class DeploymentView(msgspec.Struct, frozen=True, kw_only=True):
    """`get deployments -o json`: what the operator asked for, and placement's last word on it."""

    name: str
    deployment: Deployment
    # None until placement has published one.
    status: DeploymentStatus | None = None


def replica_name(deployment: str, replica: str) -> str:
    """A replica as ctl, the page and the API name it: `chat/r0` (the bucket's key is `chat.r0`)."""
    return f"{deployment}/{replica}"


def shard_name(node: str, shard: str) -> str:
    """A shard as ctl, the page and the API name it: `node-1/chat-r0-0` (key `node-1.chat-r0-0`)."""
    return f"{node}/{shard}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    # One format per table and one call per row: `ctl get nodes` prints 10,000 rows.
    widths = [max(map(len, column)) for column in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(line.format(*r).rstrip() for r in [headers, *rows])


def under(header: str, row: list[str]) -> str:
    """One row printed under a table's header line (`--watch`'s changed rows): each cell where
    its column starts, two spaces after the cell before it where that one ran long, as
    `table` would have printed it. Rows were off by two more characters a column."""
    # A column's title is words one space apart; `table` puts two between columns.
    starts = [m.start() for m in re.finditer(r"\S+(?: \S+)*", header)] or [0]
    line = ""
    for i, cell in enumerate(row):
        at = starts[i] if i < len(starts) else len(line) + 2
        if line:
            line += " " * max(2, at - len(line))
        line += cell
    return line.rstrip()


def ago(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h"


def age(at: float, now: float) -> str:
    return ago(max(0.0, now - at)) if at else "-"


def to_builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def render_data(value: Any, output: str) -> str:
    data = to_builtins(value)
    if output == "yaml":
        import yaml  # only here: every command pays for what it imports, before it reads anything

        return yaml.safe_dump(data, sort_keys=False, width=100).rstrip("\n")
    return msgspec.json.format(msgspec.json.encode(data), indent=2).decode()


# --- nodes ----------------------------------------------------------------------------


def node_state(live: NodeLiveness | None, judged: bool) -> str:
    if not judged:
        return "unknown (no placement answered)"
    if live is None:
        return "unknown (not heard since placement started)"
    if live.claimed:
        return "claimed twice"
    if live.alive and live.grace_left_s >= 0:
        # An agent restart, as placement judges it: the engines serve on for now.
        left = ago(live.grace_left_s)
        return f"launcher silent {ago(live.silent_s)}, installer beats (fails over in {left})"
    if live.alive:
        return f"alive, {live.installer_short()}" if live.installer_stale else "alive"
    if live.silent_s < 0:
        return "lost (not heard since placement started)"
    return f"lost {ago(live.silent_s)} ago"


def node_views(c: Cluster) -> list[NodeView]:
    live = {n.node: n for n in c.judged.nodes} if c.judged else {}
    views = []
    for node, status in sorted(c.nodes.items()):
        intent = c.intents.get(node)
        said = intent.state(replicas_on(c, node)) if intent is not None else ""
        views.append(node_view(node, status, live.get(status.node), c.judged is not None, said))
    return views


def node_view(
    node: str, status: NodeStatus, judged: NodeLiveness | None, answered: bool, said: str = ""
) -> NodeView:
    """The node as placement judges it (`judged`; `answered`: whether a placement answered at
    all) with its status, and the operator's intent in words (`said`)."""
    state = node_state(judged, answered)
    return NodeView(
        node=node,
        state=f"{state}; {said}" if said else state,
        silent_s=judged.silent_s if judged is not None else -1.0,
        status=status,
        claimed=judged.claimed if judged is not None else "",
        intent=said,
        missing_models=judged.missing_models if judged is not None else (),
        problems=judged.problems() if judged is not None else (),
        install=judged.install_shown(status.install) if judged is not None else status.install,
        clock=judged.clock_words() if judged is not None else "",
        clock_offset_s=judged.clock_offset_s if judged is not None else 0.0,
    )


def missing_words(v: NodeView) -> tuple[str, ...]:
    """`model file not found: /models/x.gguf` for each model file the node lacks."""
    return tuple(f"model file not found: {p}" for p in v.missing_models)


def replicas_on(c: Cluster, node: str) -> int:
    """How many replicas have a rank on `node` (a draining node's replicas left)."""
    return sum(1 for r in c.replicas.values() if any(m.node == node for m in r.members))


def engine_words(e: EngineState) -> str:
    """`llamacpp b11434 (installed; 0.6.0-dev)`: the version `engines:` names, the engine's own
    beside it where it differs, and a CPU build on a GPU node said as such."""
    own = e.engine_version.split(" (", 1)[0]
    notes: list[str] = [e.state]
    if own and own != e.version:
        notes.append(own)
    if e.cpu_only:
        notes.append("CPU build only")
    return f"{e.name} {e.version} ({'; '.join(notes)})".replace("  ", " ")


NODE_HEADERS = ["NODE", "STATE", "GPUS", "ENGINES", "INSTALL", "WARNINGS"]
NODE_WIDE = ["ARCH", "CORES", "MEMORY", "PROBED"]


def node_row(v: NodeView, *, wide: bool = False, now: float | None = None) -> list[str]:
    status = v.status
    gpus = status.facts.gpus
    gpu_text = f"{len(gpus)}x {gpus[0].name}" if gpus else "-"
    engines = ", ".join(engine_words(e) for e in status.engines)
    shown = v.install or status.install
    install = shown or "-"
    if v.state.startswith("lost") and shown:
        # What a lost node said last is not news: say so.
        install = f"{shown} (last known)"
    warnings = tuple(w for w in (v.claimed, v.clock) if w) + status.warnings
    warnings = (*warnings, *missing_words(v))
    row = [v.node, v.state, gpu_text, engines or "none", install, "; ".join(warnings) or "-"]
    if wide:
        facts = status.facts
        row += [
            facts.arch or "-",
            str(facts.cores or "-"),
            f"{facts.memory_mb // 1024} GiB" if facts.memory_mb else "-",
            f"{age(status.probed_at - v.clock_offset_s, now or time.time())} ago"
            if status.probed_at
            else "never",
        ]
    return row


# --- deployments --------------------------------------------------------------------------

DEPLOYMENT_HEADERS = ["NAME", "PROFILE", "DESIRED", "READY", "PENDING", "UNPLACEABLE", "POOL"]
DEPLOYMENT_WIDE = ["STRATEGY", "SUMMARY"]


def deployment_views(c: Cluster) -> list[DeploymentView]:
    return [
        DeploymentView(name=n, deployment=d, status=c.statuses.get(n))
        for n, d in sorted(c.deployments.items())
    ]


def deployment_row(v: DeploymentView, *, wide: bool = False) -> list[str]:
    d, s = v.deployment, v.status
    counts = [str(s.ready), str(s.pending), str(s.unplaceable)] if s else ["-", "-", "-"]
    # An autoscaled deployment: the count placement chose, and its bounds (`2 (0-4)`).
    a = d.autoscale
    desired = (
        str(d.replicas) if a is None else f"{s.desired if s else '-'} ({a.min_replicas}-{a.max_replicas})"
    )
    row = [v.name, d.profile, desired, *counts, d.pool or "-"]
    if wide:
        row += [d.strategy, (s.summary if s else "") or "no word from placement yet"]
    return row


# --- replicas ------------------------------------------------------------------------------

REPLICA_HEADERS = ["REPLICA", "STATE", "NODES", "SINCE", "RESTARTS", "REASON"]
REPLICA_WIDE = ["URL", "PROFILE", "FABRIC", "LOAD", "LAST FAILURE"]


def replica_view(r: ReplicaRecord, shards: dict[str, ShardStatus]) -> ReplicaRecord:
    """The record as placement wrote it; `since`, `restarts` and the last failure taken from its
    shards' statuses where placement left them empty (a placement that predates them)."""
    mine = [shards[k] for k in r.shards if k in shards]
    changes: dict[str, Any] = {}
    if not r.restarts and mine:
        changes["restarts"] = sum(s.restarts for s in mine)
    failed = max(mine, key=lambda s: s.last_failure_at, default=None)
    if failed is not None and r.state != "ready":
        if not r.last_failure and failed.last_failure:
            changes["last_failure"] = failed.last_failure
        if r.failure is None and failed.failure is not None:
            changes["failure"] = failed.failure
    if not r.since:
        changes["since"] = r.updated_at
    return msgspec.structs.replace(r, **changes) if changes else r


def replica_nodes(r: ReplicaRecord) -> str:
    return ",".join(m.node for m in r.members) or "-"


def replica_load(r: ReplicaRecord, shards: Mapping[str, ShardStatus]) -> str:
    """What the replica's engines said of their load at the last read; `-` if none was read
    (not ready, or an engine whose load the launcher cannot read)."""
    loads = [s.load for k in r.shards if (s := shards.get(k)) is not None and s.load is not None]
    load = EngineLoad.combined(loads)
    return load.summary if load is not None else "-"


def replica_row(
    r: ReplicaRecord,
    *,
    wide: bool = False,
    now: float | None = None,
    shards: Mapping[str, ShardStatus] | None = None,
) -> list[str]:
    now = now or time.time()
    row = [
        replica_name(r.deployment, r.replica),
        r.state,
        replica_nodes(r),
        age(r.since, now),
        str(r.restarts),
        failures.one_line(r.reason) or "-",
    ]
    if wide:
        load = replica_load(r, shards or {})
        last = failures.summary(failures.failure_of(r)) or "-"
        row += [r.url or "-", r.profile, r.fabric or "-", load, last]
    return row


# --- shards ----------------------------------------------------------------------------------

SHARD_HEADERS = ["SHARD", "NODE", "STATE", "REPLICA", "RESTARTS", "SINCE", "REASON"]
SHARD_WIDE = ["PIDS", "URL", "LOAD", "LAST FAILURE"]


def shard_readings(c: Cluster) -> dict[str, NodeLiveness]:
    """Placement's judgement of each node, for how its shards read (`NodeLiveness.shard_reading`)."""
    return {n.node: n for n in c.judged.nodes} if c.judged else {}


def shard_row(
    s: ShardStatus,
    *,
    wide: bool = False,
    now: float | None = None,
    live: NodeLiveness | None = None,
) -> list[str]:
    """A shard as it reads now: a lost node's (by `live`, placement's word) is `unknown (node lost
    13 s ago)`, never the `ready` it last stored; its age by placement's clock."""
    offset = live.clock_offset_s if live is not None else 0.0
    row = [
        shard_name(s.node, s.shard),
        s.node,
        live.shard_reading(s.state) if live is not None else s.state,
        replica_name(s.deployment, s.replica) if s.deployment else s.replica,
        str(s.restarts),
        age(s.at - offset if s.at else 0.0, now or time.time()),
        failures.reason_line(s) or "-",
    ]
    if wide:
        load = s.load.summary if s.load is not None else "-"
        last = failures.summary(failures.failure_of(s)) or "-"
        row += [",".join(map(str, s.pids)) or "-", s.url or "-", load, last]
    return row


# --- profiles -----------------------------------------------------------------------------------

PROFILE_HEADERS = ["NAME", "ENGINE", "MODEL", "CLASS", "GPUS", "NODES"]
PROFILE_WIDE = ["TP", "PP", "SERVED AS", "DEPLOYMENTS"]


def profile_gpus(p: Profile) -> str:
    """GPUs one replica holds: per node, times nodes where it spans several; `0` for a profile
    with no GPU class, which asks for none and runs on CPUs (docs/engines.md)."""
    if not p.gpu_class:
        return "0"
    per = p.per_node_gpus
    return f"{per}x{p.nodes}" if p.nodes > 1 else str(per)


def profile_row(
    p: Profile, *, wide: bool = False, deployments: Mapping[str, Deployment] | None = None
) -> list[str]:
    row = [p.name, p.engine, p.model or p.model_path, p.gpu_class or "CPU", profile_gpus(p), str(p.nodes)]
    if wide:
        using = sorted(n for n, d in (deployments or {}).items() if d.profile == p.name)
        row += [str(p.tp), str(p.pp), p.served_name, ",".join(using) or "-"]
    return row


def describe_profile(p: Profile, deployments: Mapping[str, Deployment]) -> str:
    using = sorted(n for n, d in deployments.items() if d.profile == p.name)
    lines = [
        f"Name:         {p.name}",
        f"Engine:       {p.engine}",
        f"Model:        {p.model or '-'}",
        f"Model path:   {p.model_path or '-'}",
        f"Served as:    {p.served_name}",
        f"GPU class:    {p.gpu_class or '(none: runs on CPUs)'}",
        f"Parallelism:  tp {p.tp}, pp {p.pp}, {p.nodes} node{'s' if p.nodes > 1 else ''}, "
        + (
            f"{p.per_node_gpus} GPU{'' if p.per_node_gpus == 1 else 's'} a node"
            if p.gpu_class
            else "CPU only"
        ),
        f"Args:         {' '.join(p.args) or '-'}",
        # Names only: a value may be a token (`-o yaml` shows them).
        f"Env:          {', '.join(sorted(p.env)) or '-'}",
        f"Health wait:  {p.health_timeout_s:g} s",
        f"Deployments:  {', '.join(using) or '(none)'}",
    ]
    return "\n".join(lines)


# --- describe -----------------------------------------------------------------------------------


def _profile_line(p: Profile | None, name: str) -> str:
    if p is None:
        return f"{name} (not in the catalog)"
    gpus = f"{p.gpu_class or 'CPU'}, tp {p.tp}" + (f", pp {p.pp}" if p.pp > 1 else "")
    nodes = f", {p.nodes} nodes" if p.nodes > 1 else ""
    return f"{name} (engine {p.engine}, model {p.model or p.model_path}, {gpus}{nodes})"


def _indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


def describe_deployment(name: str, c: Cluster, history: list[Stamped], *, now: float | None = None) -> str:
    now = now or time.time()
    dep = c.deployments[name]
    status = c.statuses.get(name)
    replicas = [replica_view(r, c.shards) for r in c.replicas.values() if r.deployment == name]
    lines = [
        f"Name:         {name}",
        f"Profile:      {_profile_line(c.catalog.get(dep.profile), dep.profile)}",
        f"Pool:         {dep.pool or '(any)'}",
        f"Strategy:     {dep.strategy}",
    ]
    a = dep.autoscale
    if a is not None:
        lines.append(
            f"Autoscale:    {a.min_replicas} to {a.max_replicas} replicas, {a.target_in_flight:g} requests "
            f"in flight per replica, down after {a.scale_down_after_s:g} s"
        )
        scaled = [e.event for e in history if isinstance(e.event, ScaleDecision)]
        if scaled:
            last = scaled[-1]
            lines.append(f"Last scaled:  {last.reason} ({age(last.at, now)} ago)")
    desired = status.desired if status is not None and a is not None else dep.replicas
    if status is not None:
        lines.append(
            f"Replicas:     {desired} desired, {status.ready} ready, {status.pending} pending, "
            f"{status.unplaceable} unplaceable (placement, {age(status.at, now)} ago)"
        )
        if status.summary:
            lines.append(f"Summary:      {status.summary}")
    else:
        lines.append(f"Replicas:     {dep.replicas} desired; placement has not published a status yet")
    if status is not None and status.reasons:
        lines += ["", *refusal_lines(name, [(r.node, r.reason) for r in status.reasons])]
    lines += ["", "Replicas:"]
    if replicas:
        rows = []
        for r in sorted(replicas, key=lambda r: r.replica):
            gpus = _replica_gpus(r, c)
            rows.append(
                [
                    r.replica,
                    r.state,
                    replica_nodes(r),
                    gpus,
                    age(r.since, now),
                    str(r.restarts),
                    replica_load(r, c.shards),
                    failures.one_line(r.reason) or "-",
                ]
            )
        headers = ["REPLICA", "STATE", "NODES", "GPUS", "SINCE", "RESTARTS", "LOAD", "REASON"]
        lines.append(_indent(table(headers, rows)))
        for r in sorted(replicas, key=lambda r: r.replica):
            failure = failures.failure_of(r)
            if failure is not None:
                said = failures.details(failure)
                lines += ["", f"Last failure of {r.replica}{f' ({said})' if said else ''}:"]
                lines.append(_indent(failures.text(failure)))
    else:
        lines.append("  (none)")
    return "\n".join([*lines, "", "Events:", _recent(history)])


def refusal_lines(deployment: str, reasons: list[tuple[str, str]]) -> list[str]:
    """A refusal under `describe`: every node's reason when a few; else grouped by reason, with
    how many nodes gave it and a few of their names, as the page shows it (500 nodes' reasons
    were 500 lines). `llmgw ctl explain` lists every node's."""
    from llmgw_placement.view import REASON_GROUPS, reason_groups

    if len(reasons) <= REASON_GROUPS:
        return [
            "Refusal (every node's reason):",
            _indent(table(["NODE", "REASON"], [list(r) for r in reasons])),
        ]
    top, other, on = reason_groups(reasons)
    rows = [
        [str(g.nodes), g.reason, ", ".join(g.examples) + (", …" if g.nodes > len(g.examples) else "")]
        for g in top
    ]
    if other:
        rows.append([str(on), f"({other} other reasons)", "-"])
    return [
        f"Refusal ({len(reasons)} nodes, by reason; `llmgw ctl explain {deployment}` lists every node's):",
        _indent(table(["NODES", "REASON", "FOR EXAMPLE"], rows)),
    ]


def _recent(history: list[Stamped]) -> str:
    """The last 20 events, indented, or a line saying there are none."""
    return _indent("\n".join(event_line(e) for e in history[-20:])) if history else "  (none in the stream)"


def _replica_gpus(r: ReplicaRecord, c: Cluster) -> str:
    """The GPU names of the replica's nodes, as their installers reported them."""
    names = []
    for m in r.members:
        node = c.nodes.get(m.node)
        if node is not None and node.facts.gpus:
            names.append(node.facts.gpus[0].name)
    return ", ".join(sorted(set(names))) or "-"


def describe_node(v: NodeView, c: Cluster, history: list[Stamped], *, now: float | None = None) -> str:
    # Imported here: importing llmgw_placement imports its whole service (uvicorn, starlette,
    # prometheus), a third of what `llmgw ctl get nodes` spent starting.
    from llmgw_placement.gpuclass import gpu_class

    now = now or time.time()
    s = v.status
    f = s.facts
    lines = [
        f"Node:         {v.node}",
        f"State:        {v.state}",
        f"Address:      {f.mgmt_addr or '-'}" + (f" ({f.mgmt_iface})" if f.mgmt_iface else ""),
        f"System:       {f.os_id} {f.os_version}, kernel {f.kernel or '-'}, {f.arch or '-'}",
        f"CPU:          {f.cpu_model or '-'}, {f.cores} cores, {f.memory_mb // 1024} GiB"
        + ("" if f.has_avx2 else " (no AVX2)"),
        f"Driver:       {f.nvidia_driver or 'none'}" + (f" (CUDA {f.cuda_driver})" if f.cuda_driver else ""),
        f"HCAs:         {', '.join(f.hcas) or 'none'}",
        f"Probed:       {age(s.probed_at - v.clock_offset_s, now) + ' ago' if s.probed_at else 'never'}",
        f"Install:      {v.install or s.install or '-'}",
        f"Warnings:     {'; '.join((*v.problems, *s.warnings, *missing_words(v))) or '-'}",
        "",
        "GPUs:",
    ]
    gpu_rows = [
        [str(g.index), gpu_class(g), g.name, g.compute_capability or "-", f"{g.memory_mb} MiB"]
        for g in f.gpus
    ]
    lines.append(
        _indent(table(["INDEX", "CLASS", "NAME", "CC", "MEMORY"], gpu_rows)) if gpu_rows else "  (none)"
    )
    lines += ["", "Engines:"]
    eng_rows = [
        [
            e.name,
            e.version or "-",
            e.engine_version or "-",
            e.state,
            "; ".join(w for w in (e.detail, f"CPU build only: {e.cpu_only}" if e.cpu_only else "") if w)
            or "-",
        ]
        for e in s.engines
    ]
    lines.append(
        _indent(table(["ENGINE", "VERSION", "ENGINE SAYS", "STATE", "DETAIL"], eng_rows))
        if eng_rows
        else "  (none)"
    )
    shards = [st for st in c.shards.values() if st.node == v.node]
    lines += ["", "Shards:"]
    if shards:
        live = shard_readings(c).get(v.node)
        rows = [shard_row(st, now=now, live=live) for st in sorted(shards, key=lambda st: st.shard)]
        lines.append(_indent(table(SHARD_HEADERS, rows)))
    else:
        lines.append("  (none)")
    return "\n".join([*lines, "", "Events:", _recent(history)])


# --- events -------------------------------------------------------------------------------------


def event_text(e: object) -> tuple[str, str, str]:
    """What happened, in one line: (kind, object, message)."""
    if isinstance(e, ShardStatus):
        text = e.state + _said(e.state, failures.reason_line(e) if e.reason else "")
        return "shard", shard_name(e.node, e.shard), text
    if isinstance(e, ReplicaStatus):
        return (
            "replica",
            replica_name(e.deployment, e.replica),
            e.state + _said(e.state, failures.one_line(e.reason)),
        )
    if isinstance(e, PlacementDecision):
        if e.outcome == "placed":
            return "placement", replica_name(e.deployment, e.replica), f"placed on {', '.join(e.nodes)}"
        # Imported here, as `describe node` does: only a refusal pays for it.
        from llmgw_placement.view import REASON_GROUPS, reasons_text

        said = reasons_text((r.node, r.reason) for r in e.reasons)
        grouped = len(e.reasons) > REASON_GROUPS  # `refused on 500 nodes: …`
        return "placement", replica_name(e.deployment, e.replica), f"refused{' ' if grouped else ': '}{said}"
    if isinstance(e, DeploymentStatus):
        text = e.summary or f"{e.ready} of {e.desired} ready"
        return "deployment", e.deployment, text
    if isinstance(e, ScaleDecision):
        return "scale", e.deployment, e.reason
    if isinstance(e, InstallProgress):
        return (
            "install",
            e.node,
            f"{e.engine}: {e.message}" + ("" if e.outcome == "running" else f" ({e.outcome})"),
        )
    if isinstance(e, EngineInventory):
        engines = ", ".join(engine_words(x) for x in e.engines) or "none"
        return "engines", e.node, engines
    if isinstance(e, NodeLifecycle):
        return "node", e.node, e.state
    if isinstance(e, NodeFacts):
        return "facts", e.node, f"{len(e.gpus)} GPUs, {e.cores} cores, {e.os_id} {e.os_version}".strip()
    return "event", "-", type(e).__name__


def _said(state: str, reason: str) -> str:
    """`: why` after a state, without the state said twice: placement's reason for a replica it
    drains reads `draining: scaled down`, and `draining: draining: scaled down` was printed."""
    why = reason.removeprefix(f"{state}: ")
    return f": {why}" if why else ""


# The most characters of an event's message: a reason quotes what a node or an engine said.
EVENT_CHARS = 600


def event_line(s: Stamped) -> str:
    kind, obj, text = event_text(s.event)
    if len(text) > EVENT_CHARS:
        text = text[:EVENT_CHARS] + "…"
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.time))
    return f"{stamp}  {kind:<10}  {obj}  {text}"


def event_json(s: Stamped) -> str:
    return msgspec.json.encode({"time": s.time, "subject": s.subject, "event": to_builtins(s.event)}).decode()
