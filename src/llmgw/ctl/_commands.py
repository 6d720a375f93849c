"""`llmgw ctl`'s commands: read or write through the bus, print, and exit with a code a script can test."""

from __future__ import annotations

import argparse
import difflib
import logging
import re
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import nats.errors
from opentelemetry import trace

from llmgw_core.access import PermissionDenied
from llmgw_core.adapter_rules import all_adapters, deployment_meets_adapters
from llmgw_core.bus import Bus
from llmgw_core.engines import Profile, ShardSpec
from llmgw_core.errors import BusError, ConfigError, StoreFull
from llmgw_core.events import (
    Autoscale,
    Deployment,
    DeploymentStatus,
    NodeStatus,
    ReplicaRecord,
    ShardLogsRequest,
    ShardStatus,
)
from llmgw_core.limits import (
    DOCUMENT_MAX_BYTES,
    NAME_MAX,
    document_problem,
    name_problem,
    profile_problem,
    shown,
)
from llmgw_core.subjects import ALL, ENGINES_KEY, ONE, Names
from llmgw_core.telemetry import current_traceparent
from llmgw_core.validate import check_deployment, check_profile, names_problem

from .._bus_flags import bus_options
from .._parser import stdout_closed
from . import _read as read
from . import _views as views
from ._args import KINDS
from ._errors import CannotStore, Conflict, CtlError, NotFound, Refused, Unreachable, UsageError

if TYPE_CHECKING:
    from llmgw_placement.config import ServerConfig

    from . import _apply

tracer = trace.get_tracer("llmgw.ctl")

CONNECT_TIMEOUT_S = 3.0
# A one-shot command that has connected but gets no answers within this long gives up (exit 5).
COMMAND_TIMEOUT_S = 30.0
# How long `deploy` waits for placement's word on the new replica count before judging capacity itself.
DEPLOY_STATUS_WAIT_S = 3.0
# How long a command that follows (`--watch`, `--follow`) holds nats-server's refusals of its
# identity: one that fails its first reads is said in the error line, not twice.
FOLLOW_REFUSALS_AFTER_S = 5.0


class StdoutClosed(Exception):
    """Stdout's reader went away (`llmgw ctl get nodes | head`): told apart from a NATS socket's
    broken pipe, which is a fault of the connection."""


def out(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError as exc:
        raise StdoutClosed() from exc


def warn(text: str) -> None:
    print(f"llmgw: {text}", file=sys.stderr, flush=True)


def check_name(what: str, name: str) -> None:
    """Refuse a name the cluster would refuse, in the words the API uses: one over the length
    limit is refused (exit 4), one that is no name at all is a usage error (exit 2)."""
    problem = name_problem(what, name)
    if problem is None:
        return
    if len(name) > NAME_MAX:
        raise Refused(problem)
    raise UsageError(problem)


# Any key the deployments bucket can hold (what NATS allows in a KV key), so that `delete`
# removes one no reader accepts: a name over the limits, or with a dot, written by hand.
_STORED_KEY = re.compile(r"^[-/_=A-Za-z0-9]([-/_=.A-Za-z0-9]*[-/_=A-Za-z0-9])?$")


# --- kept from the first ctl (tests and scripts call these) -------------------------------


async def nodes(bus: Bus) -> str:
    c = await read.cluster(bus, what=frozenset({"nodes"}))
    return views.table(views.NODE_HEADERS, [views.node_row(v) for v in views.node_views(c)])


async def explain(bus: Bus, deployment: str) -> str:
    """Why the deployment stands as it does now: placement's last published status of it (ready
    of desired, and every node's reason for what cannot be placed), never an older decision."""
    await stored_deployment(bus, deployment)
    status = await read.last_on(bus, bus.names.deployment_event(deployment), DeploymentStatus)
    if status is None:
        return f"{deployment}: not judged by a placement yet"
    if not status.reasons:
        return status.summary
    rows = [[r.node, r.reason] for r in status.reasons]
    return f"{status.summary}\n" + views.table(["NODE", "REASON"], rows)


async def deploy(bus: Bus, deployment: Deployment) -> Deployment:
    """Write a deployment; the trace started here follows it through placement and the launchers."""
    with tracer.start_as_current_span(f"ctl deploy {deployment.name}"):
        deployment = msgspec.structs.replace(deployment, traceparent=current_traceparent())
        await bus.put(bus.names.deployments_bucket, deployment.name, deployment)
    return deployment


def read_apply_file(path: str) -> tuple[ServerConfig, frozenset[str]]:
    """A server.yaml for `apply`, read and checked on its own (ConfigError naming the file, and
    the line and column of a syntax error): its config, and the sections it names. Done before
    ctl connects, so that a broken file is told as such with or without a cluster."""
    from pathlib import Path

    from llmgw_core.config import loads

    from . import _apply

    try:
        with Path(path).open("rb") as f:
            raw = f.read(DOCUMENT_MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    problem = document_problem(raw)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    from llmgw_placement.config import ServerConfig

    try:
        config = loads(raw, ServerConfig, source=path)
        named = _apply.named_sections(raw)
    except RecursionError as exc:  # measured above; kept as the last word should one get by
        raise ConfigError(f"{path}: nested too deep to read") from exc
    for dep in config.deployments if "deployments" in named else ():
        problem = check_deployment(dep.name, dep.wire(), max_replicas=config.max_replicas)
        if problem:
            raise ConfigError(f"{path}: {problem}")
    for entry in config.catalog if "catalog" in named else ():
        problem = check_profile(entry.name, entry.wire())
        if problem:
            raise ConfigError(f"{path}: {problem}")
    return config, named


async def _live(bus: Bus) -> _apply.Live:
    """The desired state as the buckets hold it now, with each key's revision. A key whose value
    does not decode has its revision and no value: the file, if it names it, writes over it."""
    from llmgw_core.events import DesiredEngines

    from . import _apply

    names = bus.names
    revisions: dict[tuple[str, str], int] = {}

    async def undecoded(kind: str, bucket: str, keys: set[str]) -> None:
        for key in sorted(keys):
            history = await bus.revisions(bucket, key)
            if history and history[0][1] is not None:
                revisions[(kind, key)] = history[0][0]

    try:
        found = await bus.get(names.config_bucket, ENGINES_KEY, DesiredEngines)
    except (msgspec.DecodeError, msgspec.ValidationError):
        found = None
        await undecoded("engines", names.config_bucket, {ENGINES_KEY})
        revisions[("engines", "")] = revisions.pop(("engines", ENGINES_KEY), 0)
    if found is not None:
        revisions[("engines", "")] = found[1]
    catalog = await bus.entries(names.catalog_bucket, Profile)
    deployments = await bus.entries(names.deployments_bucket, Deployment)
    for kind, bucket, entries in (
        ("profile", names.catalog_bucket, catalog),
        ("deployment", names.deployments_bucket, deployments),
    ):
        revisions |= {(kind, k): c.revision for k, c in entries.items() if c.value is not None}
        await undecoded(kind, bucket, await bus.keys(bucket) - set(entries))
    return _apply.Live(
        engines=found[0].engines if found else None,
        catalog={k: c.value for k, c in catalog.items() if c.value is not None},
        deployments={k: c.value for k, c in deployments.items() if c.value is not None},
        revisions=revisions,
    )


async def apply(
    bus: Bus,
    path: str,
    *,
    dry_run: bool = False,
    prune: bool = False,
    checked: tuple[ServerConfig, frozenset[str]] | None = None,
    between: Callable[[str], Awaitable[None]] | None = None,
) -> str:
    """Write what a server.yaml names (its engines, profiles and deployments), and nothing else.

    A section the file omits is left as it is; what a named section omits is deleted only with
    `prune`. Every reference is checked against the file and the live state before anything is
    written (Refused, nothing written). `dry_run` says what would change and writes nothing.
    `checked`: the file as `read_apply_file` gave it, if it was read already.

    Compare-and-set: every key is written only at the revision the plan was made from (a key
    the plan adds, only while it has none), and just before writing the live state is read
    again; another writer's change in between (a `scale`, another apply) is Conflict (exit 5),
    naming what it changed. Without it, two applies of one deployment at once both exited 0,
    each having printed a diff the other's write made false, and the last writer won.
    `between(stage)` is awaited after the plan (`compared`) and after the second read
    (`checked`): where a test makes another writer's change land.
    """
    from llmgw_core.engines import default_registry
    from llmgw_core.events import DesiredEngines

    from . import _apply

    config, named = checked or read_apply_file(path)
    names = bus.names
    live = await _live(bus)
    plan = _apply.plan(config, named, live, prune=prune)
    problems = _apply.reference_problems(
        config, named, live, plan, engines=default_registry().names(), path=path
    )
    if problems:
        raise Refused("\n".join(problems) + "\nnothing was written")
    lines = plan.lines()
    if dry_run:
        return "\n".join([*lines, f"dry run of {path}: nothing written; {plan.counts()}"])
    again = "run the apply again (`--dry-run` shows what it would change now)"
    if between is not None:
        await between("compared")
    moved = _apply.moved(plan, live, await _live(bus))
    if moved:
        raise Conflict(
            f"{path} was compared with a state another writer has changed since: {'; '.join(moved)}; "
            f"nothing was written; {again}"
        )
    if between is not None:
        await between("checked")
    done: list[str] = []

    async def write(what: str, bucket: str, key: str, value: msgspec.Struct, kind: str, name: str) -> None:
        last = live.revisions.get((kind, name), 0)
        if last:
            written = await bus.update(bucket, key, value, last=last)
        else:
            written = await bus.create(bucket, key, value)
        if written is None:
            raise Conflict(
                f"{what} was {'changed' if last else 'written'} by another writer after {path} was "
                f"compared with it; written before that: {', '.join(done) or 'nothing'}; {again}"
            )
        done.append(what)

    writes = {(c.kind, c.name) for c in plan.changes if c.action in ("added", "changed")}
    if ("engines", "") in writes:
        engines = DesiredEngines(engines=plan.engines)
        await write("engines", names.config_bucket, ENGINES_KEY, engines, "engines", "")
    for name, profile in sorted(plan.profiles.items()):
        if ("profile", name) in writes:
            await write(f"profile {name}", names.catalog_bucket, name, profile, "profile", name)
    for name, wanted in sorted(plan.deployments.items()):
        if ("deployment", name) in writes:
            with tracer.start_as_current_span(f"ctl apply {name}"):
                wanted = msgspec.structs.replace(wanted, traceparent=current_traceparent())
                await write(f"deployment {name}", names.deployments_bucket, name, wanted, "deployment", name)
    # Deployments before the profiles they may name, so no deployment is left naming nothing.
    # (A delete is not conditioned: the second read above is what guards it.)
    for change in plan.of("deleted", "deployment"):
        await bus.delete(names.deployments_bucket, change.name)
    for change in plan.of("deleted", "profile"):
        await bus.delete(names.catalog_bucket, change.name)
    if done or plan.of("deleted", "deployment") or plan.of("deleted", "profile"):
        await _acted_on(bus, f"{path} applied")
    return "\n".join([*lines, f"applied {path}: {plan.counts()}"])


async def stored_deployment(bus: Bus, name: str) -> Deployment:
    """The deployment stored under `name`; NotFound when there is none, Refused when what is
    stored does not decode (written by hand, or by a writer of another schema)."""
    try:
        found = await bus.get(bus.names.deployments_bucket, name, Deployment)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise Refused(
            f"deployment {name}: the stored value is not a deployment ({exc}); "
            f"`llmgw ctl delete deployment {name}` removes it"
        ) from exc
    if found is None:
        raise NotFound(f"no deployment {name} (`llmgw ctl get deployments` lists them)")
    return found[0]


async def delete_deployment(bus: Bus, name: str) -> str:
    """Delete the deployment stored under `name`, whatever its value holds: one that does not
    decode, or breaks a rule, is removed like any other (its value is never read)."""
    if not _STORED_KEY.match(name):
        raise UsageError(
            f"deployment {shown(name)} cannot be a stored key: a key holds letters, digits and "
            "'-', '_', '/', '=', '.' (not first or last)"
        )
    if name not in await bus.keys(bus.names.deployments_bucket):
        raise NotFound(f"no deployment {shown(name) if len(name) > NAME_MAX else name}")
    await bus.delete(bus.names.deployments_bucket, name)
    said = shown(name) if len(name) > NAME_MAX else name
    await _acted_on(bus, f"deployment {said} deleted")
    return f"deployment {said} deleted: its replicas stop"


async def _acted_on(bus: Bus, written: str) -> None:
    """A write that landed is done only if placement can act on it: while NATS refuses
    placement's writes for space, the change waits, and the command says so and fails."""
    blocked = await read.cannot_write(bus)
    if blocked:
        raise CannotStore(
            f"{written}, but placement cannot act on it: {blocked}; it does once NATS stores again "
            "(docs/operations.md)"
        )


# --- deploy and scale --------------------------------------------------------------------


def autoscale_of(args: argparse.Namespace) -> Autoscale | None:
    """The bounds `--min-replicas`/`--max-replicas` ask for; None when neither is given. Not
    checked here: `check_deployment` refuses bad bounds with placement's own words (exit 4)."""
    given = {
        "--min-replicas": args.min_replicas,
        "--max-replicas": args.max_replicas,
        "--target-in-flight": args.target_in_flight,
        "--scale-down-after": args.scale_down_after,
    }
    if args.min_replicas is None and args.max_replicas is None:
        extra = [flag for flag, value in given.items() if value is not None]
        if extra:
            raise UsageError(
                f"{' and '.join(extra)} need --min-replicas and --max-replicas "
                "(the bounds to follow demand in)"
            )
        return None
    if args.min_replicas is None or args.max_replicas is None:
        missing = "--min-replicas" if args.min_replicas is None else "--max-replicas"
        raise UsageError(f"{missing} is missing: following demand needs both bounds")
    a = Autoscale(min_replicas=args.min_replicas, max_replicas=args.max_replicas)
    if args.target_in_flight is not None:
        a = msgspec.structs.replace(a, target_in_flight=args.target_in_flight)
    if args.scale_down_after is not None:
        a = msgspec.structs.replace(a, scale_down_after_s=args.scale_down_after)
    return a


async def request_replicas(bus: Bus, dep: Deployment, verb: str) -> str:
    """Check a deployment against the catalog, write it, and warn when the cluster is short of it."""
    check_name("deployment", dep.name)
    if dep.replicas < 0:
        raise UsageError(f"--replicas {dep.replicas}: a replica count is 0 or more")
    # Placement's own rules, before anything is read or written: what it would dead-letter is
    # refused here, with the words its API uses.
    problem = check_deployment(dep.name, dep)
    if problem:
        raise Refused(problem)
    catalog = await read.values(bus, bus.names.catalog_bucket, Profile)
    problem = profile_problem(dep.name, dep.profile, catalog)
    if problem:
        raise Refused(problem)
    # A name that is another deployment's alias would take its traffic, and its keys' scope.
    others = await read.values(bus, bus.names.deployments_bucket, Deployment)
    problem = names_problem(dep, others.values()) or deployment_meets_adapters(dep, all_adapters(catalog))
    if problem:
        raise Refused(f"{problem}; nothing was written")
    seen: list[DeploymentStatus] = []
    got = anyio.Event()

    async def on_status(status: DeploymentStatus, _subject: str) -> None:
        # An autoscaled deployment's count is placement's to choose within its bounds.
        a = dep.autoscale
        if (
            status.desired == dep.replicas
            if a is None
            else a.min_replicas <= status.desired <= a.max_replicas
        ):
            seen.append(status)
            got.set()

    async with anyio.create_task_group() as tg:
        await tg.start(bus.subscribe_core, bus.names.deployment_event(dep.name), DeploymentStatus, on_status)
        await deploy(bus, dep)
        with anyio.move_on_after(DEPLOY_STATUS_WAIT_S):
            await got.wait()
        tg.cancel_scope.cancel()
    if not seen:
        await _acted_on(bus, f"deployment {dep.name}: {dep.replicas} x {dep.profile} written")
    if seen:
        status = seen[-1]
        if status.unplaceable:
            warn(
                f"warning: {status.unplaceable} of {dep.replicas} replicas of {dep.name} cannot be "
                f"placed now: {status.summary or 'see `llmgw ctl describe deployment ' + dep.name + '`'}"
            )
    else:
        shortfall = await _capacity_shortfall(bus, dep, catalog[dep.profile])
        if shortfall:
            warn(
                f"warning: {shortfall} (placement has not said yet; "
                f"`llmgw ctl describe deployment {dep.name}`)"
            )
    if dep.autoscale is not None:
        a = dep.autoscale
        return (
            f"deployment {dep.name}: {a.min_replicas} to {a.max_replicas} x {dep.profile} {verb}, "
            f"following demand ({a.target_in_flight:g} requests in flight per replica)"
        )
    return f"deployment {dep.name}: {dep.replicas} x {dep.profile} {verb}"


async def _capacity_shortfall(bus: Bus, dep: Deployment, profile: Profile) -> str:
    """From the nodes' own view: GPUs on alive nodes not held by any shard, against what the new
    replicas need. Coarse (GPU classes and pools are placement's to judge), so only a warning."""
    c = await read.cluster(bus, what=frozenset({"nodes", "replicas"}))
    if c.judged is None:
        return ""
    alive = {n.node for n in c.judged.nodes if n.alive}
    specs = await read.values(bus, bus.names.shards_bucket, ShardSpec)
    held = sum(len(s.gpus) for s in specs.values() if s.node in alive)
    total = sum(len(st.facts.gpus) for name, st in c.nodes.items() if name in alive)
    existing = sum(1 for r in c.replicas.values() if r.deployment == dep.name)
    per_replica = profile.per_node_gpus * max(1, profile.nodes)
    needed = max(0, dep.replicas - existing) * per_replica
    free = total - held
    if needed > free:
        return (
            f"{dep.replicas - existing} more replicas of {dep.name} need {needed} GPUs; "
            f"alive nodes have {free} free, short by {needed - free}"
        )
    return ""


# --- get --------------------------------------------------------------------------------------


def replica_key(name: str) -> str:
    """The replicas bucket's key for `chat/r0` (or the older spelling `chat.r0`, kept as it is)."""
    return name.replace("/", ".", 1)


def shard_key(name: str) -> str:
    """The shard statuses' key for `node-1/chat-r0-0` (or `node-1.chat-r0-0`); a bare shard id
    is returned as it is and matched against the shards' own ids."""
    return name.replace("/", ".", 1)


def _close(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, [str(k) for k in known], n=1)
    return f"; did you mean {close[0]}?" if close else ""


def _pick(
    items: dict[str, Any], name: str, what: str, match: Callable[[Any], bool], *, shown: Any = None
) -> list[Any]:
    if name in items:
        return [items[name]]
    found = [v for v in items.values() if match(v)]
    if not found:
        raise NotFound(
            f"no {what} {name}{_close(name, shown if shown is not None else items)} "
            f"(`llmgw ctl get {what}s` lists them)"
        )
    return found


def _names(kind: str, items: list[Any]) -> str:
    """`-o name`: KIND/NAME a line, as kubectl prints them, for `xargs` and `while read`."""
    if kind == "node":
        names = [v.node for v in items]
    elif kind in ("deployment", "profile"):
        names = [v.name for v in items]
    elif kind == "replica":
        names = [views.replica_name(r.deployment, r.replica) for r in items]
    else:
        names = [views.shard_name(s.node, s.shard) for s in items]
    return "\n".join(f"{kind}/{n}" for n in names)


async def get(bus: Bus, kind: str, name: str, output: str) -> str:
    wide = output == "wide"
    now = time.time()
    if kind == "node":
        c = await read.cluster(bus, what=frozenset({"nodes"}))
        items: list[Any] = views.node_views(c)
        if name:
            items = _pick({v.node: v for v in items}, name, "node", lambda _: False)
        headers = views.NODE_HEADERS + (views.NODE_WIDE if wide else [])
        rows = [views.node_row(v, wide=wide, now=now) for v in items]
    elif kind == "deployment":
        c = await read.cluster(bus, what=frozenset({"deployments"}))
        items = views.deployment_views(c)
        if name:
            items = _pick({v.name: v for v in items}, name, "deployment", lambda _: False)
        headers = views.DEPLOYMENT_HEADERS + (views.DEPLOYMENT_WIDE if wide else [])
        rows = [views.deployment_row(v, wide=wide) for v in items]
        if not items and not name:
            from . import _backup

            lost = await _backup.none_stored(bus, bus.names.deployments_bucket, "deployments")
            if lost:
                warn(lost)
    elif kind == "replica":
        c = await read.cluster(bus, what=frozenset({"replicas", "shards"}))
        records = {k: views.replica_view(r, c.shards) for k, r in c.replicas.items()}
        items = list(records.values())
        if name:
            items = _pick(
                records,
                replica_key(name),
                "replica",
                lambda r: r.deployment == name,
                shown=[views.replica_name(r.deployment, r.replica) for r in items]
                + sorted({r.deployment for r in items}),
            )
        headers = views.REPLICA_HEADERS + (views.REPLICA_WIDE if wide else [])
        rows = [views.replica_row(r, wide=wide, now=now, shards=c.shards) for r in items]
    elif kind == "profile":
        c = await read.cluster(bus, what=frozenset({"catalog", "deployments"}))
        items = list(c.catalog.values())
        if name:
            items = _pick(c.catalog, name, "profile", lambda _: False)
        headers = views.PROFILE_HEADERS + (views.PROFILE_WIDE if wide else [])
        rows = [views.profile_row(p, wide=wide, deployments=c.deployments) for p in items]
    else:
        c = await read.cluster(bus, what=frozenset({"shards", "liveness"}))
        items = list(c.shards.values())
        if name:
            key = replica_key(name)
            items = _pick(
                c.shards,
                shard_key(name),
                "shard",
                lambda s: (
                    name == s.shard
                    or s.deployment == name
                    or key == Names.replica_key(s.deployment, s.replica)
                ),
                shown=[views.shard_name(s.node, s.shard) for s in items],
            )
        headers = views.SHARD_HEADERS + (views.SHARD_WIDE if wide else [])
        judged = views.shard_readings(c)
        rows = [views.shard_row(s, wide=wide, now=now, live=judged.get(s.node)) for s in items]
    if output == "name":
        return _names(kind, items)
    if output in ("json", "yaml"):
        single = name and len(items) == 1 and _exact(kind, name, items[0])
        return views.render_data(items[0] if single else items, output)
    return views.table(headers, rows)


def _exact(kind: str, name: str, item: Any) -> bool:
    """Whether NAME named this one item (its key), not a group it belongs to."""
    if kind == "node":
        return bool(item.node == name)
    if kind in ("deployment", "profile"):
        return bool(item.name == name)
    if kind == "replica":
        return bool(Names.replica_key(item.deployment, item.replica) == replica_key(name))
    return bool(name == item.shard or shard_key(name) == Names.shard_key(item.node, item.shard))


async def watch(bus: Bus, kind: str, name: str, output: str) -> None:
    """The table (or JSON lines) now, then each changed row as its key changes, until interrupted."""
    if output in ("json", "yaml"):
        # One JSON object a line: a stream a script reads line by line.
        first = "\n".join(msgspec.json.encode(x).decode() for x in await _items(bus, kind, name))
    else:
        first = await get(bus, kind, name, output)
    if first:
        out(first)
    header_line = "" if output in ("json", "yaml", "name") or not first else first.splitlines()[0]
    wide = output == "wide"
    n = bus.names
    bucket: str
    value_type: type[Any]
    bucket, value_type = {
        "node": (n.nodes_bucket, NodeStatus),
        "deployment": (n.deployments_bucket, Deployment),
        "replica": (n.replicas_bucket, ReplicaRecord),
        "shard": (n.shard_status_bucket, ShardStatus),
        "profile": (n.catalog_bucket, Profile),
    }[kind]
    revisions = {k: ch.revision for k, ch in (await bus.entries(bucket, value_type)).items()}
    statuses: dict[str, DeploymentStatus] = {}
    # The keys whose rows were printed: only their deletes are news. The watch first replays
    # each key's last change, and a key deleted long ago has a delete marker as its last:
    # every deployment ever deleted was printed `deleted` on every `-w`.
    printed = set(revisions)

    def emit(key: str, item: Any, deleted: bool) -> None:
        if name and not _matches(kind, name, key, item):
            return
        if deleted:
            if key not in printed:
                return
            printed.discard(key)
        else:
            printed.add(key)
        if output in ("json", "yaml"):
            data = {"key": key, "deleted": True} if deleted else views.to_builtins(item)
            out(msgspec.json.encode(data).decode())
            return
        if output == "name":
            out(f"{kind}/{_shown_key(kind, key)}")
            return
        if deleted:
            row = [_shown_key(kind, key), "deleted"]
        elif kind == "node":
            row = views.node_row(item, wide=wide)
        elif kind == "deployment":
            row = views.deployment_row(item, wide=wide)
        elif kind == "replica":
            row = views.replica_row(item, wide=wide)
        elif kind == "profile":
            row = views.profile_row(item, wide=wide)
        else:
            row = views.shard_row(item, wide=wide)
        out(views.under(header_line, row))

    async def on_change(key: str, value: Any) -> None:
        if kind == "node" and value is not None:
            judged = await read.liveness(bus)
            live = {x.node: x for x in judged.nodes} if judged else {}
            value = views.node_view(key, value, live.get(key), judged is not None)
        elif kind == "deployment" and value is not None:
            value = views.DeploymentView(name=key, deployment=value, status=statuses.get(key))
        emit(key, value, value is None)

    async with anyio.create_task_group() as tg:
        if kind == "deployment":
            deployments: dict[str, Deployment] = {}

            async def on_status(status: DeploymentStatus, _subject: str) -> None:
                statuses[status.deployment] = status
                dep = deployments.get(status.deployment)
                if dep is not None:
                    await on_change(status.deployment, dep)

            await tg.start(bus.subscribe_core, n.deployment_event(ONE), DeploymentStatus, on_status)
            statuses.update(await read.deployment_statuses(bus, list(revisions)))
        async for change in bus.watch(bucket, value_type):
            if change.revision <= revisions.get(change.key, 0):
                if kind == "deployment" and change.value is not None:
                    deployments[change.key] = change.value
                continue
            revisions[change.key] = change.revision
            if kind == "deployment":
                if change.value is None:
                    deployments.pop(change.key, None)
                else:
                    deployments[change.key] = change.value
            await on_change(change.key, change.value)


async def _items(bus: Bus, kind: str, name: str) -> list[Any]:
    data = msgspec.json.decode(await get(bus, kind, name, "json"))
    return data if isinstance(data, list) else [data]


def _shown_key(kind: str, key: str) -> str:
    """A bucket key as ctl names the object: `chat.r0` is `chat/r0`, `n1.chat-r0-0` is `n1/chat-r0-0`."""
    return key.replace(".", "/", 1) if kind in ("replica", "shard") else key


def _matches(kind: str, name: str, key: str, item: Any) -> bool:
    if key == name or (kind in ("replica", "shard") and key == replica_key(name)):
        return True
    if kind == "replica":
        return key.split(".", 1)[0] == name
    if kind == "shard":
        if key.split(".", 1)[-1] == name or bool(item is not None and item.deployment == name):
            return True
        return bool(
            item is not None and Names.replica_key(item.deployment, item.replica) == replica_key(name)
        )
    return False


# --- describe -----------------------------------------------------------------------------------


async def describe(bus: Bus, kind: str, name: str) -> str:
    n = bus.names
    if kind == "profile":
        check_name("profile", name)
        c = await read.cluster(bus, what=frozenset({"catalog", "deployments"}))
        if name not in c.catalog:
            raise NotFound(
                f"no profile {name}{_close(name, c.catalog)} (`llmgw ctl get profiles` lists them)"
            )
        return views.describe_profile(c.catalog[name], c.deployments)
    if kind == "deployment":
        check_name("deployment", name)
        c = await read.cluster(bus, what=frozenset({"deployments", "replicas", "shards", "catalog", "nodes"}))
        if name not in c.deployments:
            raise NotFound(
                f"no deployment {name}{_close(name, c.deployments)} (`llmgw ctl get deployments` lists them)"
            )
        shard_keys = {k for r in c.replicas.values() if r.deployment == name for k in r.shards}
        subjects = [
            n.replica_event(name, ALL),
            n.placement_event(name),
            n.deployment_event(name),
            n.scale_event(name),
            *(n.shard_event(*k.split(".", 1)) for k in sorted(shard_keys)),
        ]
        history = await _history(bus, subjects)
        return views.describe_deployment(name, c, history)
    check_name("node", name)
    c = await read.cluster(bus, what=frozenset({"nodes", "shards"}))
    found = [v for v in views.node_views(c) if v.node == name]
    if not found:
        raise NotFound(f"no node {name}{_close(name, c.nodes)} (`llmgw ctl get nodes` lists them)")
    history = await _history(bus, [n.node_events(name), n.shard_event(name, ALL)])
    return views.describe_node(found[0], c, history)


async def _history(bus: Bus, subjects: list[str]) -> list[read.Stamped]:
    found: list[read.Stamped] = []
    await read.merged_events(bus, subjects, found.append, follow=False)
    return found


# --- events and logs -----------------------------------------------------------------------------


async def events(bus: Bus, *, deployment: str, node: str, follow: bool, output: str) -> None:
    n = bus.names
    if deployment:
        check_name("deployment", deployment)
    if node:
        check_name("node", node)
    if deployment and node:
        subjects = [n.shard_event(node, ALL)]
    elif deployment:
        subjects = [
            n.replica_event(deployment, ALL),
            n.placement_event(deployment),
            n.deployment_event(deployment),
            n.scale_event(deployment),
            n.shard_events_all,
        ]
    elif node:
        subjects = [n.node_events(node), n.shard_event(node, ALL)]
    else:
        subjects = [n.events_all]

    def emit(e: read.Stamped) -> None:
        if deployment and isinstance(e.event, ShardStatus) and e.event.deployment != deployment:
            return
        out(views.event_json(e) if output == "json" else views.event_line(e))

    await read.merged_events(bus, subjects, emit, follow=follow)


async def logs(bus: Bus, shard: str, *, tail: int, follow: bool, process: str) -> None:
    if tail < 0:
        raise UsageError(f"--tail {tail}: a line count is 0 (all that fit) or more")
    statuses = await read.values(bus, bus.names.shard_status_bucket, ShardStatus)
    found = [s for k, s in statuses.items() if shard_key(shard) == k or shard == s.shard]
    if not found:
        known = [views.shard_name(s.node, s.shard) for s in statuses.values()]
        raise NotFound(f"no shard {shard}{_close(shard, known)} (`llmgw ctl get shards` lists them)")
    status = found[0]
    reply = await read.shard_logs(
        bus, status.node, ShardLogsRequest(shard=status.shard, tail=tail, process=process)
    )
    for line in reply.lines:
        out(line)
    while follow:
        await anyio.sleep(0.5)
        reply = await read.shard_logs(
            bus, status.node, ShardLogsRequest(shard=status.shard, process=reply.process, offset=reply.offset)
        )
        for line in reply.lines:
            out(line)


# --- the command line ---------------------------------------------------------------------------


async def connect(args: argparse.Namespace) -> Bus:
    options = msgspec.structs.replace(bus_options(args), connect_timeout_s=CONNECT_TIMEOUT_S)
    try:
        return await Bus.connect(options, service="llmgw-ctl")
    except BusError as exc:
        if not options.authenticated() and not options.resolved_insecure():
            raise UsageError(str(exc)) from exc
        if not exc.retryable:
            raise Refused(str(exc)) from exc
        raise Unreachable(str(exc)) from exc


async def _dispatch(bus: Bus, args: argparse.Namespace) -> str | None:
    cmd = args.ctl
    if cmd == "nodes":
        return await nodes(bus)
    if cmd == "explain":
        check_name("deployment", args.deployment)
        return await explain(bus, args.deployment)
    if cmd in ("get", "describe", "delete") and KINDS.get(args.kind) == "adapter":
        from . import _adapters

        if args.name or cmd != "get":
            check_name("adapter", args.name)
        if cmd == "get":
            return await _adapters.get(bus, args.name or "", args.output or "")
        return await (_adapters.describe if cmd == "describe" else _adapters.delete)(bus, args.name)
    if cmd == "get":
        return await get(bus, KINDS[args.kind], args.name or "", args.output or "")
    if cmd == "describe":
        return await describe(bus, KINDS[args.kind], args.name)
    if cmd == "deploy":
        check_name("deployment", args.name)
        if args.replicas < 0:
            raise UsageError(f"--replicas {args.replicas}: a replica count is 0 or more")
        dep = Deployment(
            name=args.name,
            profile=args.profile,
            replicas=args.replicas,
            pool=args.pool,
            strategy=args.strategy,
            autoscale=autoscale_of(args),
        )
        return await request_replicas(bus, dep, "requested")
    if cmd == "scale":
        check_name("deployment", args.name)
        if args.replicas < 0:
            raise UsageError(f"--replicas {args.replicas}: a replica count is 0 or more")
        found = await stored_deployment(bus, args.name)
        if found.autoscale is not None:
            a = found.autoscale
            raise Refused(
                f"deployment {found.name} follows demand ({a.min_replicas} to {a.max_replicas} replicas): "
                f"its count is placement's to choose; change the bounds with `llmgw ctl deploy {found.name} "
                f"--profile {found.profile} --min-replicas N --max-replicas M`, or deploy it without them "
                "for a fixed count"
            )
        return await request_replicas(
            bus, msgspec.structs.replace(found, replicas=args.replicas), "requested"
        )
    if cmd == "apply":
        try:
            return await apply(
                bus, args.file, dry_run=args.dry_run, prune=args.prune, checked=getattr(args, "checked", None)
            )
        except ConfigError as exc:
            raise UsageError(str(exc)) from exc
    if cmd in ("cordon", "drain", "uncordon") or (cmd == "delete" and args.kind == "node"):
        from . import _nodes

        node = args.node if cmd != "delete" else args.name
        check_name("node", node)
        if cmd == "uncordon":
            return await _nodes.uncordon(bus, node)
        if cmd == "delete":
            return await _nodes.delete_node(bus, node)
        return await _nodes.cordon(bus, node, drain=cmd == "drain", reason=args.reason)
    if cmd == "delete":
        return await delete_deployment(bus, args.name)
    if cmd == "logs":
        await logs(bus, args.shard, tail=args.tail, follow=args.follow, process=args.process)
        return None
    if cmd == "events":
        await events(bus, deployment=args.deployment, node=args.node, follow=args.follow, output=args.output)
        return None
    if cmd in ("backup", "restore"):
        from . import _backup

        if cmd == "backup":
            return await _backup.backup(bus, args.file)
        return await _backup.restore(bus, args.file, force=args.force)
    if cmd in ("keys", "usage"):
        from . import _keys

        if cmd == "usage":
            return await _keys.usage(bus, by=args.by, since=args.since, output=args.output)
        if args.keys == "create":
            return await _keys.create(
                bus,
                args.name,
                models=args.models,
                rpm=args.rpm,
                tpm=args.tpm,
                expires=args.expires,
                output=args.output,
            )
        if args.keys == "list":
            return await _keys.listing(bus, args.output)
        if args.keys == "describe":
            return await _keys.describe(bus, args.name, args.output)
        return await _keys.revoke(bus, args.name)
    raise UsageError(f"unknown command {cmd}")


class _Refusals(logging.Handler):
    """nats-server's refusals of this identity, as the bus client reports them (`llmgw.access`).

    A refusal that fails the command is said in its error line: the client's own report of it
    too made every refusal of an observer two lines. So they are held, and said only where the
    error does not say one (a refused subscription fails nothing: it is all there is to tell);
    a command that follows, which may never end, says them once its first reads are done
    (`said_after`), and any later one at once."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.at_once = False
        self.held: list[str] = []

    async def said_after(self, delay_s: float) -> None:
        await anyio.sleep(delay_s)
        self.at_once = True
        self.say()

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if self.at_once:
            warn(text)
        else:
            self.held.append(text)

    def say(self) -> None:
        for text in self.held:
            warn(text)
        self.held.clear()


def _refused(exc: BaseException | None) -> bool:
    """Whether a fault is, or was caused by, a refusal of this identity (its line says it)."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, PermissionDenied):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def run(args: argparse.Namespace) -> int:
    # The bus client logs each failed connection attempt and reconnect; ctl says what failed
    # once, on one line, and scripts read stderr.
    logging.getLogger("llmgw.bus").setLevel(logging.ERROR)
    follows = getattr(args, "watch", False) or getattr(args, "follow", False)
    access = logging.getLogger("llmgw.access")
    refusals = _Refusals()
    access.addHandler(refusals)
    kept_propagate, access.propagate = access.propagate, False
    try:
        return _run(args, follows, refusals)
    finally:
        access.removeHandler(refusals)
        access.propagate = kept_propagate


def _run(args: argparse.Namespace, follows: bool, refusals: _Refusals) -> int:

    async def main() -> str | None:
        if args.ctl == "get" and args.watch and KINDS[args.kind] == "adapter":
            raise UsageError("`get adapters` has no --watch: watch their bases with `get profiles -w`")
        if args.ctl == "apply":
            # The file first: a broken one is said as such, with or without a cluster to reach.
            try:
                args.checked = read_apply_file(args.file)
            except ConfigError as exc:
                raise UsageError(str(exc)) from exc
        bus = await connect(args)
        try:
            if follows:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(refusals.said_after, FOLLOW_REFUSALS_AFTER_S)
                    if args.ctl == "get" and args.watch:
                        await watch(bus, KINDS[args.kind], args.name or "", args.output or "")
                        said = None
                    else:
                        said = await _dispatch(bus, args)
                    tg.cancel_scope.cancel()
                return said
            try:
                with anyio.fail_after(COMMAND_TIMEOUT_S):
                    return await _dispatch(bus, args)
            except TimeoutError as exc:
                raise Unreachable(
                    f"NATS at {bus.options.resolved_url()} did not answer within {COMMAND_TIMEOUT_S:g} s"
                ) from exc
        finally:
            with anyio.move_on_after(2, shield=True):
                await bus.close()

    try:
        text = anyio.run(main)
    except KeyboardInterrupt:
        return 130
    except BaseException as raised:
        # A fault inside a task group comes wrapped in an exception group: say the fault.
        exc: BaseException = raised
        while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
            exc = exc.exceptions[0]
        if isinstance(exc, StdoutClosed):
            return stdout_closed()
        if not _refused(exc):
            refusals.say()
        code = _exit_code(exc)
        if code is None:
            raise
        return code
    refusals.say()
    if text is not None:
        try:
            out(text)
        except StdoutClosed:
            return stdout_closed()
    return 0


def _exit_code(exc: BaseException) -> int | None:
    """The exit code for a fault, said in one line on stderr; None for a fault ctl does not know."""
    if isinstance(exc, CtlError):
        warn(str(exc))
        return exc.exit_code
    if isinstance(exc, PermissionDenied):
        warn(str(exc))
        return Refused.exit_code
    if isinstance(exc, StoreFull):
        # Not stored: the change was not made (what to do is in docs/operations.md).
        warn(f"{exc}; nothing was changed (docs/operations.md)")
        return CannotStore.exit_code
    if isinstance(exc, BusError):
        warn(str(exc))
        return Refused.exit_code if isinstance(exc.__cause__, PermissionDenied) else Unreachable.exit_code
    if isinstance(exc, nats.errors.Error | OSError):
        warn(f"NATS: {exc or type(exc).__name__}")
        return Unreachable.exit_code
    return None
