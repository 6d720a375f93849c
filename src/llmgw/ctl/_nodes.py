"""`llmgw ctl cordon|uncordon|drain NODE` and `delete node NODE`: a node's lifecycle.

A cordon or a drain is the operator's desired state, kept in the node-intent bucket (one
key per node, `NodeIntent`): placement reads it on every step, so it holds across
placement restarts and leader changes. Uncordon deletes the key. `delete node` asks the
placement leader (a `forget` intent) to forget a node it judges lost: its status and shard
statuses (which the node wrote while it lived) and its intent."""

from __future__ import annotations

import getpass
import time

import anyio

from llmgw_core.bus import Bus
from llmgw_core.events import NodeIntent, NodeStatus

from . import _read as read
from . import _views as views
from ._errors import NotFound, Refused, Unreachable

# How long `delete node` waits for the leader to forget the node.
FORGET_WAIT_S = 20.0


def operator() -> str:
    """Who asks, as the refusals quote it: the local user."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "an operator"


async def _known(bus: Bus, node: str) -> None:
    if await bus.get(bus.names.nodes_bucket, node, NodeStatus) is None:
        raise NotFound(f"no node {node} (`llmgw ctl get nodes` lists them)")


async def cordon(bus: Bus, node: str, *, drain: bool, reason: str) -> str:
    """Keep new replicas off `node`; with `drain`, also have its replicas placed elsewhere."""
    await _known(bus, node)
    intent = NodeIntent(node=node, drain=drain, by=operator(), at=time.time(), reason=reason)
    await bus.put(bus.names.node_intent_bucket, node, intent)
    if not drain:
        return f"node {node} {intent.words()}: no new replica goes there; its replicas keep running"
    c = await read.cluster(bus, what=frozenset({"replicas"}))
    left = views.replicas_on(c, node)
    if not left:
        return f"node {node} drained: it runs no replica; no new replica goes there"
    plural, verb = ("", "is") if left == 1 else ("s", "are")
    return (
        f"node {node} {intent.words()}: its {left} replica{plural} {verb} placed elsewhere, each old one "
        f"stopped once its replacement is ready (`llmgw ctl get nodes` shows how many are left)"
    )


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
