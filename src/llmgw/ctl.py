"""`llmgw ctl`: read the cluster through the bus and print tables."""

from __future__ import annotations

import argparse
import sys

import anyio
import msgspec
import nats.errors
import nats.js.errors
from opentelemetry import trace

from llmgw_core.bus import Bus
from llmgw_core.errors import ConfigError, LlmgwError
from llmgw_core.events import Deployment, Liveness, NodeLiveness, NodeStatus, PlacementDecision, decoder
from llmgw_core.telemetry import current_traceparent

tracer = trace.get_tracer("llmgw.ctl")

LIVENESS_TIMEOUT_S = 1.5


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


async def liveness(bus: Bus) -> Liveness | None:
    """Placement's own judgement of every node (the one that fails nodes over), or None
    when no placement answers."""
    try:
        reply = await bus.nc.request(bus.names.liveness_request, b"", timeout=LIVENESS_TIMEOUT_S)
    except (nats.errors.Error, OSError):
        return None
    return decoder(Liveness).decode(reply.data)


def node_state(live: NodeLiveness | None, judged: bool) -> str:
    if not judged:
        return "unknown (no placement answered)"
    if live is None:
        return "unknown (not heard since placement started)"
    if live.alive:
        return "alive"
    if live.silent_s < 0:
        return "lost (not heard since placement started)"
    return f"lost {_ago(live.silent_s)} ago"


def _ago(seconds: float) -> str:
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h"


async def nodes(bus: Bus) -> str:
    statuses = await bus.entries(bus.names.nodes_bucket, NodeStatus)
    judged = await liveness(bus)
    live = {n.node: n for n in judged.nodes} if judged else {}
    rows = []
    for key in sorted(statuses):
        status = statuses[key].value
        assert status is not None
        gpus = status.facts.gpus
        gpu_text = f"{len(gpus)}x {gpus[0].name}" if gpus else "-"
        engines = ", ".join(
            f"{e.name} {e.version or ''} ({e.state})".replace("  ", " ") for e in status.engines
        )
        node_live = live.get(status.node)
        install = status.install or "-"
        if node_live is not None and not node_live.alive and status.install:
            # What a lost node said last is not news: say so.
            install = f"{status.install} (last known)"
        rows.append(
            [
                status.node,
                node_state(node_live, judged is not None),
                gpu_text,
                engines or "none",
                install,
                "; ".join(status.warnings) or "-",
            ]
        )
    return table(["NODE", "STATE", "GPUS", "ENGINES", "INSTALL", "WARNINGS"], rows)


async def explain(bus: Bus, deployment: str) -> str:
    subject = bus.names.placement_event(deployment)
    try:
        msg = await bus.js.get_msg(bus.names.events_stream, subject=subject, direct=False)
    except nats.js.errors.NotFoundError:
        return f"no placement decision for {deployment} yet"
    except nats.errors.Error as exc:
        return f"cannot read placement decisions: {exc}"
    decision = decoder(PlacementDecision).decode(msg.data or b"")
    if decision.outcome == "placed":
        return f"{deployment} replica {decision.replica}: placed on {', '.join(decision.nodes)}"
    rows = [[r.node, r.reason] for r in decision.reasons]
    return f"{deployment} replica {decision.replica}: refused\n" + table(["NODE", "REASON"], rows)


async def deploy(bus: Bus, deployment: Deployment) -> Deployment:
    """Write a deployment; the trace started here follows it through placement and the launchers."""
    with tracer.start_as_current_span(f"ctl deploy {deployment.name}"):
        deployment = msgspec.structs.replace(deployment, traceparent=current_traceparent())
        await bus.put(bus.names.deployments_bucket, deployment.name, deployment)
    return deployment


async def apply(bus: Bus, path: str) -> str:
    """Write what server.yaml says: its engines, every profile and every deployment it names.

    Keys the file does not name are left as they are (delete a deployment with
    `llmgw ctl delete deployment NAME`).
    """
    from llmgw_core.config import load
    from llmgw_core.events import DesiredEngines
    from llmgw_placement.checks import check_deployment
    from llmgw_placement.config import ServerConfig

    config = load(path, ServerConfig)
    names = bus.names
    for dep in config.deployments:
        problem = check_deployment(dep.name, dep.wire(), max_replicas=config.max_replicas)
        if problem:
            raise ConfigError(f"{path}: {problem}")
    await bus.put(names.config_bucket, "engines", DesiredEngines(engines=config.engines))
    for profile in config.catalog:
        await bus.put(names.catalog_bucket, profile.name, profile.wire())
    for dep in config.deployments:
        await deploy(bus, dep.wire())
    return (
        f"applied {path}: {len(config.engines)} engines, {len(config.catalog)} profiles, "
        f"{len(config.deployments)} deployments"
    )


async def delete_deployment(bus: Bus, name: str) -> str:
    if await bus.get(bus.names.deployments_bucket, name, Deployment) is None:
        raise NotFound(f"no deployment {name}")
    await bus.delete(bus.names.deployments_bucket, name)
    return f"deployment {name} deleted: its replicas stop"


class NotFound(LlmgwError):
    """What was named does not exist (exit code 3)."""


def run(args: argparse.Namespace) -> int:
    async def main() -> str:
        from .cli import bus_options

        async with await Bus.connect(bus_options(args), service="llmgw-ctl") as bus:
            if args.ctl == "nodes":
                return await nodes(bus)
            if args.ctl == "deploy":
                dep = msgspec.convert(
                    {
                        "name": args.name,
                        "profile": args.profile,
                        "replicas": args.replicas,
                        "pool": args.pool,
                        "strategy": args.strategy,
                    },
                    Deployment,
                )
                await deploy(bus, dep)
                return f"deployment {dep.name}: {dep.replicas} x {dep.profile} requested"
            if args.ctl == "apply":
                return await apply(bus, args.file)
            if args.ctl == "delete":
                return await delete_deployment(bus, args.name)
            return await explain(bus, args.deployment)

    try:
        print(anyio.run(main))
    except NotFound as exc:
        print(f"llmgw: {exc}", file=sys.stderr)
        return 3
    return 0
