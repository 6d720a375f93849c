"""`llmgw ctl`: read the cluster through the bus and print tables."""

from __future__ import annotations

import argparse
import time

import anyio
import msgspec
import nats.errors
import nats.js.errors
from opentelemetry import trace

from llmgw_core.bus import Bus
from llmgw_core.events import Deployment, Heartbeat, NodeStatus, PlacementDecision, decoder
from llmgw_core.telemetry import current_traceparent

tracer = trace.get_tracer("llmgw.ctl")

LISTEN_S = 2.5  # long enough to hear every live node's heartbeat at the default 1 s interval


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


async def nodes(bus: Bus) -> str:
    heard: dict[str, float] = {}

    async def on_beat(beat: Heartbeat, subject: str) -> None:
        # The subject names the node (its identity may publish only there), not the payload.
        heard[subject.split(".")[-2]] = time.time()

    async with anyio.create_task_group() as tg:
        await tg.start(
            lambda task_status: bus.subscribe_core(
                bus.names.heartbeat_all, Heartbeat, on_beat, task_status=task_status
            )
        )
        statuses = await bus.entries(bus.names.nodes_bucket, NodeStatus)
        await anyio.sleep(LISTEN_S)
        tg.cancel_scope.cancel()
    rows = []
    for key in sorted(statuses):
        status = statuses[key].value
        assert status is not None
        gpus = status.facts.gpus
        gpu_text = f"{len(gpus)}x {gpus[0].name}" if gpus else "-"
        engines = ", ".join(
            f"{e.name} {e.version or ''} ({e.state})".replace("  ", " ") for e in status.engines
        )
        rows.append(
            [
                status.node,
                "alive" if status.node in heard else f"silent {LISTEN_S:g}s",
                gpu_text,
                engines or "none",
                status.install or "-",
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
            return await explain(bus, args.deployment)

    print(anyio.run(main))
    return 0
