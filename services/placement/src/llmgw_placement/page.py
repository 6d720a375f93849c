"""The cluster page at `/`: nodes, deployments, replicas, the catalog, the last day's usage
and recent events, live.

Server-rendered HTML. The page opens `/page/stream` (server-sent events) and
swaps in the freshly rendered view whenever it changes, so nothing needs a
reload. Every text comes from the same records as `/api/*` and `llmgw ctl`:
the page computes nothing of its own.
"""

from __future__ import annotations

import collections
import contextlib
import html
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from nats.aio.msg import Msg
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from llmgw_core import failures
from llmgw_core.events import EngineLoad, ReplicaRecord, ShardStatus

if TYPE_CHECKING:
    from .service import PlacementService
    from .usage import UsageWindow

log = logging.getLogger("llmgw.placement.page")

# How often the stream looks for a change, and how often it says it is still there.
REFRESH_S = 0.5
KEEPALIVE_S = 15.0
EVENTS_KEPT = 40


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _ago(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h"


def event_line(subject: str, data: bytes) -> str | None:
    """One line for an event, in the words its writer gave; None for the ones the page skips."""
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    if not isinstance(body, dict):
        return None
    kind = body.get("kind")
    if kind == "ReplicaStatus":
        reason = f": {body['reason']}" if body.get("reason") else ""
        return f"replica {body.get('deployment')}/{body.get('replica')} {body.get('state')}{reason}"
    if kind == "ShardStatus":
        reason = f": {body['reason']}" if body.get("reason") else ""
        return f"shard {body.get('node')}/{body.get('shard')} {body.get('state')}{reason}"
    if kind == "PlacementDecision":
        if body.get("outcome") == "placed":
            return (
                f"placed {body.get('deployment')}/{body.get('replica')} on {', '.join(body.get('nodes', []))}"
            )
        reasons = "; ".join(f"{r.get('node')}: {r.get('reason')}" for r in body.get("reasons", []))
        return f"cannot place {body.get('deployment')}: {reasons}"
    if kind == "DeploymentStatus":
        return str(body.get("summary", ""))
    if kind == "ScaleDecision":
        return f"{body.get('deployment')}: {body.get('reason')}"
    if kind == "InstallProgress":
        return f"{body.get('node')}: {body.get('message')}"
    if kind == "NodeLifecycle":
        return f"node {body.get('node')} {body.get('state')}"
    return None


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
        self.events: collections.deque[tuple[float, str]] = collections.deque(maxlen=EVENTS_KEPT)

    async def listen(self) -> None:
        """Keep the recent events (core NATS: the page shows what happens from now on)."""
        bus = self.service.bus

        async def on_msg(msg: Msg) -> None:
            line = event_line(msg.subject, msg.data)
            if line:
                self.events.append((time.time(), line))

        try:
            sub = await bus.nc.subscribe(bus.names.events_all, cb=on_msg)
        except Exception as exc:  # the page goes on without its events, placement goes on
            log.warning("the cluster page cannot follow the events: %s", exc)
            self.events.append((time.time(), f"(this placement cannot follow the events: {exc})"))
            return
        try:
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
                await sub.unsubscribe()

    # --- the view ----------------------------------------------------------------

    def view(self) -> str:
        """The page's body: every section, rendered now."""
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
        reading = view.shard_states(time.monotonic())
        return "\n".join(
            [
                head,
                self._summary(nodes, holders, statuses),
                self._problems(replicas, statuses, nodes),
                self._nodes(holders, nodes, shard_status, reading),
                self._deployments(statuses),
                self._replicas(replicas, shard_status),
                self._catalog(),
                self._usage(),
                self._events(),
            ]
        )

    def _summary(
        self, nodes: list[Any], holders: dict[tuple[str, int], str], statuses: dict[str, Any]
    ) -> str:
        """One line first: nodes alive and lost, GPUs held, free and unusable (every GPU of a
        node not heard, or claimed by two machines, is unusable: never free), deployments
        ready, degraded and unplaceable."""
        alive = lost = held = free = unusable = 0
        for row in nodes:
            usable = row.alive and not row.claimed
            alive += usable
            lost += not row.alive
            for g in row.gpus:
                if not usable:
                    unusable += 1
                elif (row.node, g.index) in holders:
                    held += 1
                else:
                    free += 1
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
            f"nodes {n(alive, 'alive')}, {n(lost, 'lost', 'bad')} · "
            f"GPUs {n(held, 'held')}, {n(free, 'free')}, {n(unusable, 'unusable', 'bad')} · "
            f"deployments {n(ready, 'ready')}, {n(degraded, 'degraded', 'bad')}, "
            f"{n(unplaceable, 'unplaceable', 'bad')}</p>"
        )

    def _problems(
        self, replicas: dict[str, ReplicaRecord], statuses: dict[str, Any], nodes: list[Any]
    ) -> str:
        """What is wrong, before the nodes: what placement says of a node (a silent installer, a
        clock off), each failing replica with its reason, and each deployment with replicas that
        cannot be placed or a change that cannot proceed."""
        items = [
            f"<li data-problem='{_e(row.node)}'>{_e(problem)}</li>"
            for row in nodes
            for problem in row.problems
        ]
        for key in sorted(replicas):
            r = replicas[key]
            told = failures.failure_of(r)
            failing = r.state in ("degraded", "failed", "unknown", "unplaceable")
            if not failing and (r.state == "ready" or told is None):
                continue
            reason = failures.one_line(r.reason) or failures.summary(told)
            last = told.log_tail[-1] if told is not None and told.log_tail else ""
            items.append(
                f"<li data-problem='{_e(key)}'><b>{_e(r.deployment)}/{_e(r.replica)}</b> "
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
        if not items:
            return "<section id=problems><h2>Problems (0)</h2><p>none</p></section>"
        return (
            f"<section id=problems><h2>Problems ({len(items)})</h2><ul>" + "".join(items) + "</ul></section>"
        )

    def _nodes(
        self,
        holders: dict[tuple[str, int], str],
        nodes: list[Any],
        shard_status: dict[str, ShardStatus],
        reading: dict[str, str],
    ) -> str:
        on_node: dict[str, list[str]] = {}
        for k, st in sorted(shard_status.items()):
            state = reading.get(k, st.state)
            cls = "ok" if state == "ready" else "bad"
            on_node.setdefault(st.node, []).append(
                f"<div class=shard data-shard='{_e(k)}'>{_e(st.shard)}: "
                f"<span class={cls}>{_e(state)}</span></div>"
            )
        rows = []
        for row in nodes:
            status = self.service.state.nodes.get(row.node)
            facts = status.facts if status else None
            if row.claimed:
                state = "<span class=bad>claimed twice</span>"
            elif row.alive:
                state = "<span class=ok>alive</span>"
            elif row.seen_s_ago < 0:
                state = "<span class=bad>lost</span> (not heard since placement started)"
            else:
                state = f"<span class=bad>lost {_ago(row.seen_s_ago)} ago</span>"
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
                + (
                    f" <small>{_e(e.engine_version)}</small>"
                    if e.engine_version not in ("", e.version)
                    else ""
                )
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
            engines += "".join(on_node.get(row.node, ()))
            rows.append(
                f"<tr data-node='{_e(row.node)}'><td>{_e(row.node)}</td><td>{state}</td>"
                f"<td>{_e(system)}{warnings}</td><td class=gpus>{gpus or '—'}</td>"
                f"<td>{engines or '—'}</td></tr>"
            )
        return (
            f"<section id=nodes><h2>Nodes ({len(rows)})</h2><table>"
            "<tr><th>node</th><th>state</th><th>system</th><th>GPUs</th><th>engines</th></tr>"
            + "".join(rows)
            + "</table></section>"
        )

    def _deployments(self, statuses: dict[str, Any]) -> str:
        rows = []
        for name, dep in sorted(self.service.state.deployments.items()):
            status = statuses.get(name)
            ready = f"{status.ready} / {dep.replicas}" if status else f"? / {dep.replicas}"
            summary = _e(status.summary) if status else "not yet judged by a leader"
            reasons = ""
            if status and status.reasons:
                reasons = (
                    "<ul class=reasons>"
                    + "".join(f"<li><b>{_e(r.node)}</b>: {_e(r.reason)}</li>" for r in status.reasons)
                    + "</ul>"
                )
            rows.append(
                f"<tr data-deployment='{_e(name)}'><td>{_e(name)}</td><td>{_e(dep.profile)}</td>"
                f"<td class=ready>{ready}</td><td>{summary}{reasons}</td></tr>"
            )
        return (
            f"<section id=deployments><h2>Deployments ({len(rows)})</h2><table>"
            "<tr><th>deployment</th><th>profile</th><th>ready</th><th>status</th></tr>"
            + "".join(rows)
            + "</table></section>"
        )

    def _replicas(self, replicas: dict[str, ReplicaRecord], shard_status: dict[str, ShardStatus]) -> str:
        rows = []
        now = time.time()
        for key in sorted(replicas):
            r = replicas[key]
            nodes = ", ".join(sorted({k.split(".", 1)[0] for k in r.shards}))
            since = f"{_ago(now - r.since)}" if r.since else ""
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
                f"<tr data-replica='{_e(key)}'><td>{_e(r.deployment)}/{_e(r.replica)}</td>"
                f"<td class='state {_e(r.state)}'>{_e(r.state)}</td><td class=nowrap>{_e(nodes)}</td>"
                f"<td class=nowrap>{since}</td>"
                f"<td>{r.restarts}</td><td class=nowrap>{_e(load.summary) if load else '-'}</td>"
                f"<td>{_e(r.reason)}{failure}</td></tr>"
            )
        return (
            f"<section id=replicas><h2>Replicas ({len(rows)})</h2><table>"
            "<tr><th>replica</th><th>state</th><th>nodes</th><th>since</th><th>restarts</th><th>load</th>"
            "<th>reason</th></tr>" + "".join(rows) + "</table></section>"
        )

    def _catalog(self) -> str:
        """The profiles, as `/api/catalog` lists them."""
        if self.catalog is None:
            return ""
        rows = []
        for p in self.catalog():
            parallel = f"tp {p.tp} × pp {p.pp}" if p.pp > 1 else f"tp {p.tp}"
            size = f"{p.gpus} GPU{'s' if p.gpus != 1 else ''}"
            if p.nodes > 1:
                size += f" ({p.gpus_per_node} on each of {p.nodes} nodes)"
            source = p.model or p.model_path
            held = f"<small>staged on {_e(', '.join(p.weights_on))}</small>" if p.weights_on else ""
            rows.append(
                f"<tr data-profile='{_e(p.name)}'><td>{_e(p.name)}</td><td class=engine>{_e(p.engine)}</td>"
                f"<td class=class>{_e(p.gpu_class or 'any')}</td>"
                f"<td class=size>{_e(size)}, {_e(parallel)}</td>"
                f"<td class=model>{_e(source)}{held}</td><td>{_e(', '.join(p.deployments)) or '—'}</td></tr>"
            )
        return (
            f"<section id=catalog><h2>Catalog ({len(rows)})</h2><table>"
            "<tr><th>profile</th><th>engine</th><th>GPU class</th><th>size</th><th>model</th>"
            "<th>deployments</th></tr>" + "".join(rows) + "</table></section>"
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
                f"<table class=usage-by-{by}><tr><th>{what}</th><th>requests</th><th>prompt tokens</th>"
                f"<th>completion tokens</th></tr>"
                + (rows or "<tr><td colspan=4>none in the last 24 h</td></tr>")
                + "</table>"
            )
        return f"<section id=usage><h2>Usage, last 24 h</h2>{error}" + "".join(tables) + "</section>"

    def _events(self) -> str:
        items = "".join(
            f"<li><time>{time.strftime('%H:%M:%S', time.localtime(at))}</time> {_e(line)}</li>"
            for at, line in reversed(self.events)
        )
        return f"<section id=events><h2>Recent events</h2><ul>{items or '<li>none yet</li>'}</ul></section>"

    # --- HTTP --------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/", self.index, methods=["GET"]),
            Route("/page/stream", self.events_stream, methods=["GET"]),
        ]

    async def index(self, _: Request) -> Response:
        return HTMLResponse(self.document())

    async def events_stream(self, _: Request) -> Response:
        return StreamingResponse(
            self.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    def document(self) -> str:
        return PAGE.replace("{view}", self.view())

    async def stream(self) -> AsyncIterator[bytes]:
        """Server-sent events: the view whenever it changes (and a comment now and then, so
        a proxy keeps the connection open)."""
        last = ""
        quiet = 0.0
        while True:
            view = self.view()
            if view != last:
                last = view
                quiet = 0.0
                data = "".join(f"data: {line}\n" for line in view.split("\n"))
                yield f"event: view\n{data}\n".encode()
            elif quiet >= KEEPALIVE_S:
                quiet = 0.0
                yield b": still here\n\n"
            await anyio.sleep(REFRESH_S)
            quiet += REFRESH_S


PAGE = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width">
<title>llmgw cluster</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ddd;padding:.3em .5em;
text-align:left;vertical-align:top}th{background:#f4f4f4}
.ok{color:#176117;font-weight:600}.bad{color:#a11;font-weight:600}.warn{color:#8a5a00}
.gpu{display:inline-block;min-width:4.5em;margin:1px;padding:1px 4px;border-radius:3px;font-size:12px}
.gpu small{display:block;font-size:10px}.gpu.free{background:#e8f3e8}.gpu.held{background:#dde6f7}
.gpu.unusable{background:#eee;color:#777}#summary{font-size:15px}#problems li{margin:.2em 0}
table.usage-by-key{margin-top:.8em}
.state.ready{color:#176117;font-weight:600}.state.failed,.state.degraded,.state.unknown{color:#a11}
pre{white-space:pre-wrap;font-size:12px;margin:.3em 0;background:#f8f8f8;padding:.3em}
.install{color:#555;font-style:italic}
.alert{background:#fbe9e9;color:#a11;font-weight:600;padding:.4em .6em;border-radius:3px}
#live{float:right;color:#777}
ul.reasons{margin:.2em 0;padding-left:1.2em}time{color:#777}.nowrap{white-space:nowrap}
</style></head>
<body><h1>llmgw cluster <span id=live>connecting…</span></h1>
<main id=view>{view}</main>
<script>
const live = document.getElementById("live");
const source = new EventSource("page/stream");
source.addEventListener("view", (e) => {
  document.getElementById("view").innerHTML = e.data;
  live.textContent = "live " + new Date().toLocaleTimeString();
});
source.onerror = () => { live.textContent = "reconnecting…"; };
</script></body></html>
"""
