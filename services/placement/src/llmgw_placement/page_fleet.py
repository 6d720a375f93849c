"""The cluster page's fleet: nodes as the page counts them (`counted`), the summary line, and
the nodes' section (counts by GPU class and pool, a grid of every node, and in full only the
nodes to look at or those a filter asked for).
"""

from __future__ import annotations

import collections
import fnmatch
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlencode

from starlette.requests import Request

from .gpuclass import gpu_class
from .page_parts import Frag, Keyed, Part, esc, when

if TYPE_CHECKING:
    from .service import PlacementService

# A fleet this small lists every node in full; a larger one, only the nodes to look at.
SMALL_FLEET = 24
# The most nodes listed in full (the rest are in the grid, and a filter away).
LISTED_MAX = 50


class Query(NamedTuple):
    """What a tab asked for in its address: nodes to list (`node=` a part of their name or a
    pattern, `state=` one of STATES) and a deployment to open (`deployment=`)."""

    node: str = ""
    state: str = ""
    deployment: str = ""

    @classmethod
    def of(cls, request: Request) -> Query:
        q = request.query_params
        return cls(
            node=q.get("node", "").strip()[:200],
            state=q.get("state", "") if q.get("state", "") in STATES else "",
            deployment=q.get("deployment", "").strip()[:200],
        )

    def href(self, **changed: str) -> str:
        """This query with `changed`, as a link's `href`."""
        values = {**self._asdict(), **changed}
        return "?" + urlencode({k: v for k, v in values.items() if v})


# The page as `/` shows it: no filter, no deployment opened.
EVERYTHING = Query()

# A node's state on the page, worst first: the grid's colours and the filter's choices.
STATES = ("claimed", "lost", "cordoned", "held", "free")
STATE_WORDS = {
    "claimed": "nodes two machines claim",
    "lost": "nodes not heard within node_timeout_s",
    "cordoned": "alive nodes cordoned or drained: no new replica",
    "held": "alive nodes where a replica holds a GPU",
    "free": "alive nodes where no replica holds a GPU",
}


class Counted(NamedTuple):
    state: str
    held: int
    free: int
    unusable: int


def counted(row: Any, holders: dict[tuple[str, int], str]) -> Counted:
    """A node's state and its GPUs held, free and unusable. A node not heard, or claimed by
    two machines, has no GPU held or free: every one is unusable (a lost node's GPUs shown free
    is a lie that sends an operator to a dead machine). A cordoned node's unheld GPUs take
    nothing new: unusable too; what its replicas hold stays held."""
    usable = row.alive and not row.claimed
    held = sum((row.node, g.index) in holders for g in row.gpus) if usable else 0
    if row.claimed:
        state = "claimed"
    elif not row.alive:
        state = "lost"
    elif row.intent:
        state = "cordoned"
    else:
        state = "held" if held else "free"
    free = len(row.gpus) - held if state in ("held", "free") else 0
    return Counted(state, held, free, len(row.gpus) - held - free)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", text)


def _needs_look(row: Any) -> bool:
    return bool(
        row.claimed or not row.alive or row.intent or row.warnings or row.problems or row.missing_models
    )


def _matches(row: Any, c: Counted, q: Query) -> bool:
    if q.state and c.state != q.state:
        return False
    if not q.node:
        return True
    pattern = q.node.lower()
    name = row.node.lower()
    return fnmatch.fnmatchcase(name, pattern) if any(ch in pattern for ch in "*?[") else pattern in name


class Fleet:
    """Renders the summary line and the nodes' section from placement's state."""

    def __init__(self, service: PlacementService) -> None:
        self.service = service
        # Each node's pools (`pool_of`), as server.yaml's patterns name them.
        self._pools: dict[str, str] = {}

    def summary(self, nodes: list[Any], counts: dict[str, Counted], statuses: dict[str, Any]) -> str:
        """One line first: nodes alive, lost and cordoned; GPUs held, free and unusable (see
        `counted`); deployments ready, degraded and unplaceable.

        The nodes are counted by their state as `counted` gives it, the one the legend, the
        groups' table and the grid count: a lost node that was cordoned is lost, not also
        cordoned (the summary said 3 cordoned while the table said 0)."""
        alive = lost = cordoned = held = free = unusable = 0
        for row in nodes:
            c = counts[row.node]
            alive += c.state in ("held", "free", "cordoned")
            lost += c.state == "lost"
            cordoned += c.state == "cordoned"
            held += c.held
            free += c.free
            unusable += c.unusable
        ready = degraded = unplaceable = 0
        for name, dep in self.service.state.deployments.items():
            status = statuses.get(name)
            if status is None:
                continue
            if status.unplaceable:
                unplaceable += 1
            elif status.ready >= dep.replicas:
                ready += 1
            else:
                degraded += 1

        def n(count: int, what: str, cls: str = "") -> str:
            mark = f" class={cls}" if cls and count else ""
            return f"<b data-count='{what}'{mark}>{count}</b> {what}"

        return (
            "<p id=summary>"
            f"nodes {n(alive, 'alive')}, {n(lost, 'lost', 'bad')}, {n(cordoned, 'cordoned', 'warn')} · "
            f"GPUs {n(held, 'held')}, {n(free, 'free')}, {n(unusable, 'unusable', 'bad')} · "
            f"deployments {n(ready, 'ready')}, {n(degraded, 'degraded', 'bad')}, "
            f"{n(unplaceable, 'unplaceable', 'bad')}</p>"
        )

    def pool_of(self, node: str) -> str:
        pools = self._pools.get(node)
        if pools is None:
            config = self.service.config.pools
            pools = self._pools[node] = ", ".join(
                p for p, pats in sorted(config.items()) if any(fnmatch.fnmatchcase(node, x) for x in pats)
            )
        return pools

    def parts(
        self, holders: dict[tuple[str, int], str], nodes: list[Any], counts: dict[str, Counted], query: Query
    ) -> list[Part]:
        """Nodes compact: counts by GPU class and pool, one small square per node in a grid per
        group (its colour its state, its title its GPUs), and in full only the nodes to look at
        (lost, claimed, cordoned, warned: every node in a small fleet) or those a filter asked."""
        small = len(nodes) <= SMALL_FLEET
        filtered = bool(query.node or query.state)
        groups: dict[tuple[str, str], list[Any]] = {}
        for row in nodes:
            cls = gpu_class(row.gpus[0]) if row.gpus else "no GPU"
            groups.setdefault((cls, self.pool_of(row.node)), []).append(row)
        listed = [
            row
            for row in nodes
            if (_matches(row, counts[row.node], query) if filtered else small or _needs_look(row))
        ]
        more = len(listed) - LISTED_MAX
        shown = listed[:LISTED_MAX]
        shards = self.service.view.shard_states_of({row.node for row in shown}, time.monotonic())
        rows = [
            Frag(f"n-{row.node}", self._node_row(row, holders, shards.get(row.node, ()))) for row in shown
        ]
        if more > 0:
            rows.append(
                Frag("n-more", f"<tr id=n-more><td colspan=5>and {more} more: narrow the filter</td></tr>")
            )
        if not rows:
            said = "no node matches" if filtered else "every node alive, none cordoned, none warned"
            rows.append(Frag("n-none", f"<tr id=n-none><td colspan=5>{said}</td></tr>"))
        if filtered:
            title = (
                f"Nodes matching {esc(' '.join(x for x in (query.node, query.state) if x))} ({len(listed)})"
            )
        else:
            title = "Every node" if small else f"Nodes to look at ({len(listed)})"
        by_state = collections.Counter(c.state for c in counts.values())
        # Nodes, as the summary's first part and the groups' table count them (the summary's
        # `free` and `held` that follow are GPUs, and say so); each a filter.
        legend = "nodes: " + " · ".join(
            f"<a href='{esc(query.href(state=s))}#nodes' data-legend={s} title='{esc(STATE_WORDS[s])}'>"
            f"<i class='c {s}'></i> <b>{by_state.get(s, 0)}</b> {s}</a>"
            for s in STATES
        )
        group_rows = []
        grids: list[Part] = []
        for (cls, pools), members in sorted(groups.items()):
            slug = _slug(f"{cls}.{pools}")
            c = [counts[r.node] for r in members]
            states = collections.Counter(x.state for x in c)
            group_rows.append(
                Frag(
                    f"grp-{slug}",
                    f"<tr id='grp-{slug}' data-group='{esc(cls)}|{esc(pools)}'><td>{esc(cls)}</td>"
                    f"<td>{esc(pools) or '—'}</td><td class=nodes>{len(members)}</td>"
                    f"<td class=alive>{states['held'] + states['free'] + states['cordoned']}</td>"
                    f"<td class=lost>{states['lost']}</td>"
                    f"<td class=cordoned>{states['cordoned']}</td><td>{sum(x.held for x in c)}</td>"
                    f"<td>{sum(x.free for x in c)}</td><td>{sum(x.unusable for x in c)}</td></tr>",
                )
            )
            grids += [
                f"<h3>{esc(cls)}" + (f" · pool {esc(pools)}" if pools else "") + "</h3>",
                Keyed(
                    f"grid-{slug}",
                    f"<div class=grid id='grid-{slug}'>",
                    [self._cell(row, counts[row.node], query) for row in members],
                    "</div>",
                ),
            ]
        return [
            "<section id=nodes>",
            Frag("nodes-h", f"<h2 id=nodes-h>Nodes ({len(nodes)})</h2>"),
            Frag("legend", f"<p id=legend>{legend}</p>"),
            Keyed(
                "groups",
                "<div class=wide><table class=groups><thead><tr><th>GPU class</th><th>pool</th><th>nodes</th>"
                "<th>alive</th><th>lost</th><th>cordoned</th><th>GPUs held</th><th>free</th><th>unusable</th>"
                "</tr></thead><tbody id=groups>",
                group_rows,
                "</tbody></table></div>",
            ),
            find(query),
            Frag("listed-h", f"<h3 id=listed-h>{title}</h3>"),
            Keyed(
                "listed",
                "<div class=wide><table><thead><tr><th>node</th><th>state</th><th class=sys>system</th>"
                "<th>GPUs</th><th>engines</th></tr></thead><tbody id=listed>",
                rows,
                "</tbody></table></div>",
            ),
            *grids,
            "</section>",
        ]

    @staticmethod
    def _cell(row: Any, c: Counted, query: Query) -> Frag:
        title = f"{row.node}: {c.state}, {c.held} of {len(row.gpus)} GPUs held"
        link = query.href(node=row.node, state="")
        return Frag(
            f"c-{row.node}",
            f"<a id='c-{esc(row.node)}' class='c {c.state}' href='{esc(link)}#nodes' "
            f"title='{esc(title)}'></a>",
        )

    def _node_row(
        self, row: Any, holders: dict[tuple[str, int], str], shards: Sequence[tuple[str, str]] = ()
    ) -> str:
        status = self.service.state.nodes.get(row.node)
        facts = status.facts if status else None
        if row.claimed:
            state = "<span class=bad>claimed twice</span>"
        elif row.alive:
            state = "<span class=ok>alive</span>"
        elif row.seen_s_ago < 0:
            state = "<span class=bad>lost</span> (not heard since placement started)"
        else:
            heard = self.service.state.last_seen_wall.get(row.node) or time.time() - row.seen_s_ago
            state = f"<span class=bad>lost, last heard {when(heard)}</span>"
        if row.intent:
            state += f" <span class=warn>{esc(row.intent)}</span>"
        system = f"{facts.os_id} {facts.os_version} {facts.arch}".strip() if facts else ""
        # A node not heard (or claimed twice) has no free GPU: they are unusable.
        unheld = "free" if row.alive and not row.claimed else "unusable"
        gpus = "".join(
            f"<span class='gpu {'held' if (row.node, g.index) in holders else unheld}' "
            f"title='{esc(g.name)} cc {esc(g.compute_capability)}'>"
            f"{g.index}<small>{esc(holders.get((row.node, g.index), unheld))}</small></span>"
            for g in row.gpus
        )
        engines = "<br>".join(
            f"{esc(e.name)} <b>{esc(e.state)}</b> {esc(e.version)}"
            + (f" <small>{esc(e.engine_version)}</small>" if e.engine_version not in ("", e.version) else "")
            + (f" — {esc(e.detail)}" if e.detail else "")
            for e in row.engines
        )
        if row.install:
            last = "" if row.alive else " (last known)"
            engines += f"<div class=install>{esc(row.install)}{last}</div>"
        said = (
            ((row.claimed,) if row.claimed else ())
            + tuple(row.problems)
            + row.warnings
            + tuple(f"model file not found: {p}" for p in row.missing_models)
        )
        warnings = "".join(f"<div class=warn>{esc(w)}</div>" for w in said)
        # Its shards as they read now: a lost node's read `unknown (node lost 13 s ago)`. Named
        # apart from the node's `state`: the loop once wrote its last shard's `ready` over it, and
        # a node draining with nowhere to go read `ready` in its row.
        for k, shard_state in shards:
            cls = "ok" if shard_state == "ready" else "bad"
            engines += (
                f"<div class=shard data-shard='{esc(k)}'>{esc(k.split('.', 1)[-1])}: "
                f"<span class={cls}>{esc(shard_state)}</span></div>"
            )
        return (
            f"<tr id='n-{esc(row.node)}' data-node='{esc(row.node)}'><td>{esc(row.node)}</td>"
            f"<td>{state}{warnings}</td>"
            f"<td class=sys>{esc(system)}</td><td class=gpus>{gpus or '—'}</td>"
            f"<td>{engines or '—'}</td></tr>"
        )


def find(query: Query) -> str:
    """The nodes' filter: a form, so that it works without JavaScript (with it, the grid
    also dims the nodes that do not match as one types)."""
    options = "".join(
        f"<option value='{s}'{' selected' if s == query.state else ''}>{s}</option>" for s in ("", *STATES)
    )
    keep = f"<input type=hidden name=deployment value='{esc(query.deployment)}'>" if query.deployment else ""
    return (
        "<form id=find data-keep method=get action='#nodes'>"
        f"<input name=node value='{esc(query.node)}' placeholder='node name, part of it, or sim-00*' "
        "aria-label='nodes to list'> "
        f"<select name=state aria-label='state'>{options}</select> {keep}<button>list</button>"
        + (
            f" <a href='{esc(query.href(node='', state=''))}#nodes'>clear</a>"
            if query.node or query.state
            else ""
        )
        + "</form>"
    )
