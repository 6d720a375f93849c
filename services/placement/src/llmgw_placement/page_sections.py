"""The cluster page's sections over plain data: the problems, the deployments, the replicas,
the catalog, the last day's usage, recent events, and a refusal's reasons.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llmgw_core import failures
from llmgw_core.events import Deployment, EngineLoad, ReplicaRecord, ShardStatus

from .page_events import reason_said
from .page_fleet import Counted, Query
from .page_parts import Frag, Keyed, Part, esc, when
from .view import REASON_GROUPS, reason_groups

if TYPE_CHECKING:
    from .usage import UsageWindow


def problems(
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
    items = [f"<li data-problem='{esc(node)}'>{esc(problem)}</li>" for node, problem in said[:10]]
    if len(said) > 10:
        items.append(f"<li data-problem='nodes-more'>and {len(said) - 10} more said of nodes</li>")
    for key in sorted(replicas):
        r = replicas[key]
        told = failures.failure_of(r)
        failing = r.state in ("degraded", "failed", "unknown", "unplaceable")
        if not failing and (r.state == "ready" or told is None):
            continue
        reason = reason_said(r.state, r.reason).removeprefix(": ") or failures.summary(told)
        last = told.log_tail[-1] if told is not None and told.log_tail else ""
        items.append(
            f"<li data-problem='{esc(key)}'>"
            f"<a href='{esc(query.href(deployment=r.deployment))}#deployment'>"
            f"<b>{esc(r.deployment)}/{esc(r.replica)}</b></a> "
            f"<span class='state {esc(r.state)}'>{esc(r.state)}</span>"
            + (f", {r.restarts} restarts" if r.restarts else "")
            + (f": {esc(reason)}" if reason else "")
            + (f" <code>{esc(last)}</code>" if last else "")
            + "</li>"
        )
    for name in sorted(statuses):
        status = statuses[name]
        if status.unplaceable or status.blocked:
            items.append(f"<li data-problem='{esc(name)}'>{esc(status.summary)}</li>")
    for state, words in (("lost", "lost"), ("claimed", "claimed by two machines")):
        named = [row.node for row in nodes if counts[row.node].state == state]
        if named:
            shown = ", ".join(named[:10]) + (f" and {len(named) - 10} more" if len(named) > 10 else "")
            link = query.href(state=state, node="")
            items.append(
                f"<li data-problem='nodes-{state}'><a href='{esc(link)}#nodes'>"
                f"<b>{len(named)} node{'s' if len(named) != 1 else ''} {words}</b></a>: {esc(shown)}</li>"
            )
    if not items:
        # No red bar beside "none": the bar's colour says what the count says.
        return "<section id=problems class=none><h2>Problems (0)</h2><p>none</p></section>"
    return (
        f"<section id=problems class=some><h2>Problems ({len(items)})</h2><ul>"
        + "".join(items)
        + "</ul></section>"
    )


def deployment_list(
    deployments: Mapping[str, Deployment], statuses: dict[str, Any], query: Query
) -> list[Part]:
    rows = []
    for name, dep in sorted(deployments.items()):
        status = statuses.get(name)
        # An autoscaled deployment's count is the one placement chose (`desired`), in its bounds.
        bounds = f" ({dep.autoscale.min_replicas}-{dep.autoscale.max_replicas})" if dep.autoscale else ""
        ready = (f"{status.ready} / {status.desired}" if status else f"? / {dep.replicas}") + bounds
        summary = esc(status.summary) if status else "not yet judged by a leader"
        reasons = reasons_html(name, [(r.node, r.reason) for r in status.reasons]) if status else ""
        rows.append(
            Frag(
                f"d-{name}",
                f"<tr id='d-{esc(name)}' data-deployment='{esc(name)}'>"
                f"<td><a href='{esc(query.href(deployment=name))}#deployment'>{esc(name)}</a></td>"
                f"<td>{esc(dep.profile)}</td><td class=ready>{ready}</td><td>{summary}{reasons}</td></tr>",
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


def replica_list(
    replicas: dict[str, ReplicaRecord], shard_status: dict[str, ShardStatus], query: Query
) -> list[Part]:
    rows = []
    for key in sorted(replicas):
        r = replicas[key]
        nodes = ", ".join(sorted({k.split(".", 1)[0] for k in r.shards}))
        since = when(r.since) if r.since else ""
        # The failure's own lines, unless the reason already quotes them whole (as a
        # placement that predates the failure's fields wrote it).
        told = failures.failure_of(r)
        said = failures.text(told)
        shown = said and said.replace("\n", " ") not in r.reason.replace("\n", " ")
        details = failures.details(told) if told is not None else ""
        failure = f"<pre>{esc(f'{details}:' + chr(10) if details else '')}{esc(said)}</pre>" if shown else ""
        loads = [s.load for k in r.shards if (s := shard_status.get(k)) is not None and s.load is not None]
        load = EngineLoad.combined(loads)
        rows.append(
            Frag(
                f"r-{key}",
                f"<tr id='r-{esc(key)}' data-replica='{esc(key)}'>"
                f"<td>{esc(r.deployment)}/{esc(r.replica)}</td>"
                f"<td class='state {esc(r.state)}'>{esc(r.state)}</td><td>{esc(nodes)}</td>"
                f"<td class=nowrap>{since}</td>"
                f"<td>{r.restarts}</td><td>{esc(load.summary) if load else '-'}</td>"
                f"<td>{esc(r.reason)}{failure}</td></tr>",
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


def catalog_table(catalog: Callable[[], list[Any]] | None) -> str:
    """The profiles, as `/api/catalog` lists them."""
    if catalog is None:
        return ""
    rows = []
    for p in catalog():
        parallel = f"tp {p.tp} × pp {p.pp}" if p.pp > 1 else f"tp {p.tp}"
        if p.gpu_class:
            size = f"{p.gpus} GPU{'s' if p.gpus != 1 else ''}"
            if p.nodes > 1:
                size += f" ({p.gpus_per_node} on each of {p.nodes} nodes)"
        else:
            # A profile with no GPU class asks for no GPU (docs/engines.md): it runs on CPUs.
            size = "CPU" + (f" (on each of {p.nodes} nodes)" if p.nodes > 1 else "")
        source = p.model or p.model_path
        held = f"<small>staged on {esc(', '.join(p.weights_on))}</small>" if p.weights_on else ""
        rows.append(
            f"<tr data-profile='{esc(p.name)}'><td>{esc(p.name)}</td><td class=engine>{esc(p.engine)}</td>"
            f"<td class=class>{esc(p.gpu_class or 'CPU')}</td>"
            f"<td class=size>{esc(size)}, {esc(parallel)}</td>"
            f"<td class=model>{esc(source)}{held}</td><td>{esc(', '.join(p.deployments)) or '—'}</td></tr>"
        )
    return (
        f"<section id=catalog><h2>Catalog ({len(rows)})</h2><div class=wide><table>"
        "<tr><th>profile</th><th>engine</th><th>GPU class</th><th>size</th><th>model</th>"
        "<th>deployments</th></tr>" + "".join(rows) + "</table></div></section>"
    )


def usage_tables(usage: UsageWindow | None) -> str:
    """The last day's tokens per deployment and per key, as `/api/usage` sums them."""
    if usage is None:
        return ""
    error = f"<p class=warn>{esc(usage.error)}</p>" if usage.error else ""
    tables = []
    for by, what in (("deployment", "deployment"), ("key", "key")):
        rows = "".join(
            f"<tr data-usage-{by}='{esc(getattr(r, by))}'><td>{esc(getattr(r, by))}</td>"
            f"<td class=requests>{r.requests}</td><td class=prompt>{r.prompt_tokens}</td>"
            f"<td class=completion>{r.completion_tokens}</td></tr>"
            for r in usage.rows(by)
        )
        tables.append(
            f"<div class=wide><table class=usage-by-{by}><tr><th>{what}</th><th>requests</th>"
            "<th>prompt tokens</th><th>completion tokens</th></tr>"
            + (rows or "<tr><td colspan=4>none in the last 24 h</td></tr>")
            + "</table></div>"
        )
    return f"<section id=usage><h2>Usage, last 24 h</h2>{error}" + "".join(tables) + "</section>"


def event_list(events: Sequence[tuple[int, float, str]]) -> list[Part]:
    items = [
        Frag(
            f"e-{n}",
            f"<li id=e-{n}><time>{time.strftime('%H:%M:%S', time.localtime(at))}</time> {esc(line)}</li>",
        )
        for n, at, line in reversed(events)
    ] or [Frag("e-0", "<li id=e-0>none yet</li>")]
    return [
        "<section id=events><h2>Recent events</h2>",
        Keyed("event-list", "<ul id=event-list>", items, "</ul>"),
        "</section>",
    ]


def reasons_html(deployment: str, reasons: Sequence[tuple[str, str]]) -> str:
    """A refusal's reasons under its deployment: every node's when a few, else grouped by
    reason with how many nodes and a few of their names (`view.reason_groups`), so that a
    refusal by 1,000 nodes is a few lines, not 1,000. Every node's reason is one link away."""
    if not reasons:
        return ""
    if len(reasons) <= REASON_GROUPS:
        items = [f"<li><b>{esc(node)}</b>: {esc(reason)}</li>" for node, reason in reasons]
    else:
        top, other, on = reason_groups(reasons)
        items = [
            f"<li data-reason-count={g.nodes}><b>{g.nodes} nodes</b>: {esc(g.reason)} <small>"
            f"({esc(', '.join(g.examples))}{', …' if g.nodes > len(g.examples) else ''})</small></li>"
            for g in top
        ]
        if other:
            items.append(f"<li>and {other} other reasons on {on} nodes</li>")
        link = "api/explain/" + esc(deployment)
        items.append(f"<li><a href='{link}'>every node's reason</a></li>")
    return "<ul class=reasons>" + "".join(items) + "</ul>"
