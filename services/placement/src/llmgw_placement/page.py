"""The cluster page at `/`: a summary, the problems, nodes, deployments, replicas, the catalog,
the last day's usage and recent events, live.

Server-rendered HTML, in parts (`Frag`: an element with an id; `Keyed`: a container of such
elements in order). The page opens `/page/stream` (server-sent events): a first snapshot,
then only the parts that changed (`changes`), so an idle fleet of a thousand nodes costs an
open tab a few hundred bytes a second, not the page on every tick. Without JavaScript the
page says it is not live and reloads itself. Every text comes from the same records as
`/api/*` and `llmgw ctl`: the page computes nothing of its own.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import html
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlencode

import anyio
import msgspec
from nats.aio.msg import Msg
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from llmgw_core import failures
from llmgw_core.events import EngineLoad, ReplicaRecord, ShardStatus

from .chart import demand_chart
from .gpuclass import gpu_class
from .view import REASON_GROUPS, reason_groups, reasons_text

if TYPE_CHECKING:
    from .service import PlacementService
    from .usage import UsageWindow

log = logging.getLogger("llmgw.placement.page")

# How often the stream looks for a change, and how often it says it is still there.
REFRESH_S = 0.5
KEEPALIVE_S = 15.0
EVENTS_KEPT = 40
# A fleet this small lists every node in full; a larger one, only the nodes to look at.
SMALL_FLEET = 24
# The most nodes listed in full (the rest are in the grid, and a filter away).
LISTED_MAX = 50
# Renders younger than this are shared by the streams of every open tab.
SHARED_S = 0.4
# The streams look again only after this many times what the last render took: rendering
# runs on the loop that hears the nodes' heartbeats, and a large fleet's page must not take
# more than a small share of it (a late loop makes placement grant every node a full timeout).
RENDER_SHARE = 20
# How long a page without JavaScript waits before it reloads itself.
NOSCRIPT_RELOAD_S = 30
# The most characters of one event's line: a reason quotes what a node or an engine said.
EVENT_CHARS = 600


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _when(at: float) -> str:
    """A moment as the page shows it: its UTC time, which a script turns into `5 s ago` and
    keeps current in the browser. A text that the server rewrote every second would change
    every replica's row on every tick, and the stream would send them all again."""
    at = int(at)
    return (
        f"<time data-at={at} title='{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(at))}'>"
        f"{time.strftime('%H:%M:%S', time.gmtime(at))} UTC</time>"
    )


def event_line(subject: str, data: bytes, steps: dict[tuple[str, str], str] | None = None) -> str | None:
    """One line for an event, in the words its writer gave; None for the ones the page skips.

    `steps`: each install's step so far, by (node, engine). Given it, progress within a step
    (`downloading … (38%, …)`, every second or so) is skipped: it updates the node's row, and
    the event list keeps what matters, a new step and how the install ended."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    line = _event_words(body, steps)
    if line is None or len(line) <= EVENT_CHARS:
        return line
    return line[:EVENT_CHARS] + "…"


def _said(state: object, reason: object) -> str:
    """`: why` after a state, without the state said twice: placement's reason for a replica it
    drains reads `draining: scaled down`, and `draining: draining: scaled down` was shown."""
    if not reason:
        return ""
    why = failures.one_line(str(reason)).removeprefix(f"{state}: ")
    return f": {why}" if why else ""


def _event_words(body: dict[str, Any], steps: dict[tuple[str, str], str] | None) -> str | None:
    kind = body.get("kind")
    if kind == "ReplicaStatus":
        state = body.get("state")
        said = _said(state, body.get("reason"))
        return f"replica {body.get('deployment')}/{body.get('replica')} {state}{said}"
    if kind == "ShardStatus":
        state = body.get("state")
        return f"shard {body.get('node')}/{body.get('shard')} {state}{_said(state, body.get('reason'))}"
    if kind == "PlacementDecision":
        if body.get("outcome") == "placed":
            nodes = body.get("nodes")
            on = ", ".join(str(n) for n in nodes) if isinstance(nodes, list) else ""
            return f"placed {body.get('deployment')}/{body.get('replica')} on {on}"
        given = body.get("reasons")
        pairs = [
            (str(r.get("node")), str(r.get("reason")))
            for r in (given if isinstance(given, list) else ())
            if isinstance(r, dict)
        ]
        return f"cannot place {body.get('deployment')}: {reasons_text(pairs)}"
    if kind == "DeploymentStatus":
        return str(body.get("summary", ""))
    if kind == "ScaleDecision":
        return f"{body.get('deployment')}: {body.get('reason')}"
    if kind == "InstallProgress":
        if steps is not None:
            install = (str(body.get("node")), str(body.get("engine")))
            if body.get("outcome", "running") != "running":
                steps.pop(install, None)
            elif steps.get(install) == body.get("step"):
                return None
            else:
                steps[install] = str(body.get("step"))
        return f"{body.get('node')}: {body.get('message')}"
    if kind == "NodeLifecycle":
        return f"node {body.get('node')} {body.get('state')}"
    return None


# --- parts, and what changed between two renders --------------------------------------


class Frag(NamedTuple):
    """An element with an id (`html` is the whole element): sent again whole when it changes."""

    id: str
    html: str


class Keyed(NamedTuple):
    """A container (its markup from `open` to `close`, `open` carrying `id`) of elements with
    ids, in order: a change sends the new order and the elements that are new or changed."""

    id: str
    open: str
    items: list[Frag]
    close: str


Part = str | Frag | Keyed


def document_of(parts: list[Part]) -> str:
    out: list[str] = []
    for p in parts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Frag):
            out.append(p.html)
        else:
            out += (p.open, *(i.html for i in p.items), p.close)
    return "".join(out)


@dataclass
class Sent:
    """What one stream has sent: the parts' shape (static markup and ids, in order), each
    element's markup and each container's order."""

    shape: tuple[str, ...] = ()
    frags: dict[str, str] = field(default_factory=dict)
    orders: dict[str, tuple[str, ...]] = field(default_factory=dict)


def _shape(parts: list[Part]) -> tuple[str, ...]:
    return tuple(p if isinstance(p, str) else f"#{p.id}" for p in parts)


def changes(before: Sent | None, parts: list[Part]) -> tuple[Sent, bytes | None]:
    """The next server-sent event for a stream that has sent `before` (None: nothing yet), and
    what it will then have sent. A first render, or one whose shape changed (a section or a
    group of nodes came or went), is the whole view (`event: view`); otherwise a patch of the
    elements that changed and the containers whose order changed (`event: patch`), or None
    when nothing did."""
    sent = Sent(shape=_shape(parts))
    for p in parts:
        if isinstance(p, Frag):
            sent.frags[p.id] = p.html
        elif isinstance(p, Keyed):
            sent.orders[p.id] = tuple(i.id for i in p.items)
            for i in p.items:
                sent.frags[i.id] = i.html
    if before is None or before.shape != sent.shape:
        data = "".join(f"data: {line}\n" for line in document_of(parts).split("\n"))
        return sent, f"event: view\n{data}\n".encode()
    changed = {k: v for k, v in sent.frags.items() if before.frags.get(k) != v}
    orders = {k: list(v) for k, v in sent.orders.items() if before.orders.get(k) != v}
    if not changed and not orders:
        return sent, None
    body = msgspec.json.encode({"set": changed, "order": orders})
    return sent, b"event: patch\ndata: " + body + b"\n\n"


# --- nodes, as the page counts them ------------------------------------------------------


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


class Page:
    """Renders the page from placement's state; keeps the last events it heard."""

    def __init__(
        self,
        service: PlacementService,
        nodes: Callable[[], list[Any]],
        *,
        catalog: Callable[[], list[Any]] | None = None,
        usage: UsageWindow | None = None,
    ) -> None:
        self.service = service
        self.nodes = nodes
        self.catalog = catalog
        self.usage = usage
        # (number, time, line): the number names the event's element on the page.
        self.events: collections.deque[tuple[int, float, str]] = collections.deque(maxlen=EVENTS_KEPT)
        self._heard = 0
        # Each install's step so far (`event_line`).
        self._install_steps: dict[tuple[str, str], str] = {}
        self._pools: dict[str, str] = {}
        self._shared: dict[Query, tuple[float, list[Part]]] = {}
        # What the last render took (seconds).
        self.render_s = 0.0

    def heard(self, line: str) -> None:
        self._heard += 1
        self.events.append((self._heard, time.time(), line))

    async def listen(self) -> None:
        """Keep the recent events (core NATS: the page shows what happens from now on)."""
        bus = self.service.bus

        async def on_msg(msg: Msg) -> None:
            line = event_line(msg.subject, msg.data, self._install_steps)
            if line:
                self.heard(line)

        try:
            sub = await bus.nc.subscribe(bus.names.events_all, cb=on_msg)
        except Exception as exc:  # the page goes on without its events, placement goes on
            log.warning("the cluster page cannot follow the events: %s", exc)
            self.heard(f"(this placement cannot follow the events: {exc})")
            return
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    # --- the view ----------------------------------------------------------------

    def view(self, query: Query = EVERYTHING) -> str:
        """The page's body: every section, rendered now."""
        return document_of(self.parts(query))

    def shared_parts(self, query: Query) -> list[Part]:
        """`parts(query)`, rendered once for every tab that asks within SHARED_S."""
        at = time.monotonic()
        kept = self._shared.get(query)
        if kept is not None and at - kept[0] < SHARED_S:
            return kept[1]
        parts = self.parts(query)
        self.render_s = time.monotonic() - at
        self._shared = {q: v for q, v in self._shared.items() if at - v[0] < SHARED_S}
        self._shared[query] = (at, parts)
        return parts

    def parts(self, query: Query = EVERYTHING) -> list[Part]:
        service = self.service
        # An ex-leader holds what it last knew: only a leader shows its own.
        view = service.view
        head = (
            f"<p class=who>placement <b>{_e(service.identity)}</b> · "
            + ("leader" if service.is_leader else "standby: replicas and decisions are the leader's")
            + "</p>"
            + "".join(f"<div class=warn>{_e(w)}</div>" for w in service.warnings())
        )
        blocked = service.cannot_write()
        if blocked:
            head += f"<p class=alert id=store>{_e(blocked)}</p>"
        replicas = view.replicas()
        shards = view.shards()
        statuses = view.statuses()
        holders: dict[tuple[str, int], str] = {}
        for spec in shards.values():
            for gpu in spec.gpus:
                holders[(spec.node, gpu)] = f"{spec.deployment}/{spec.replica}"
        shard_status = dict(service.state.shard_status)
        nodes = self.nodes()
        counts = {row.node: counted(row, holders) for row in nodes}
        return [
            Frag("head", f"<div id=head>{head}</div>"),
            Frag("summary", self._summary(nodes, counts, statuses)),
            Frag("problems", self._problems(replicas, statuses, nodes, counts, query)),
            *self._deployment(query, replicas, statuses),
            *self._nodes(holders, nodes, counts, query),
            *self._deployments(statuses, query),
            *self._replicas(replicas, shard_status, query),
            Frag("catalog", self._catalog()),
            Frag("usage", self._usage()),
            *self._events(),
        ]

    def _summary(self, nodes: list[Any], counts: dict[str, Counted], statuses: dict[str, Any]) -> str:
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

    def _problems(
        self,
        replicas: dict[str, ReplicaRecord],
        statuses: dict[str, Any],
        nodes: list[Any],
        counts: dict[str, Counted],
        query: Query,
    ) -> str:
        """What is wrong, before anything else: each failing replica with its reason, each
        deployment with replicas that cannot be placed, and the nodes lost or claimed twice."""
        # What placement says of a node (a silent installer, a clock off), the first ten.
        said = [(row.node, problem) for row in nodes for problem in row.problems]
        items = [f"<li data-problem='{_e(node)}'>{_e(problem)}</li>" for node, problem in said[:10]]
        if len(said) > 10:
            items.append(f"<li data-problem='nodes-more'>and {len(said) - 10} more said of nodes</li>")
        for key in sorted(replicas):
            r = replicas[key]
            told = failures.failure_of(r)
            failing = r.state in ("degraded", "failed", "unknown", "unplaceable")
            if not failing and (r.state == "ready" or told is None):
                continue
            reason = _said(r.state, r.reason).removeprefix(": ") or failures.summary(told)
            last = told.log_tail[-1] if told is not None and told.log_tail else ""
            items.append(
                f"<li data-problem='{_e(key)}'>"
                f"<a href='{_e(query.href(deployment=r.deployment))}#deployment'>"
                f"<b>{_e(r.deployment)}/{_e(r.replica)}</b></a> "
                f"<span class='state {_e(r.state)}'>{_e(r.state)}</span>"
                + (f", {r.restarts} restarts" if r.restarts else "")
                + (f": {_e(reason)}" if reason else "")
                + (f" <code>{_e(last)}</code>" if last else "")
                + "</li>"
            )
        for name in sorted(statuses):
            status = statuses[name]
            if status.unplaceable or status.blocked:
                items.append(f"<li data-problem='{_e(name)}'>{_e(status.summary)}</li>")
        for state, words in (("lost", "lost"), ("claimed", "claimed by two machines")):
            named = [row.node for row in nodes if counts[row.node].state == state]
            if named:
                shown = ", ".join(named[:10]) + (f" and {len(named) - 10} more" if len(named) > 10 else "")
                link = query.href(state=state, node="")
                items.append(
                    f"<li data-problem='nodes-{state}'><a href='{_e(link)}#nodes'>"
                    f"<b>{len(named)} node{'s' if len(named) != 1 else ''} {words}</b></a>: {_e(shown)}</li>"
                )
        if not items:
            # No red bar beside "none": the bar's colour says what the count says.
            return "<section id=problems class=none><h2>Problems (0)</h2><p>none</p></section>"
        return (
            f"<section id=problems class=some><h2>Problems ({len(items)})</h2><ul>"
            + "".join(items)
            + "</ul></section>"
        )

    def _deployment(
        self, query: Query, replicas: dict[str, ReplicaRecord], statuses: dict[str, Any]
    ) -> list[Part]:
        """The deployment a tab opened (`?deployment=`): its status, its replicas and their
        reasons, and a chat box that sends one request through the gateway (see `CHAT`)."""
        name = query.deployment
        if not name:
            return []
        dep = self.service.state.deployments.get(name)
        close = f"<a class=close href='{_e(query.href(deployment=''))}'>close</a>"
        if dep is None:
            return [
                f"<section id=deployment><h2>Deployment {_e(name)}</h2>{close}"
                f"<p class=warn>no deployment {_e(name)} (the deployments are listed below)</p></section>"
            ]
        status = statuses.get(name)
        mine = [replicas[k] for k in sorted(replicas) if replicas[k].deployment == name]
        lines = "".join(
            f"<li data-replica='{_e(r.deployment)}.{_e(r.replica)}'><b>{_e(r.replica)}</b> "
            f"<span class='state {_e(r.state)}'>{_e(r.state)}</span>"
            + (f" on {_e(', '.join(sorted({k.split('.', 1)[0] for k in r.shards})))}" if r.shards else "")
            + _e(_said(r.state, r.reason))
            + "</li>"
            for r in mine
        )
        summary = _e(status.summary) if status else "not yet judged by a leader"
        live = (
            f"<div id=dep-live><p>profile <b>{_e(dep.profile)}</b> · {summary}</p>"
            f"<ul>{lines or '<li>no replica yet</li>'}</ul></div>"
        )
        gateway = self.service.config.http.gateway_url.rstrip("/")
        return [
            f"<section id=deployment><h2>Deployment {_e(name)}</h2>{close}",
            Frag("dep-live", live),
            Frag("dep-chart", self._chart(name, dep.replicas if dep.autoscale is None else None)),
            CHAT.replace("{gateway}", _e(gateway)).replace("{model}", _e(name))
            + (
                ""
                if gateway
                else "<p class=warn id=chat-off>Set <code>http: gateway_url</code> in placement's "
                "server.yaml (the gateway's address as a browser reaches it) to try this model "
                "from here.</p>"
            ),
            "</section>",
        ]

    def _chart(self, name: str, fixed: int | None) -> str:
        """The deployment's demand (the gateways' reports summed, as the autoscaler hears them)
        and its replica count (the one chosen, or `fixed` for one that does not autoscale) over
        the last minutes (`chart.demand_chart`)."""
        book = self.service.demand
        at = time.monotonic()
        demand = book.history(name)
        counts: tuple[tuple[float, float], ...] = self.service.view.counts(name)
        if fixed is not None:
            counts = ((book.started, float(fixed)),)
        return demand_chart(demand, counts, at)

    def _pool_of(self, node: str) -> str:
        pools = self._pools.get(node)
        if pools is None:
            config = self.service.config.pools
            pools = self._pools[node] = ", ".join(
                p for p, pats in sorted(config.items()) if any(fnmatch.fnmatchcase(node, x) for x in pats)
            )
        return pools

    def _nodes(
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
            groups.setdefault((cls, self._pool_of(row.node)), []).append(row)
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
                f"Nodes matching {_e(' '.join(x for x in (query.node, query.state) if x))} ({len(listed)})"
            )
        else:
            title = "Every node" if small else f"Nodes to look at ({len(listed)})"
        by_state = collections.Counter(c.state for c in counts.values())
        # Nodes, as the summary's first part and the groups' table count them (the summary's
        # `free` and `held` that follow are GPUs, and say so); each a filter.
        legend = "nodes: " + " · ".join(
            f"<a href='{_e(query.href(state=s))}#nodes' data-legend={s} title='{_e(STATE_WORDS[s])}'>"
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
                    f"<tr id='grp-{slug}' data-group='{_e(cls)}|{_e(pools)}'><td>{_e(cls)}</td>"
                    f"<td>{_e(pools) or '—'}</td><td class=nodes>{len(members)}</td>"
                    f"<td class=alive>{states['held'] + states['free'] + states['cordoned']}</td>"
                    f"<td class=lost>{states['lost']}</td>"
                    f"<td class=cordoned>{states['cordoned']}</td><td>{sum(x.held for x in c)}</td>"
                    f"<td>{sum(x.free for x in c)}</td><td>{sum(x.unusable for x in c)}</td></tr>",
                )
            )
            grids += [
                f"<h3>{_e(cls)}" + (f" · pool {_e(pools)}" if pools else "") + "</h3>",
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
            _find(query),
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
            f"<a id='c-{_e(row.node)}' class='c {c.state}' href='{_e(link)}#nodes' title='{_e(title)}'></a>",
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
            state = f"<span class=bad>lost, last heard {_when(heard)}</span>"
        if row.intent:
            state += f" <span class=warn>{_e(row.intent)}</span>"
        system = f"{facts.os_id} {facts.os_version} {facts.arch}".strip() if facts else ""
        # A node not heard (or claimed twice) has no free GPU: they are unusable.
        unheld = "free" if row.alive and not row.claimed else "unusable"
        gpus = "".join(
            f"<span class='gpu {'held' if (row.node, g.index) in holders else unheld}' "
            f"title='{_e(g.name)} cc {_e(g.compute_capability)}'>"
            f"{g.index}<small>{_e(holders.get((row.node, g.index), unheld))}</small></span>"
            for g in row.gpus
        )
        engines = "<br>".join(
            f"{_e(e.name)} <b>{_e(e.state)}</b> {_e(e.version)}"
            + (f" <small>{_e(e.engine_version)}</small>" if e.engine_version not in ("", e.version) else "")
            + (f" — {_e(e.detail)}" if e.detail else "")
            for e in row.engines
        )
        if row.install:
            last = "" if row.alive else " (last known)"
            engines += f"<div class=install>{_e(row.install)}{last}</div>"
        said = (
            ((row.claimed,) if row.claimed else ())
            + tuple(row.problems)
            + row.warnings
            + tuple(f"model file not found: {p}" for p in row.missing_models)
        )
        warnings = "".join(f"<div class=warn>{_e(w)}</div>" for w in said)
        # Its shards as they read now: a lost node's read `unknown (node lost 13 s ago)`.
        for k, state in shards:
            cls = "ok" if state == "ready" else "bad"
            engines += (
                f"<div class=shard data-shard='{_e(k)}'>{_e(k.split('.', 1)[-1])}: "
                f"<span class={cls}>{_e(state)}</span></div>"
            )
        return (
            f"<tr id='n-{_e(row.node)}' data-node='{_e(row.node)}'><td>{_e(row.node)}</td>"
            f"<td>{state}{warnings}</td>"
            f"<td class=sys>{_e(system)}</td><td class=gpus>{gpus or '—'}</td>"
            f"<td>{engines or '—'}</td></tr>"
        )

    def _deployments(self, statuses: dict[str, Any], query: Query) -> list[Part]:
        rows = []
        for name, dep in sorted(self.service.state.deployments.items()):
            status = statuses.get(name)
            # An autoscaled deployment's count is the one placement chose (`desired`), in its bounds.
            bounds = f" ({dep.autoscale.min_replicas}-{dep.autoscale.max_replicas})" if dep.autoscale else ""
            ready = (f"{status.ready} / {status.desired}" if status else f"? / {dep.replicas}") + bounds
            summary = _e(status.summary) if status else "not yet judged by a leader"
            reasons = reasons_html(name, [(r.node, r.reason) for r in status.reasons]) if status else ""
            rows.append(
                Frag(
                    f"d-{name}",
                    f"<tr id='d-{_e(name)}' data-deployment='{_e(name)}'>"
                    f"<td><a href='{_e(query.href(deployment=name))}#deployment'>{_e(name)}</a></td>"
                    f"<td>{_e(dep.profile)}</td><td class=ready>{ready}</td><td>{summary}{reasons}</td></tr>",
                )
            )
        return [
            "<section id=deployments>",
            Frag("deployments-h", f"<h2 id=deployments-h>Deployments ({len(rows)})</h2>"),
            Keyed(
                "deployment-rows",
                "<div class=wide><table><thead><tr><th>deployment</th><th>profile</th>"
                "<th>ready</th><th>status</th></tr></thead><tbody id=deployment-rows>",
                rows,
                "</tbody></table></div>",
            ),
            "</section>",
        ]

    def _replicas(
        self, replicas: dict[str, ReplicaRecord], shard_status: dict[str, ShardStatus], query: Query
    ) -> list[Part]:
        rows = []
        for key in sorted(replicas):
            r = replicas[key]
            nodes = ", ".join(sorted({k.split(".", 1)[0] for k in r.shards}))
            since = _when(r.since) if r.since else ""
            # The failure's own lines, unless the reason already quotes them whole (as a
            # placement that predates the failure's fields wrote it).
            told = failures.failure_of(r)
            said = failures.text(told)
            shown = said and said.replace("\n", " ") not in r.reason.replace("\n", " ")
            details = failures.details(told) if told is not None else ""
            failure = (
                f"<pre>{_e(f'{details}:' + chr(10) if details else '')}{_e(said)}</pre>" if shown else ""
            )
            loads = [
                s.load for k in r.shards if (s := shard_status.get(k)) is not None and s.load is not None
            ]
            load = EngineLoad.combined(loads)
            rows.append(
                Frag(
                    f"r-{key}",
                    f"<tr id='r-{_e(key)}' data-replica='{_e(key)}'>"
                    f"<td>{_e(r.deployment)}/{_e(r.replica)}</td>"
                    f"<td class='state {_e(r.state)}'>{_e(r.state)}</td><td>{_e(nodes)}</td>"
                    f"<td class=nowrap>{since}</td>"
                    f"<td>{r.restarts}</td><td>{_e(load.summary) if load else '-'}</td>"
                    f"<td>{_e(r.reason)}{failure}</td></tr>",
                )
            )
        return [
            "<section id=replicas>",
            Frag("replicas-h", f"<h2 id=replicas-h>Replicas ({len(rows)})</h2>"),
            Keyed(
                "replica-rows",
                "<div class=wide><table><thead><tr><th>replica</th><th>state</th>"
                "<th>nodes</th><th>since</th><th>restarts</th><th>load</th><th>reason</th></tr></thead>"
                "<tbody id=replica-rows>",
                rows,
                "</tbody></table></div>",
            ),
            "</section>",
        ]

    def _catalog(self) -> str:
        """The profiles, as `/api/catalog` lists them."""
        if self.catalog is None:
            return ""
        rows = []
        for p in self.catalog():
            parallel = f"tp {p.tp} × pp {p.pp}" if p.pp > 1 else f"tp {p.tp}"
            if p.gpu_class:
                size = f"{p.gpus} GPU{'s' if p.gpus != 1 else ''}"
                if p.nodes > 1:
                    size += f" ({p.gpus_per_node} on each of {p.nodes} nodes)"
            else:
                # A profile with no GPU class asks for no GPU (docs/engines.md): it runs on CPUs.
                size = "CPU" + (f" (on each of {p.nodes} nodes)" if p.nodes > 1 else "")
            source = p.model or p.model_path
            held = f"<small>staged on {_e(', '.join(p.weights_on))}</small>" if p.weights_on else ""
            rows.append(
                f"<tr data-profile='{_e(p.name)}'><td>{_e(p.name)}</td><td class=engine>{_e(p.engine)}</td>"
                f"<td class=class>{_e(p.gpu_class or 'CPU')}</td>"
                f"<td class=size>{_e(size)}, {_e(parallel)}</td>"
                f"<td class=model>{_e(source)}{held}</td><td>{_e(', '.join(p.deployments)) or '—'}</td></tr>"
            )
        return (
            f"<section id=catalog><h2>Catalog ({len(rows)})</h2><div class=wide><table>"
            "<tr><th>profile</th><th>engine</th><th>GPU class</th><th>size</th><th>model</th>"
            "<th>deployments</th></tr>" + "".join(rows) + "</table></div></section>"
        )

    def _usage(self) -> str:
        """The last day's tokens per deployment and per key, as `/api/usage` sums them."""
        if self.usage is None:
            return ""
        error = f"<p class=warn>{_e(self.usage.error)}</p>" if self.usage.error else ""
        tables = []
        for by, what in (("deployment", "deployment"), ("key", "key")):
            rows = "".join(
                f"<tr data-usage-{by}='{_e(getattr(r, by))}'><td>{_e(getattr(r, by))}</td>"
                f"<td class=requests>{r.requests}</td><td class=prompt>{r.prompt_tokens}</td>"
                f"<td class=completion>{r.completion_tokens}</td></tr>"
                for r in self.usage.rows(by)
            )
            tables.append(
                f"<div class=wide><table class=usage-by-{by}><tr><th>{what}</th><th>requests</th>"
                "<th>prompt tokens</th><th>completion tokens</th></tr>"
                + (rows or "<tr><td colspan=4>none in the last 24 h</td></tr>")
                + "</table></div>"
            )
        return f"<section id=usage><h2>Usage, last 24 h</h2>{error}" + "".join(tables) + "</section>"

    def _events(self) -> list[Part]:
        items = [
            Frag(
                f"e-{n}",
                f"<li id=e-{n}><time>{time.strftime('%H:%M:%S', time.localtime(at))}</time> {_e(line)}</li>",
            )
            for n, at, line in reversed(self.events)
        ] or [Frag("e-0", "<li id=e-0>none yet</li>")]
        return [
            "<section id=events><h2>Recent events</h2>",
            Keyed("event-list", "<ul id=event-list>", items, "</ul>"),
            "</section>",
        ]

    # --- HTTP --------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/page/stream", self.events_stream, methods=["GET"]),
        ]

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.document(Query.of(request)))

    async def events_stream(self, request: Request) -> Response:
        return StreamingResponse(
            self.stream(Query.of(request)),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def document(self, query: Query = EVERYTHING) -> str:
        when = time.strftime("%H:%M:%S UTC", time.gmtime())
        return (
            PAGE.replace("{reload}", str(NOSCRIPT_RELOAD_S))
            .replace("{when}", when)
            .replace("{view}", self.view(query))
        )

    async def stream(self, query: Query = EVERYTHING) -> AsyncIterator[bytes]:
        """Server-sent events: the view first, then what changed in it (`changes`), looked
        for twice a second (less often where a render takes more than a twentieth of that),
        and a comment now and then, so a proxy keeps the connection open."""
        sent: Sent | None = None
        quiet = 0.0
        while True:
            sent, message = changes(sent, self.shared_parts(query))
            if message is not None:
                quiet = 0.0
                yield message
            elif quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield b": still here\n\n"
            pause = max(REFRESH_S, RENDER_SHARE * self.render_s)
            await anyio.sleep(pause)
            quiet += pause


def reasons_html(deployment: str, reasons: Sequence[tuple[str, str]]) -> str:
    """A refusal's reasons under its deployment: every node's when a few, else grouped by
    reason with how many nodes and a few of their names (`view.reason_groups`), so that a
    refusal by 1,000 nodes is a few lines, not 1,000. Every node's reason is one link away."""
    if not reasons:
        return ""
    if len(reasons) <= REASON_GROUPS:
        items = [f"<li><b>{_e(node)}</b>: {_e(reason)}</li>" for node, reason in reasons]
    else:
        top, other, on = reason_groups(reasons)
        items = [
            f"<li data-reason-count={g.nodes}><b>{g.nodes} nodes</b>: {_e(g.reason)} <small>"
            f"({_e(', '.join(g.examples))}{', …' if g.nodes > len(g.examples) else ''})</small></li>"
            for g in top
        ]
        if other:
            items.append(f"<li>and {other} other reasons on {on} nodes</li>")
        link = "api/explain/" + _e(deployment)
        items.append(f"<li><a href='{link}'>every node's reason</a></li>")
    return "<ul class=reasons>" + "".join(items) + "</ul>"


def _find(query: Query) -> str:
    """The nodes' filter: a form, so that it works without JavaScript (with it, the grid
    also dims the nodes that do not match as one types)."""
    options = "".join(
        f"<option value='{s}'{' selected' if s == query.state else ''}>{s}</option>" for s in ("", *STATES)
    )
    keep = f"<input type=hidden name=deployment value='{_e(query.deployment)}'>" if query.deployment else ""
    return (
        "<form id=find data-keep method=get action='#nodes'>"
        f"<input name=node value='{_e(query.node)}' placeholder='node name, part of it, or sim-00*' "
        "aria-label='nodes to list'> "
        f"<select name=state aria-label='state'>{options}</select> {keep}<button>list</button>"
        + (
            f" <a href='{_e(query.href(node='', state=''))}#nodes'>clear</a>"
            if query.node or query.state
            else ""
        )
        + "</form>"
    )


# The chat box: one chat completion sent by the browser itself to the gateway, with a key
# the user types and the browser keeps (sessionStorage, this tab only). Placement never sees
# the key or the answer: its page only reads (the read token in a cookie changes nothing),
# and the request is the one any client of the gateway makes, counted against that key.
CHAT = """<form id=chat data-keep data-gateway='{gateway}' data-model='{model}'>
<label>API key <input name=key type=password autocomplete=off
placeholder='sk-… (kept in this tab only)'></label>
<label class=ask>Message <textarea name=message rows=2 required>Say hello in five words.</textarea></label>
<button>send to {model}</button> <span id=chat-state></span>
<pre id=chat-answer></pre>
<noscript><p class=warn>The chat box needs JavaScript.</p></noscript>
</form>"""


PAGE = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width, initial-scale=1">
<title>llmgw cluster</title>
<noscript><meta http-equiv=refresh content="{reload}"></noscript>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.2em 0 .4em}h3{font-size:1em;margin:.8em 0 .3em}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.3em .5em;
text-align:left;vertical-align:top;overflow-wrap:break-word}th{background:#f4f4f4}
.wide{overflow-x:auto;max-width:100%}
.ok{color:#176117;font-weight:600}.bad{color:#a11;font-weight:600}.warn{color:#8a5a00}
.gpu{display:inline-block;min-width:4.5em;margin:1px;padding:1px 4px;border-radius:3px;font-size:12px}
.gpu small{display:block;font-size:10px}.gpu.free{background:#e8f3e8}.gpu.held{background:#dde6f7}
.gpu.unusable{background:#eee;color:#777}#summary{font-size:15px}#problems li{margin:.2em 0}
#problems{border-left:3px solid #a11;padding-left:.6em}#problems.none{border-left-color:#176117}
#problems code,code{overflow-wrap:anywhere;white-space:pre-wrap}
table.usage-by-key{margin-top:.8em}
.state.ready{color:#176117;font-weight:600}.state.failed,.state.degraded,.state.unknown{color:#a11}
pre{white-space:pre-wrap;overflow-wrap:anywhere;font-size:12px;margin:.3em 0;background:#f8f8f8;padding:.3em}
.install{color:#555;font-style:italic}
.alert{background:#fbe9e9;color:#a11;font-weight:600;padding:.4em .6em;border-radius:3px}
#live{float:right;color:#777;font-size:13px;font-weight:normal}
ul.reasons{margin:.2em 0;padding-left:1.2em}time{color:#777}.nowrap{white-space:nowrap}
.grid{line-height:0;margin:.2em 0 .6em}
.c{display:inline-block;width:10px;height:10px;margin:1px;border-radius:2px;background:#bfe0bf}
.c.held{background:#6f93d8}.c.lost{background:#c33}.c.claimed{background:#c3c}.c.cordoned{background:#e0a020}
.c.dim{opacity:.15}#legend a{color:inherit;text-decoration:none;margin-right:.3em}
#legend i{vertical-align:middle}#find{margin:.5em 0}#find input{max-width:60vw}
.hint{background:#fff6dc;padding:.4em .6em;border-radius:3px}
#deployment{border:1px solid #ccd;padding:.2em .8em .6em;border-radius:4px}.close{float:right}
#dep-chart{margin:.4em 0}#dep-chart svg{max-width:100%;height:auto;background:#fafafa}
#dep-chart .axis{stroke:#ccc}#dep-chart polyline{stroke-width:1.5}
#dep-chart .demand{stroke:#36c;color:#36c}#dep-chart .replicas{stroke:#c60;color:#c60}
#dep-chart figcaption{font-size:12px;color:#555}
#chat label{display:block;margin:.3em 0}#chat textarea,#chat input{width:100%;box-sizing:border-box}
@media (max-width:600px){body{margin:.6em}td,th{padding:.2em .3em}#live{float:none;display:block}
.gpu{min-width:0;padding:0 3px}.gpu small{display:none}.sys{display:none}table.groups{font-size:12px}}
</style></head>
<body><h1>llmgw cluster <span id=live>as of {when}</span></h1>
<noscript><p class=hint id=nojs>This page is live only with JavaScript: without it, it reloads
itself every {reload} s (or reload it now for news).</p></noscript>
<main id=view>{view}</main>
<script>
const live = document.getElementById("live");
const view = document.getElementById("view");
live.textContent = "connecting…";
function make(html) {
  const t = document.createElement("template");
  t.innerHTML = html;
  return t.content.firstElementChild;
}
function dim() {
  const box = document.querySelector("#find input[name=node]");
  const want = box ? box.value.trim().toLowerCase() : "";
  for (const c of document.querySelectorAll(".grid .c")) {
    c.classList.toggle("dim", want !== "" && !c.id.slice(2).toLowerCase().includes(want));
  }
}
function whole(html) {
  // What the user is typing into (the filter, the chat box) stays as it is.
  const kept = [...view.querySelectorAll("[data-keep]")];
  view.innerHTML = html;
  for (const k of kept) {
    const fresh = document.getElementById(k.id);
    if (fresh) fresh.replaceWith(k);
  }
}
function patch(p) {
  const set = p.set || {};
  for (const [box, order] of Object.entries(p.order || {})) {
    const parent = document.getElementById(box);
    if (!parent) continue;
    const kids = order.map((id) => {
      if (id in set) { const el = make(set[id]); delete set[id]; return el; }
      return document.getElementById(id);
    }).filter(Boolean);
    parent.replaceChildren(...kids);
  }
  for (const [id, html] of Object.entries(set)) {
    const el = document.getElementById(id);
    if (el) el.replaceWith(make(html));
  }
}
function ago() {
  const now = Date.now() / 1000;
  for (const t of document.querySelectorAll("time[data-at]")) {
    const s = Math.max(0, Math.floor(now - Number(t.dataset.at)));
    t.textContent = s < 120 ? s + " s ago" : s < 7200 ? Math.floor(s / 60) + " min ago"
      : Math.floor(s / 3600) + " h ago";
  }
}
setInterval(ago, 1000);
function seen() { live.textContent = "live " + new Date().toLocaleTimeString(); dim(); ago(); }
const source = new EventSource("page/stream" + location.search);
source.addEventListener("view", (e) => { whole(e.data); seen(); });
source.addEventListener("patch", (e) => { patch(JSON.parse(e.data)); seen(); });
source.onerror = () => { live.textContent = "reconnecting…"; };
document.addEventListener("input", (e) => { if (e.target.closest("#find")) dim(); });
document.addEventListener("submit", async (e) => {
  const form = e.target;
  if (form.id !== "chat") return;
  e.preventDefault();
  const state = document.getElementById("chat-state");
  const answer = document.getElementById("chat-answer");
  const key = form.elements.key.value.trim();
  if (key) sessionStorage.setItem("llmgw-key", key);
  if (!form.dataset.gateway) { state.textContent = "no gateway_url in placement's config"; return; }
  state.textContent = "asking…";
  answer.textContent = "";
  const headers = {"Content-Type": "application/json"};
  if (key) headers.Authorization = "Bearer " + key;
  try {
    const r = await fetch(form.dataset.gateway + "/v1/chat/completions", {
      method: "POST", headers, body: JSON.stringify({
        model: form.dataset.model, max_tokens: 64,
        messages: [{role: "user", content: form.elements.message.value}]})});
    const body = await r.json().catch(() => ({}));
    if (!r.ok) {
      state.textContent = "gateway answered " + r.status;
      answer.textContent = (body.error && body.error.message) || JSON.stringify(body);
      return;
    }
    state.textContent = "answered" + (body.usage ? ` (${body.usage.completion_tokens} tokens)` : "");
    answer.textContent = body.choices[0].message.content;
  } catch (err) {
    state.textContent = "cannot reach the gateway at " + form.dataset.gateway + ": " + err;
  }
});
const chatKey = document.querySelector("#chat input[name=key]");
if (chatKey) chatKey.value = sessionStorage.getItem("llmgw-key") || "";
</script></body></html>
"""
