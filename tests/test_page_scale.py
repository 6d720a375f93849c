"""The cluster page at 1,000 nodes, rendered from placement's own state (an in-process
PlacementService fed plain records, its page and API as the service builds them): its event
list and its height bounded, and what it counts counted one way."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.bus import Bus
from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.events import (
    InstallProgress,
    NodeFacts,
    NodeIntent,
    NodeReason,
    NodeStatus,
    PlacementDecision,
    encode,
)
from llmgw_placement import PlacementService
from llmgw_placement.api import Api
from llmgw_placement.page import EVENT_CHARS, Page, document_of, event_line, reasons_html
from tests.control_support import dlq, server_config
from tests.test_page import CHROMIUM, FLAGS
from tests.waiting import eventually

NODES = 1000
GPUS = 8
LOST = ("sim-00100", "sim-00200")
# Cordoned: one alive, and one of the lost (lost first: counted lost, not also cordoned).
CORDONED = ("sim-00007", "sim-00200")
JOINED = "sim-01000"
FUZZ = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def fleet_refusal(nodes: int) -> tuple[NodeReason, ...]:
    return tuple(
        NodeReason(
            node=f"sim-{i:05d}",
            reason="lost: no heartbeat since 2026-12-07 04:00:00 UTC"
            if f"sim-{i:05d}" in LOST
            else f"{GPUS} of {GPUS} GPUs held, profile needs 1 more",
        )
        for i in range(nodes)
    )


@dataclass
class Rendered:
    service: PlacementService
    page: Page


@pytest.fixture
async def rendered(bus: Bus, nats_url: str, prefix: str) -> Rendered:
    """A placement that has run for 100 s and heard 1,000 nodes (two of them lost), one node
    that joined a second ago and has not beaten yet, two cordons, a CPU profile and a GPU one,
    and 40 refusals of a deployment by every node."""
    # A node timeout long enough that no beating node goes stale while a busy machine builds
    # and lays out the page (at the tests' 2 s, a slow fixture made all 1,000 stale).
    config = server_config(nats_url, prefix, http={"insecure": True}, node_timeout_s=60.0)
    service = PlacementService(config, bus)
    state = service.state
    now = time.monotonic()
    state.heard_from = now - 100.0
    gpus = tuple(GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", memory_mb=81559) for i in range(GPUS))
    for i in range(NODES + 1):
        node = f"sim-{i:05d}"
        state.nodes[node] = NodeStatus(node=node, facts=NodeFacts(node=node, gpus=gpus, arch="x86_64"))
        state.first_known[node] = now - (1.0 if node == JOINED else 100.0)
        if node != JOINED:
            state.last_seen[node] = now - (90.0 if node in LOST else 0.2)
    for node in CORDONED:
        state.intents[node] = NodeIntent(node=node, by="ops", at=time.time(), reason="disk swap")
    state.catalog["small"] = Profile(name="small", engine="llamacpp", model_path="/models/small.gguf")
    state.catalog["big"] = Profile(name="big", engine="sim", model_path="sim://x", gpu_class="H100-80G", tp=2)
    api = Api(service)
    page = Page(service, api.nodes, catalog=api.catalog)
    for r in range(40):
        decision = PlacementDecision(
            deployment="chat", replica=f"r{r}", outcome="refused", reasons=fleet_refusal(NODES)
        )
        line = event_line("x.events.placement.chat", encode(decision))
        assert line is not None
        page.heard(line)
    return Rendered(service, page)


def _count(html: str, what: str) -> int:
    found = re.search(rf"<b data-count='{what}'[^>]*>(\d+)</b>", html)
    assert found is not None, what
    return int(found.group(1))


def _legend(html: str, state: str) -> int:
    found = re.search(rf"data-legend={state} [^>]*><i class='c {state}'></i> <b>(\d+)</b>", html)
    assert found is not None, state
    return int(found.group(1))


@pytest.mark.anyio
async def test_a_refusal_by_1000_nodes_is_one_short_event_grouped_by_reason(rendered: Rendered) -> None:
    """Regression: one "cannot place" event listed every node's reason, and 40 of them made the
    page tens of thousands of pixels tall at 500 nodes."""
    parts = rendered.page.parts()
    html = document_of(parts)
    events = html.split("<ul id=event-list>", 1)[1].split("</ul>", 1)[0]
    items = re.findall(r"<li id=e-\d+>(.*?)</li>", events)
    assert len(items) == 40
    for item in items:
        text = re.sub(r"<[^>]+>", "", item)
        assert len(text) <= EVENT_CHARS + 20, len(text)
    assert items[0].endswith(
        "cannot place chat: on 1000 nodes: 998 x 8 of 8 GPUs held, profile needs 1 more "
        "(sim-00000, sim-00001, sim-00002, …); 2 x lost: no heartbeat since 2026-12-07 04:00:00 UTC "
        "(sim-00100, sim-00200)"
    ), items[0]
    # The whole page: the grid's thousand cells, and no part that grows with the nodes besides.
    assert len(html) < 300_000, len(html)


@pytest.mark.anyio
async def test_what_the_page_counts_it_counts_one_way(rendered: Rendered) -> None:
    """Nodes: the summary's first part, the legend and the groups' table count nodes, each by
    the one state `counted` gives it (a lost node that was cordoned is lost, not also
    cordoned); the summary's GPUs say GPUs. A node that joined a second ago is not lost. A
    CPU profile reads as CPU."""
    html = rendered.page.view()
    assert _count(html, "lost") == _legend(html, "lost") == len(LOST)
    assert _count(html, "cordoned") == _legend(html, "cordoned") == 1
    group = re.search(r"<td class=lost>(\d+)</td><td class=cordoned>(\d+)</td>", html)
    assert group is not None
    assert group.groups() == (str(len(LOST)), "1")
    alive = sum(_legend(html, s) for s in ("held", "free", "cordoned"))
    assert _count(html, "alive") == alive == NODES + 1 - len(LOST)
    assert "<p id=legend>nodes: " in html
    assert re.search(r"GPUs <b data-count='held'", html)
    # Just joined, no heartbeat yet: alive, not lost, and no problem said of it.
    assert f"id='c-{JOINED}' class='c free'" in html
    problems = html.split("<section id=problems", 1)[1].split("</section>", 1)[0]
    assert JOINED not in problems
    assert "2 nodes lost</b></a>: sim-00100, sim-00200" in problems
    # The bar's colour goes with the count: problems here, so the red bar.
    assert problems.startswith(" class=some><h2>Problems (1)</h2>"), problems[:80]
    catalog = html.split("<section id=catalog>", 1)[1].split("</section>", 1)[0]
    small = re.search(r"<tr data-profile='small'>.*?</tr>", catalog)
    assert small is not None
    assert "<td class=class>CPU</td><td class=size>CPU, tp 1</td>" in small.group(0), small.group(0)
    assert "1 GPU" not in small.group(0)
    big = re.search(r"<tr data-profile='big'>.*?</tr>", catalog)
    assert big is not None
    assert "<td class=size>2 GPUs, tp 2</td>" in big.group(0), big.group(0)


@pytest.mark.anyio
async def test_no_problem_is_no_red_bar(rendered: Rendered) -> None:
    """Regression: "Problems (0) none" beside the red bar that marks problems."""
    state = rendered.service.state
    now = time.monotonic()
    for node in LOST:
        state.last_seen[node] = now
    state.intents.clear()
    html = rendered.page.view()
    problems = html.split("<section id=problems", 1)[1].split("</section>", 1)[0]
    assert problems == " class=none><h2>Problems (0)</h2><p>none</p>", problems
    assert "#problems.none{border-left-color:#176117}" in rendered.page.document()


def test_a_deployments_refusal_lists_reasons_not_nodes() -> None:
    reasons = [(r.node, r.reason) for r in fleet_refusal(NODES)]
    html = reasons_html("chat", reasons)
    assert html.count("<li") == 3, html
    assert html.startswith(
        "<ul class=reasons><li data-reason-count=998><b>998 nodes</b>: 8 of 8 GPUs held, profile needs "
        "1 more <small>(sim-00000, sim-00001, sim-00002, …)</small></li>"
    ), html
    assert "<a href='api/explain/chat'>every node's reason</a>" in html
    # A few nodes: each with its own reason, as before.
    few = reasons_html("chat", reasons[:2])
    assert few == (
        "<ul class=reasons><li><b>sim-00000</b>: 8 of 8 GPUs held, profile needs 1 more</li>"
        "<li><b>sim-00001</b>: 8 of 8 GPUs held, profile needs 1 more</li></ul>"
    )


@pytest.mark.anyio
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt install chromium)")
async def test_the_page_of_1000_nodes_is_a_few_screens_tall_in_a_browser(rendered: Rendered) -> None:
    """The page as Chromium lays it out, at a desktop's width and a phone's: a few screens, not
    the 40,000 to 61,000 px that 40 refusals by every node made it at 500 nodes."""
    from playwright.async_api import ViewportSize, async_playwright

    document = rendered.page.document()
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            heights = {}
            for screen, viewport, most in (
                ("desktop", ViewportSize(width=1400, height=900), 6_000),
                ("phone", ViewportSize(width=390, height=844), 15_000),
            ):
                page = await browser.new_page(viewport=viewport)
                # The page as served, without its stream (nothing to connect to here).
                await page.route("**/page/stream*", lambda route: route.abort())
                await page.set_content(document)
                heights[screen] = await page.evaluate("document.documentElement.scrollHeight")
                sections = await page.evaluate(
                    "[...document.querySelectorAll('main > *')].map(e => `${e.id}: ${e.offsetHeight}`)"
                )
                assert heights[screen] <= most, (screen, heights[screen], viewport, sections)
                await page.close()
            print(f"the page of {NODES + 1} nodes and 40 refusals is {heights} px tall")
        finally:
            await browser.close()


# --- hostile bytes: the events the page hears ------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6),
    max_leaves=30,
)
KINDS = [
    "ReplicaStatus",
    "ShardStatus",
    "PlacementDecision",
    "DeploymentStatus",
    "ScaleDecision",
    "InstallProgress",
    "NodeLifecycle",
    "Other",
]
FIELDS = [
    "deployment",
    "replica",
    "state",
    "reason",
    "node",
    "shard",
    "outcome",
    "nodes",
    "reasons",
    "summary",
    "engine",
    "step",
    "message",
]


def _said_in_bounds(line: str | None) -> None:
    assert line is None or (isinstance(line, str) and len(line) <= EVENT_CHARS + 1), line


@FUZZ
@given(st.binary(max_size=4096))
def test_event_line_takes_any_bytes(data: bytes) -> None:
    """Any bytes on an event subject (a node's identity may publish its own events): a line of
    at most EVENT_CHARS, or None; never an exception out of the page's subscription."""
    _said_in_bounds(event_line("x.events.any", data, {}))


@FUZZ
@given(
    st.sampled_from(KINDS),
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=8),
    st.lists(st.tuples(st.text(max_size=70), st.text(max_size=400)), max_size=60),
)
def test_event_line_takes_any_event_shaped_json(
    kind: str, fields: dict[str, object], reasons: list[tuple[str, str]]
) -> None:
    body: dict[str, object] = {"kind": kind, **fields}
    if kind == "PlacementDecision" and "reasons" not in fields:
        body["reasons"] = [{"node": n, "reason": r} for n, r in reasons]
    _said_in_bounds(event_line("x.events.any", msgspec.json.encode(body), {}))


def test_a_refusal_by_100000_nodes_is_grouped_in_bounded_time_and_text() -> None:
    reasons = [{"node": f"n{i}", "reason": f"reason {i % 1000}"} for i in range(100_000)]
    data = msgspec.json.encode(
        {"kind": "PlacementDecision", "deployment": "d", "outcome": "refused", "reasons": reasons}
    )
    started = time.monotonic()
    line = event_line("x", data)
    assert line is not None
    assert len(line) <= EVENT_CHARS + 1
    assert line.startswith("cannot place d: on 100000 nodes: 100 x reason 0 (n0, n1000, n2000, …); "), line
    assert time.monotonic() - started < 2.0


def test_a_node_just_joined_gets_a_full_timeout_for_its_first_heartbeat() -> None:
    """Regression: 500 nodes joining a placement that had run for a while were each `lost: no
    heartbeat since this placement started` until their first beat came; a node that never
    beats is lost once a full node_timeout has passed since its status was first read."""
    from llmgw_placement.config import ServerConfig
    from llmgw_placement.liveness import Liveness
    from llmgw_placement.state import ClusterState

    config = msgspec.convert({"node_timeout_s": 2.0, "http": {"insecure": True}}, ServerConfig)
    state = ClusterState.empty()
    state.heard_from = 0.0
    for node in ("joined", "silent", "beating"):
        state.nodes[node] = NodeStatus(node=node, facts=NodeFacts(node=node))
    state.first_known |= {"joined": 99.0, "silent": 50.0, "beating": 10.0}
    state.last_seen["beating"] = 99.5
    judge = Liveness(config, state)
    at = 100.0
    assert [judge.alive(n, at)[0] for n in ("joined", "silent", "beating")] == [True, False, True]
    assert judge.alive_nodes(at) == {"joined", "beating"}
    # Past a full timeout from when it was first read, a node never heard is lost.
    assert judge.alive_nodes(101.2) == {"beating"}
    assert not judge.alive("joined", 101.2)[0]


@pytest.mark.anyio
async def test_bytes_on_an_event_subject_that_are_no_event_are_dead_lettered_by_the_page(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """A node's identity may publish its own events: bytes that are no event are counted and
    copied to placement's DLQ with msgspec's words, never dropped unsaid; the events after
    them are still shown."""
    service = PlacementService(server_config(nats_url, prefix, http={"insecure": True}), bus)
    api = Api(service)
    page = Page(service, api.nodes, catalog=api.catalog)
    subject = bus.names.node_install("n1")
    async with anyio.create_task_group() as tg:
        tg.start_soon(page.listen)
        good = InstallProgress(node="n1", engine="e", step="s", message="fetched")

        async def shown() -> bool:
            await bus.publish_core(subject, good)
            return any(line.endswith("n1: fetched") for _, _, line in page.events)

        await eventually(shown, timeout=10, interval=0.2)
        for data in (b"\xff not json", b"[1, 2]"):
            await bus.nc.publish(subject, data)
        await eventually(lambda: bus.decode_errors[subject] == 2, timeout=10)
        tg.cancel_scope.cancel()
    letters = await dlq(bus, bus.conn.service)
    assert [m.data for m in letters] == [b"\xff not json", b"[1, 2]"]
    assert letters[1].headers is not None
    assert letters[1].headers["Llmgw-Error"] == "an event is a JSON object, not a list"
