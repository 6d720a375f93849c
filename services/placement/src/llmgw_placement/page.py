"""The cluster page at `/`: a summary, the problems, nodes, deployments, replicas, the catalog,
the last day's usage and recent events, live.

Server-rendered HTML, in parts (`Frag`: an element with an id; `Keyed`: a container of such
elements in order). The page opens `/page/stream` (server-sent events): a first snapshot,
then only the parts that changed (`changes`), so an idle fleet of a thousand nodes costs an
open tab a few hundred bytes a second, not the page on every tick. Without JavaScript the
page says it is not live and reloads itself. Every text comes from the same records as
`/api/*` and `llmgw ctl`: the page computes nothing of its own.

Here: the page's routes, its event listener and the render shared by open tabs. Its
markup and diff are in `page_parts`, the event lines in `page_events`, the summary and
the nodes in `page_fleet`, the other sections in `page_sections`, the document's style
and script in `page_assets`.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import anyio
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from llmgw_core.bus import DecodeFailure
from llmgw_core.events import ReplicaRecord

from . import page_sections as sections
from .chart import demand_chart
from .page_assets import CHAT, PAGE
from .page_events import EVENT_CHARS, body_line, event_body, event_line, reason_said
from .page_fleet import EVERYTHING, Counted, Fleet, Query, counted
from .page_parts import Frag, Keyed, Part, Sent, changes, document_of, esc
from .page_sections import reasons_html

if TYPE_CHECKING:
    from .service import PlacementService
    from .usage import UsageWindow

# What tests and other parts import from here; each lives in the module named for it.
__all__ = [
    "EVENT_CHARS",
    "Counted",
    "Frag",
    "Keyed",
    "Page",
    "Part",
    "Query",
    "changes",
    "counted",
    "document_of",
    "event_line",
    "reasons_html",
]

log = logging.getLogger("llmgw.placement.page")

# How often the stream looks for a change, and how often it says it is still there.
REFRESH_S = 0.5
KEEPALIVE_S = 15.0
EVENTS_KEPT = 40
# Renders younger than this are shared by the streams of every open tab.
SHARED_S = 0.4
# The streams look again only after this many times what the last render took: rendering
# runs on the loop that hears the nodes' heartbeats, and a large fleet's page must not take
# more than a small share of it (a late loop makes placement grant every node a full timeout).
RENDER_SHARE = 20
# How long a page without JavaScript waits before it reloads itself.
NOSCRIPT_RELOAD_S = 30


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
        # The summary line and the nodes' section.
        self.fleet = Fleet(service)
        self._shared: dict[Query, tuple[float, list[Part]]] = {}
        # What the last render took (seconds).
        self.render_s = 0.0

    def heard(self, line: str) -> None:
        self._heard += 1
        self.events.append((self._heard, time.time(), line))

    async def listen(self) -> None:
        """Keep the recent events (core NATS: the page shows what happens from now on)."""
        bus = self.service.bus

        async def on_msg(subject: str, data: bytes) -> None:
            try:
                body = event_body(subject, data)
            except DecodeFailure as exc:
                await bus.dead_letter(subject, data, exc.error)
                return
            line = body_line(body, self._install_steps)
            if line:
                self.heard(line)

        try:
            await bus.listen(bus.names.events_all, on_msg)
        except Exception as exc:  # the page goes on without its events, placement goes on
            log.warning("the cluster page cannot follow the events: %s", exc)
            self.heard(f"(this placement cannot follow the events: {exc})")

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
            f"<p class=who>placement <b>{esc(service.identity)}</b> · "
            + ("leader" if service.is_leader else "standby: replicas and decisions are the leader's")
            + "</p>"
            + "".join(f"<div class=warn>{esc(w)}</div>" for w in service.warnings())
        )
        blocked = service.cannot_write()
        if blocked:
            head += f"<p class=alert id=store>{esc(blocked)}</p>"
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
            Frag("summary", self.fleet.summary(nodes, counts, statuses)),
            Frag("problems", sections.problems(replicas, statuses, nodes, counts, query)),
            *self._deployment(query, replicas, statuses),
            *self.fleet.parts(holders, nodes, counts, query),
            *sections.deployment_list(service.state.deployments, statuses, query),
            *sections.replica_list(replicas, shard_status, query),
            Frag("catalog", sections.catalog_table(self.catalog)),
            Frag("usage", sections.usage_tables(self.usage)),
            *sections.event_list(self.events),
        ]

    def _deployment(
        self, query: Query, replicas: dict[str, ReplicaRecord], statuses: dict[str, Any]
    ) -> list[Part]:
        """The deployment a tab opened (`?deployment=`): its status, its replicas and their
        reasons, and a chat box that sends one request through the gateway (see `CHAT`)."""
        name = query.deployment
        if not name:
            return []
        dep = self.service.state.deployments.get(name)
        close = f"<a class=close href='{esc(query.href(deployment=''))}'>close</a>"
        if dep is None:
            return [
                f"<section id=deployment><h2>Deployment {esc(name)}</h2>{close}"
                f"<p class=warn>no deployment {esc(name)} (the deployments are listed below)</p></section>"
            ]
        status = statuses.get(name)
        mine = [replicas[k] for k in sorted(replicas) if replicas[k].deployment == name]
        lines = "".join(
            f"<li data-replica='{esc(r.deployment)}.{esc(r.replica)}'><b>{esc(r.replica)}</b> "
            f"<span class='state {esc(r.state)}'>{esc(r.state)}</span>"
            + (f" on {esc(', '.join(sorted({k.split('.', 1)[0] for k in r.shards})))}" if r.shards else "")
            + esc(reason_said(r.state, r.reason))
            + "</li>"
            for r in mine
        )
        summary = esc(status.summary) if status else "not yet judged by a leader"
        live = (
            f"<div id=dep-live><p>profile <b>{esc(dep.profile)}</b> · {summary}</p>"
            f"<ul>{lines or '<li>no replica yet</li>'}</ul></div>"
        )
        gateway = self.service.config.http.gateway_url.rstrip("/")
        return [
            f"<section id=deployment><h2>Deployment {esc(name)}</h2>{close}",
            Frag("dep-live", live),
            Frag("dep-chart", self._chart(name, dep.replicas if dep.autoscale is None else None)),
            CHAT.replace("{gateway}", esc(gateway)).replace("{model}", esc(name))
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
