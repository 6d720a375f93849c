"""`llmgw ctl cordon|uncordon|drain NODE` and `delete node NODE`: a node's lifecycle.

A cordon or a drain is the operator's desired state, kept in the node-intent bucket (one
key per node, `NodeIntent`): placement reads it on every step, so it holds across
placement restarts and leader changes. Uncordon deletes the key. `delete node` asks the
placement leader (a `forget` intent) to forget a node it judges lost: its status and shard
statuses (which the node wrote while it lived) and its intent."""

from __future__ import annotations

import getpass
import sys
import time
from collections.abc import Awaitable, Callable

import anyio

from llmgw_core.bus import Bus
from llmgw_core.events import DeploymentStatus, NodeIntent, NodeStatus

from . import _read as read
from . import _views as views
from ._errors import NotFound, Refused, Unreachable

# How long `delete node` waits for the leader to forget the node.
FORGET_WAIT_S = 20.0
# How long `drain` waits for placement to say how the drain of each deployment goes.
DRAIN_STATUS_WAIT_S = 5.0


def operator() -> str:
    """Who asks, as the refusals quote it: the local user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "an operator"


def warn(text: str) -> None:
    print(f"llmgw: {text}", file=sys.stderr, flush=True)


async def _known(bus: Bus, node: str) -> None:
    if await bus.get(bus.names.nodes_bucket, node, NodeStatus) is None:
        raise NotFound(f"no node {node} (`llmgw ctl get nodes` lists them)")


async def cordon(bus: Bus, node: str, *, drain: bool, reason: str) -> str:
    """Keep new replicas off `node`; with `drain`, also have its replicas placed elsewhere, or
    say (on stderr, exit 0: the drain is written) that placement found nowhere to put them."""
    await _known(bus, node)
    intent = NodeIntent(node=node, drain=drain, by=operator(), at=time.time(), reason=reason)
    if not drain:
        await bus.put(bus.names.node_intent_bucket, node, intent)
        return f"node {node} {intent.words()}: no new replica goes there; its replicas keep running"
    c = await read.cluster(bus, what=frozenset({"replicas"}))
    on_node = sorted({r.deployment for r in c.replicas.values() if any(m.node == node for m in r.members)})
    said = await _statuses_after(bus, on_node, lambda: bus.put(bus.names.node_intent_bucket, node, intent))
    left = views.replicas_on(c, node)
    if not left:
        return f"node {node} drained: it runs no replica; no new replica goes there"
    plural, verb = ("", "is") if left == 1 else ("s", "are")
    blocked = [s for s in said if s.blocked]
    if blocked:
        # The promise that the replicas move was false when no node could take them: the
        # drain waits, stopping nothing, and placement's own words say why.
        warn(
            f"warning: the drain of {node} is blocked: "
            + "; ".join(s.summary for s in blocked)
            + f"; its replica{plural} serve{'s' if left == 1 else ''} on there until a node can take "
            f"{'it' if left == 1 else 'them'} (`llmgw ctl explain {blocked[0].deployment}`)"
        )
        return (
            f"node {node} {intent.words()}: no new replica goes there; its {left} replica{plural} "
            f"{verb} not moved: no other node can take {'it' if left == 1 else 'them'} now"
        )
    return (
        f"node {node} {intent.words()}: its {left} replica{plural} {verb} placed elsewhere, each old one "
        f"stopped once its replacement is ready (`llmgw ctl get nodes` shows how many are left)"
    )


async def _statuses_after(
    bus: Bus, deployments: list[str], write: Callable[[], Awaitable[object]]
) -> list[DeploymentStatus]:
    """`write` done, then the first status placement publishes of each of `deployments` after
    it that tells of a drain (a replacement on its way, or the drain blocked), waited for up
    to DRAIN_STATUS_WAIT_S (a deployment whose status does not change is not waited for past
    it). A status that tells neither is another step's (a new leader's first word)."""
    first: dict[str, DeploymentStatus] = {}
    done = anyio.Event()

    async def on_status(status: DeploymentStatus, _subject: str) -> None:
        if status.deployment in deployments and (status.blocked or status.pending):
            first.setdefault(status.deployment, status)
            if len(first) == len(deployments):
                done.set()

    async with anyio.create_task_group() as tg:
        for name in deployments:
            await tg.start(bus.subscribe_core, bus.names.deployment_event(name), DeploymentStatus, on_status)
        await write()
        if deployments:
            with anyio.move_on_after(DRAIN_STATUS_WAIT_S):
                await done.wait()
        tg.cancel_scope.cancel()
    return [first[d] for d in deployments if d in first]


async def uncordon(bus: Bus, node: str) -> str:
    await _known(bus, node)
    found = await bus.get(bus.names.node_intent_bucket, node, NodeIntent)
    if found is None:
        return f"node {node} was not cordoned: new replicas may go there"
    await bus.delete(bus.names.node_intent_bucket, node)
    return f"node {node} uncordoned (was {found[0].words()}): new replicas may go there"


async def delete_node(bus: Bus, node: str) -> str:
    """Forget a node placement judges lost; refuse one it hears (exit 4)."""
    await _known(bus, node)
    judged = await read.liveness(bus)
    if judged is None:
        raise Unreachable(
            f"node {node}: no placement answered, so nothing says it is lost; nothing was deleted"
        )
    live = next((n for n in judged.nodes if n.node == node), None)
    if live is not None and live.alive:
        raise Refused(
            f"node {node} is alive (placement heard it {views.ago(max(live.silent_s, 0.0))} ago): only a "
            f"lost node is deleted; `llmgw ctl drain {node}` moves its replicas off it first"
        )
    c = await read.cluster(bus, what=frozenset({"replicas"}))
    left = views.replicas_on(c, node)
    if left:
        raise Refused(
            f"node {node} is lost but placement still holds {left} replica(s) on it: they are failed "
            "over within a step; run it again then"
        )
    # ctl may not write node statuses: the leader forgets the node, and is waited for.
    names = bus.names
    before = await bus.get(names.node_intent_bucket, node, NodeIntent)
    asked = NodeIntent(node=node, by=operator(), at=time.time(), forget=True)
    await bus.put(names.node_intent_bucket, node, asked)
    deadline = time.monotonic() + FORGET_WAIT_S
    while time.monotonic() < deadline:
        if await bus.get(names.nodes_bucket, node, NodeStatus) is None:
            return f"node {node} deleted: `llmgw ctl get nodes` no longer lists it"
        await anyio.sleep(0.2)
    if before is not None:
        await bus.put(names.node_intent_bucket, node, before[0])
    else:
        await bus.delete(names.node_intent_bucket, node)
    raise Unreachable(
        f"node {node}: the placement leader did not forget it within {FORGET_WAIT_S:g} s "
        "(`llmgw ctl nodes` says whether it still judges it lost); nothing was deleted"
    )
