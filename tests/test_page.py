"""The cluster page in a real browser: Debian's Chromium driven by Playwright, against a real cluster.

The page is opened once, before there is anything to show; every change after
that (a node, a deployment going ready, a refusal, a crash) must appear
without a reload.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import Demand, Deployment, DeploymentDemand
from llmgw_placement.chart import demand_chart
from tests.cluster_support import cluster, sim_catalog
from tests.test_gateway import running_gateway
from tests.test_gateway_keys import PROMPT_TOKENS, ctl_json, new_key
from tests.test_gateway_keys import chat as ask
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

CHROMIUM = os.environ.get("LLMGW_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Chromium on a machine with no network of its own: nothing in the background.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

CRASHES = sim_catalog("--load-time", "30", "--exit-after", "0.3", "--exit-code", "42", name="crashes")
A100 = {**sim_catalog(name="a100"), "gpu_class": "A100-80G"}


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt install chromium)")
async def test_the_cluster_page_follows_the_cluster_live(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect

    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("p1", [sim_catalog(), CRASHES, A100], [])
        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        base = api.group(1)
        token = c.auth.api_read_token_file.read_text().strip() if c.auth is not None else ""
        async with httpx.AsyncClient(base_url=base, timeout=10) as client:
            # Without a token the page is refused; the read token opens it and is kept in a cookie.
            assert (await client.get("/")).status_code == 401
            assert (await client.get("/page/stream")).status_code == 401
        async with async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            try:
                page = await browser.new_page(viewport={"width": 1366, "height": 900})
                await page.goto(f"{base}/?token={token}")
                assert page.url == f"{base}/", "the token stays out of the address bar"
                await expect(page.locator("#nodes h2")).to_have_text("Nodes (0)")
                summary = page.locator("#summary")
                await expect(summary.locator("[data-count='alive']")).to_have_text("0")
                await expect(page.locator("#problems h2")).to_have_text("Problems (0)")
                await page.evaluate("window.llmgwNotReloaded = true")

                # A node appears, alive, with its GPUs and its engine.
                c.start_node("node-1", gpus=2)
                row = page.locator("tr[data-node='node-1']")
                await expect(row).to_contain_text("alive", timeout=60_000)
                await expect(row.locator(".gpu")).to_have_count(2)
                await expect(row).to_contain_text("sim")

                # A deployment goes ready, and its GPU shows who holds it.
                await bus.put(bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tiny"))
                chat = page.locator("tr[data-deployment='chat']")
                await expect(chat.locator(".ready")).to_have_text("1 / 1", timeout=60_000)
                await expect(page.locator("tr[data-replica='chat.r0'] .state")).to_have_text("ready")
                await expect(row.locator(".gpu.held")).to_contain_text("chat/r0")
                await expect(summary).to_contain_text(
                    "nodes 1 alive, 0 lost, 0 cordoned · GPUs 1 held, 1 free, 0 unusable"
                )
                await expect(summary).to_contain_text("deployments 1 ready")

                # The catalog: each profile's engine, GPU class and size, and who runs it.
                tiny = page.locator("tr[data-profile='tiny']")
                await expect(tiny.locator(".engine")).to_have_text("sim")
                await expect(tiny.locator(".class")).to_have_text("H100-80G")
                await expect(tiny.locator(".size")).to_have_text("1 GPU, tp 1")
                await expect(tiny).to_contain_text("chat")
                await expect(page.locator("tr[data-profile='a100'] .class")).to_have_text("A100-80G")
                async with httpx.AsyncClient(base_url=base, timeout=10, headers=c.api_headers) as client:
                    listed = (await client.get("/api/catalog")).json()
                assert [p["name"] for p in listed] == ["a100", "crashes", "tiny"]
                assert {k: listed[2][k] for k in ("engine", "gpu_class", "tp", "gpus", "deployments")} == {
                    "engine": "sim",
                    "gpu_class": "H100-80G",
                    "tp": 1,
                    "gpus": 1,
                    "deployments": ["chat"],
                }

                # Usage: two requests through a gateway with a key, counted on the page and
                # in `/api/usage` as `ctl usage` sums them.
                await expect(page.locator("#usage")).to_contain_text("none in the last 24 h")
                secret = new_key(c, "team")
                async with running_gateway(c, require_api_key=True) as (gateway, _):
                    # The replica was ready before this gateway started: its first answer is the
                    # replica's (a gateway that knew no replica yet would send nothing to count).
                    await eventually(lambda: ask(gateway, secret), timeout=30, interval=0.3)
                    await ask(gateway, secret)
                used = page.locator("tr[data-usage-deployment='chat']")
                await expect(used.locator(".requests")).to_have_text("2", timeout=30_000)
                await expect(used.locator(".prompt")).to_have_text(str(2 * PROMPT_TOKENS))
                await expect(used.locator(".completion")).to_have_text("10")
                await expect(page.locator("tr[data-usage-key='team'] .requests")).to_have_text("2")
                async with httpx.AsyncClient(base_url=base, timeout=10, headers=c.api_headers) as client:
                    served = (await client.get("/api/usage")).json()
                    by_key = (await client.get("/api/usage?by=key")).json()
                    wrong = await client.get("/api/usage?by=model")
                assert (
                    served
                    == ctl_json(c, "usage")
                    == [
                        {
                            "key": "team",
                            "deployment": "chat",
                            "prompt_tokens": 2 * PROMPT_TOKENS,
                            "completion_tokens": 10,
                            "requests": 2,
                        }
                    ]
                )
                assert by_key == ctl_json(c, "usage", "--by", "key")
                assert wrong.status_code == 400
                assert "sum by key or by deployment" in wrong.json()["error"]

                # A refusal in the node's own words.
                await bus.put(bus.names.deployments_bucket, "big", Deployment(name="big", profile="a100"))
                big = page.locator("tr[data-deployment='big']")
                await expect(big).to_contain_text(
                    "node-1: GPU class H100-80G, profile needs A100-80G", timeout=30_000
                )
                await expect(big).to_contain_text("1 cannot be placed")
                await expect(summary.locator("[data-count='unplaceable']")).to_have_text("1")
                await expect(page.locator("#problems [data-problem='big']")).to_contain_text(
                    "1 cannot be placed"
                )

                # A crashing replica shows its exit code.
                await bus.put(
                    bus.names.deployments_bucket, "crashes", Deployment(name="crashes", profile="crashes")
                )
                crash = page.locator("tr[data-replica='crashes.r0']")
                await expect(crash).to_contain_text("exited with code 42", timeout=60_000)
                await expect(page.locator("#events")).to_contain_text("crashes")
                # ... and, first, among the problems, above the nodes.
                problem = page.locator("#problems [data-problem='crashes.r0']")
                await expect(problem).to_contain_text("crashes/r0")
                await expect(problem).to_contain_text("exited with code 42")

                async def problems_above_nodes() -> bool:
                    # Read again while the stream replaces a section (no box for that moment).
                    above = await page.locator("#problems").bounding_box()
                    nodes = await page.locator("#nodes").bounding_box()
                    assert above is not None
                    assert nodes is not None
                    assert above["y"] < nodes["y"], (above, nodes)
                    return True

                await eventually(problems_above_nodes, timeout=10, interval=0.2)

                # A lost node's GPUs are never free.
                c.kill_node("node-1")
                await expect(row).to_contain_text("lost", timeout=30_000)
                await expect(summary.locator("[data-count='lost']")).to_have_text("1")
                await expect(summary.locator("[data-count='free']")).to_have_text("0")
                await expect(summary.locator("[data-count='unusable']")).to_have_text("2")
                await expect(row.locator(".gpu.free")).to_have_count(0)

                assert await page.evaluate("window.llmgwNotReloaded") is True, "the page was reloaded"
                shot = tmp_path / "cluster-page.png"
                await page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                print(f"cluster page screenshot: {shot}")
            finally:
                await browser.close()


def test_the_stream_sends_the_view_first_then_only_what_changed() -> None:
    import msgspec

    from llmgw_placement.page import Frag, Keyed, Part, changes

    def parts(summary: str, cells: list[tuple[str, str]], extra: bool = False) -> list[Part]:
        return [
            "<main>",
            Frag("summary", f"<p id=summary>{summary}</p>"),
            Keyed(
                "grid", "<div id=grid>", [Frag(i, f"<a id={i} class={c}></a>") for i, c in cells], "</div>"
            ),
            *(["<p>more</p>"] if extra else []),
            "</main>",
        ]

    cells = [(f"c-{i}", "free") for i in range(1000)]
    sent, first = changes(None, parts("1000 alive", cells))
    assert first is not None
    assert first.startswith(b"event: view\ndata: <main><p id=summary>1000 alive</p><div id=grid>")
    # Nothing changed: nothing sent.
    sent, nothing = changes(sent, parts("1000 alive", cells))
    assert nothing is None
    # One node lost: its cell and the summary, nothing else.
    lost = [*cells[:7], ("c-7", "lost"), *cells[8:]]
    sent, patch = changes(sent, parts("999 alive", lost))
    assert patch is not None
    assert patch.startswith(b"event: patch\ndata: ")
    assert patch.endswith(b"\n\n")
    body = msgspec.json.decode(patch.split(b"data: ", 1)[1])
    assert body == {
        "set": {"summary": "<p id=summary>999 alive</p>", "c-7": "<a id=c-7 class=lost></a>"},
        "order": {},
    }
    # A node added: the container's new order and the new cell only.
    added = [*lost, ("c-new", "free")]
    sent, patch = changes(sent, parts("999 alive", added))
    assert patch is not None
    body = msgspec.json.decode(patch.split(b"data: ", 1)[1])
    assert body["set"] == {"c-new": "<a id=c-new class=free></a>"}
    assert body["order"] == {"grid": [i for i, _ in added]}
    # A section came: the whole view again.
    sent, whole = changes(sent, parts("999 alive", added, extra=True))
    assert whole is not None
    assert whole.startswith(b"event: view\n")
    assert b"<p>more</p>" in whole


def test_lost_claimed_and_cordoned_nodes_have_no_free_gpu() -> None:
    from llmgw_core.engines import GPUInfo
    from llmgw_placement.api import NodeRow
    from llmgw_placement.page import Counted, counted

    gpus = tuple(GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", memory_mb=81559) for i in range(4))

    def row(**more: object) -> NodeRow:
        fields = {
            "alive": True,
            "seen_s_ago": 0.5,
            "engines": (),
            "install": "",
            "warnings": (),
            "probed_at": 0.0,
        }
        return NodeRow(node="n1", gpus=gpus, **{**fields, **more})  # type: ignore[arg-type]

    held = {("n1", 0): "chat/r0"}
    assert counted(row(), held) == Counted("held", 1, 3, 0)
    assert counted(row(), {}) == Counted("free", 0, 4, 0)
    assert counted(row(alive=False, seen_s_ago=30.0), held) == Counted("lost", 0, 0, 4)
    assert counted(row(claimed="n1 is claimed by two machines"), held) == Counted("claimed", 0, 0, 4)
    assert counted(row(intent="cordoned by ops at …"), held) == Counted("cordoned", 1, 0, 3)


def test_an_installs_progress_within_a_step_is_not_an_event_but_its_steps_and_end_are() -> None:
    """Regression: every progress report of a download was a line in the page's event list,
    and pushed a failure out of sight within seconds."""
    from llmgw_core.events import InstallProgress, encode
    from llmgw_placement.page import event_line

    steps: dict[tuple[str, str], str] = {}

    def line(step: str, message: str, outcome: str = "running", node: str = "n1") -> str | None:
        report = InstallProgress(node=node, engine="llamacpp", step=step, message=message, outcome=outcome)  # type: ignore[arg-type]
        return event_line(f"x.events.node.{node}.install", encode(report), steps)

    assert line("download", "downloading b1 (1%)") == "n1: downloading b1 (1%)"
    assert line("download", "downloading b1 (38%)") is None
    assert line("download", "downloading b1 (92%)") is None
    # Another node's install is its own.
    assert line("download", "downloading b1 (5%)", node="n2") == "n2: downloading b1 (5%)"
    assert line("verify", "verifying sha256") == "n1: verifying sha256"
    assert line("verify", "installed b1", outcome="done") == "n1: installed b1"
    # A new install after the end starts over.
    assert line("download", "downloading b2 (1%)") == "n1: downloading b2 (1%)"
    assert line("download", "downloading b2 (2%)", outcome="failed") == "n1: downloading b2 (2%)"
    # Without `steps` (a caller that keeps none) every report is a line.
    assert event_line("x", encode(InstallProgress(node="n1", engine="e", step="s", message="m"))) == "n1: m"


async def test_a_deployments_view_charts_its_demand_and_replicas_and_streams_their_change(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """`?deployment=chat`: an inline SVG of the demand the gateways report and the count placement
    chose, sent again through the page's stream as a patch of that part when a demand is heard."""
    chat = {
        "name": "chat",
        "profile": "tiny",
        "autoscale": {"min_replicas": 0, "max_replicas": 3, "target_in_flight": 2},
    }
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("p1", [sim_catalog()], [chat])
        api = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        async with (
            httpx.AsyncClient(base_url=api.group(1), headers=c.api_headers, timeout=60) as client,
            anyio.create_task_group() as tg,
        ):

            async def led() -> bool:
                # The leader has chosen its count (0: nothing asked for it).
                r = await client.get("/api/explain/chat")
                assert r.status_code == 200, r.text
                assert r.json()["autoscale"]["count"] == 0, r.json()
                return True

            await eventually(led, timeout=30, interval=0.2)
            async with client.stream("GET", "/page/stream?deployment=chat") as stream:
                assert stream.status_code == 200
                chunks = stream.aiter_raw()
                wire = b""

                async def message() -> bytes:
                    nonlocal wire
                    while b"\n\n" not in wire:
                        wire += await chunks.__anext__()
                    one, _, wire = wire.partition(b"\n\n")
                    return one

                first = await message()
                assert first.startswith(b"event: view\n"), first[:200]
                assert b"<figure id=dep-chart data-demand='0' data-replicas='0'><svg " in first, first
                assert b"demand now 0, at most 0 in the last 5 min" in first

                async def report() -> None:
                    # 5 requests held by a gateway (there is no node: no replica gets ready).
                    while True:
                        demand = Demand(
                            gateway="gw-test",
                            deployments=(DeploymentDemand(deployment="chat", queued=5),),
                            interval_s=0.3,
                        )
                        await bus.publish_core(bus.names.demand("gw-test"), demand)
                        await anyio.sleep(0.3)

                tg.start_soon(report)
                with anyio.fail_after(60):
                    while True:
                        m = await message()
                        if not m.startswith(b"event: patch\n"):
                            continue
                        sent = msgspec.json.decode(m.split(b"data: ", 1)[1])["set"]
                        chart = sent.get("dep-chart", "")
                        if "data-replicas='3'" in chart:
                            break
                tg.cancel_scope.cancel()
        # The chart as sent: demand 5 now, the count chosen (5 at 2 each: 3), both drawn.
        assert chart.startswith("<figure id=dep-chart data-demand='5' data-replicas='3'><svg "), chart
        assert "demand now 5, at most 5 in the last 5 min" in chart
        assert "replicas 3, at most 3" in chart
        assert "<polyline class=demand points='" in chart
        assert "<polyline class=replicas points='" in chart
        # The highest point of the demand's line is the top of the chart (5 of a scale to 5).
        demand_line = re.search(r"<polyline class=demand points='([^']+)'", chart)
        assert demand_line
        ys = [float(p.split(",")[1]) for p in demand_line.group(1).split()]
        assert min(ys) == 1.0, ys


def test_the_chart_changes_only_when_a_bucket_ends_or_what_it_holds_changes() -> None:
    """Buckets aligned on the clock: two looks within one bucket render the same chart (the
    stream sends nothing), the next bucket shifts it; a burst shorter than a bucket still shows."""
    demand = [(0.0, 0.0), (100.0, 4.0), (100.5, 0.0)]
    counts = [(0.0, 1.0)]
    assert demand_chart(demand, counts, 101.0) == demand_chart(demand, counts, 104.0)
    assert demand_chart(demand, counts, 106.0) != demand_chart(demand, counts, 104.0)
    shown = demand_chart(demand, counts, 104.0)
    assert "demand now 0, at most 4 in the last 5 min" in shown
    assert "replicas 1, at most 1" in shown
