"""The cluster page at fleet scale, in Debian's Chromium driven by Playwright: 1,000 simulated
nodes (`llmgw fleet --nodes 1000`), two lost, one cordoned, and one replica failing on a real
node, as an operator meets them on the first screen of a desktop and of a phone.

One fleet for the module (it is expensive): placement, a gateway, a real node and the two
fleets are started once and shared by every test here.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from tests.cluster_support import Cluster, sim_catalog
from tests.test_gateway_keys import new_key
from tests.test_page import CHROMIUM, CRASHES, FLAGS
from tests.waiting import eventually

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(), reason=f"no Chromium at {CHROMIUM} (apt install chromium)"
    ),
]

LLMGW = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())"]
NODES = 1000
GPUS = 8
# The ceiling on what one open tab's stream may cost with the fleet idle, and the window
# it is measured over (after the first snapshot).
BUDGET_BYTES_PER_S = 20_000
WINDOW_S = 20.0
SCREENS = {"desktop": {"width": 1400, "height": 900}, "phone": {"width": 390, "height": 844}}
CORDONED = "sim-00007"
# How long the page may take to show what the fleet settled on.
SETTLE_MS = 60_000


@dataclass
class Fleet:
    cluster: Cluster
    base: str
    gateway: str
    read_token: str
    key: str


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _logged(c: Cluster, name: str, pattern: str) -> re.Match[str]:
    async def seen() -> re.Match[str] | None:
        return re.search(pattern, c.log(name))

    found: re.Match[str] = anyio.run(lambda: eventually(seen, timeout=60, interval=0.2))
    return found


def _until(check: Any, timeout: float) -> Any:
    async def run() -> Any:
        return await eventually(check, timeout=timeout, interval=0.5)

    return anyio.run(run)


@pytest.fixture(scope="module")
def fleet(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("page-fleet")
    prefix = "t" + uuid.uuid4().hex[:10]
    # 1,000 nodes beat once a second on a shared machine: a node is lost after 10 s unheard.
    c = Cluster(root=root, nats_url=nats_url, prefix=prefix, node_timeout_s=10.0, heartbeat_s=1.0)
    c_api: list[httpx.Client] = []
    try:
        env = c.ctl_env()
        if c.auth is not None:
            env["LLMGW_NATS_NKEY"] = str(c.auth.seed("fleet"))
        for name, count in (("sim", NODES), ("gone", 2)):
            argv = [*LLMGW, "fleet", "--prefix", prefix, "--nodes", str(count), "--gpus", str(GPUS)]
            with (root / f"fleet-{name}.log").open("ab") as log:
                c.procs[f"fleet-{name}"] = subprocess.Popen(
                    [*argv, "--name", name], stdout=log, stderr=subprocess.STDOUT, env=env
                )
        c.start_node("real-1", gpus=2)

        # The page's origin is chosen first: the gateway lets that origin's scripts read it.
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        gateway_config = root / "gateway.yaml"
        gateway_config.write_bytes(
            msgspec.yaml.encode(
                {
                    "nats": c.nats("gateway"),
                    "http": {"host": "127.0.0.1", "port": 0, "require_api_key": True, "cors_origins": [base]},
                }
            )
        )
        c._spawn("gateway", [*LLMGW, "gateway", "--config", str(gateway_config)])
        gateway = _logged(c, "gateway", r"OpenAI endpoint on (http://\S+)/v1").group(1)

        catalog = [sim_catalog(), CRASHES, {**sim_catalog(name="fleet-tp1"), "args": []}]
        deployments = [
            {"name": "fleet-chat", "profile": "fleet-tp1", "replicas": 20, "pool": "fleet"},
            {"name": "talk", "profile": "tiny", "pool": "real"},
            {"name": "crashes", "profile": "crashes", "pool": "real"},
        ]
        path = c.server_config("p1", catalog, deployments)
        config = msgspec.yaml.decode(path.read_bytes())
        config["http"] |= {"port": port, "gateway_url": gateway}
        config["pools"] = {"fleet": ["sim-*"], "real": ["real-*"]}
        path.write_bytes(msgspec.yaml.encode(config))
        c._spawn("placement-p1", [sys.executable, "-m", "llmgw_placement", "--config", str(path)])
        _logged(c, "placement-p1", r"API on http://")
        api = httpx.Client(base_url=base, headers=c.api_headers, timeout=30)
        c_api.append(api)

        def nodes() -> list[dict[str, Any]]:
            found: list[dict[str, Any]] = api.get("/api/nodes").json()
            assert len(found) == NODES + 3, len(found)
            return found

        _until(nodes, timeout=120)
        c.kill("fleet-gone")
        answer = api.post(f"/api/nodes/{CORDONED}/cordon", json={"reason": "disk swap", "by": "ops"})
        assert answer.status_code == 200, answer.text

        def settled() -> bool:
            by_name = {n["node"]: n for n in nodes()}
            assert not by_name["gone-00000"]["alive"]
            assert not by_name["gone-00001"]["alive"]
            assert by_name[CORDONED]["intent"].startswith("cordoned by ops"), by_name[CORDONED]
            assert sum(n["alive"] for n in by_name.values()) == NODES + 1
            replicas = _replicas(api)
            ready = [r for r in replicas.values() if r["state"] == "ready"]
            assert len([r for r in ready if r["deployment"] == "fleet-chat"]) == 20, replicas
            assert replicas.get("talk.r0", {}).get("state") == "ready", replicas.get("talk.r0")
            assert "exited with code 42" in replicas.get("crashes.r0", {}).get("reason", ""), replicas.get(
                "crashes.r0"
            )
            return True

        _until(settled, timeout=180)
        key = new_key(c, "page")
        read_token = c.auth.token(read_only=True) if c.auth is not None else ""
        yield Fleet(cluster=c, base=base, gateway=gateway, read_token=read_token, key=key)
    finally:
        for api in c_api:
            api.close()
        c.close()


def _replicas(api: httpx.Client) -> dict[str, dict[str, Any]]:
    answer = api.get("/api/replicas")
    assert answer.status_code == 200, answer.text
    found: dict[str, dict[str, Any]] = answer.json()
    return found


async def test_the_first_screen_shows_the_summary_and_the_failing_replica(
    fleet: Fleet, tmp_path: Path
) -> None:
    """At 1400×900 and at 390×844: the summary (nodes alive / lost / cordoned, GPUs held /
    free / unusable, deployments) and the failing replica with its reason without scrolling;
    the nodes grouped in a grid, listed in full only where they need a look; nothing past
    the right edge of a phone."""
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            for screen, viewport in SCREENS.items():
                page = await browser.new_page(viewport=viewport)
                await page.goto(f"{fleet.base}/?token={fleet.read_token}")
                problem = page.locator("#problems [data-problem='crashes.r0']")
                await expect(problem).to_contain_text("exited with code 42", timeout=30_000)
                await expect(problem).to_contain_text("crashes/r0")
                await expect(page.locator("#live")).to_contain_text("live", timeout=30_000)
                summary = page.locator("#summary")
                # Lost nodes' GPUs, and the cordoned node's unheld ones, are never free. (Waited
                # for: a placement whose loop ran late grants every node a full timeout again,
                # and the lost ones are alive on the page until it has caught up.)
                expected = {"alive": NODES + 1, "lost": 2, "cordoned": 1, "unusable": 3 * GPUS}
                for what, count in expected.items():
                    await expect(summary.locator(f"[data-count='{what}']")).to_have_text(
                        str(count), timeout=SETTLE_MS
                    )
                counts = {
                    what: int(await summary.locator(f"[data-count='{what}']").inner_text())
                    for what in ("held", "free", "unusable", "ready", "degraded")
                }
                assert counts["held"] + counts["free"] + counts["unusable"] == (NODES + 2) * GPUS + 2, counts
                assert counts["held"] >= 21, counts
                assert counts["ready"] >= 2, counts
                assert counts["degraded"] >= 1, counts
                for seen in (summary, problem):
                    box = await seen.bounding_box()
                    assert box is not None
                    assert box["y"] + box["height"] <= viewport["height"], (screen, box)
                await expect(page.locator("#problems [data-problem='nodes-lost']")).to_contain_text(
                    "2 nodes lost: gone-00000, gone-00001", timeout=SETTLE_MS
                )

                # Nodes compact: one group per GPU class and pool, one square each in a grid,
                # in full only the lost and the cordoned.
                groups = page.locator("#groups tr")
                await expect(groups).to_have_count(3)
                fleet_group = page.locator("#groups tr[data-group='H100-80G|fleet']")
                await expect(fleet_group.locator(".nodes")).to_have_text(str(NODES))
                await expect(fleet_group.locator(".alive")).to_have_text(str(NODES))
                await expect(fleet_group.locator(".cordoned")).to_have_text("1")
                await expect(page.locator(".grid .c")).to_have_count(NODES + 3)
                await expect(page.locator(".grid .c.lost")).to_have_count(2, timeout=SETTLE_MS)
                await expect(page.locator(f".grid #c-{CORDONED}.cordoned")).to_have_count(1)
                listed = page.locator("#listed tr[data-node]")
                await expect(listed).to_have_count(3, timeout=SETTLE_MS)
                await expect(page.locator(f"#listed tr[data-node='{CORDONED}']")).to_contain_text(
                    "cordoned by ops"
                )
                tops = await page.evaluate(
                    "[...document.querySelectorAll('#nodes, #deployments')].map(e => e.offsetTop)"
                )
                heights = await page.evaluate("document.getElementById('nodes').offsetHeight")
                print(f"{screen}: nodes at {tops[0]} px, {heights} px tall; deployments at {tops[1]} px")
                assert heights < (900 if screen == "desktop" else 1600), (screen, heights)
                # The whole page: a few screens, never one that grows with every node's reason
                # (40,000-61,000 px at 500 nodes when each refusal listed them all).
                tall = await page.evaluate("document.documentElement.scrollHeight")
                print(f"{screen}: the page is {tall} px tall")
                assert tall < (6_000 if screen == "desktop" else 15_000), (screen, tall)

                width = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
                assert width[0] <= width[1], (screen, width)
                shot = tmp_path / f"cluster-page-{NODES}-nodes-{screen}.png"
                await page.screenshot(path=str(shot))
                assert shot.stat().st_size > 10_000
                print(f"first screen at {viewport['width']}×{viewport['height']}: {shot}")
                await page.close()
        finally:
            await browser.close()


async def test_an_open_tab_costs_under_20_kb_a_second_with_1000_idle_nodes(fleet: Fleet) -> None:
    """The live stream sends a first snapshot, then only what changed: bytes counted as they
    come off the socket over a 20 s window, in which one node is cordoned (sent as its cell,
    its row and the counts, not as the page)."""
    headers = {"Authorization": f"Bearer {fleet.read_token}"} if fleet.read_token else {}
    touched = "sim-00100"
    async with (
        httpx.AsyncClient(base_url=fleet.base, headers=headers, timeout=60) as client,
        httpx.AsyncClient(base_url=fleet.base, headers=fleet.cluster.api_headers, timeout=30) as writer,
        client.stream("GET", "/page/stream") as stream,
    ):
        assert stream.status_code == 200
        chunks = stream.aiter_raw()
        first = b""
        while b"\n\n" not in first:
            first += await chunks.__anext__()
        snapshot, _, rest = first.partition(b"\n\n")
        assert snapshot.startswith(b"event: view\n"), snapshot[:100]
        assert b"c-sim-00999" in snapshot, "the first snapshot is the whole view"
        wire = bytearray(rest)
        # What one render of the whole page costs placement at this size (a tab's first view).
        began = time.monotonic()
        index = await client.get("/")
        assert index.status_code == 200
        print(f"GET / ({len(index.content)} bytes) took {time.monotonic() - began:.3f} s")
        start = time.monotonic()
        cordon = await writer.post(f"/api/nodes/{touched}/cordon", json={"reason": "fan", "by": "ops"})
        assert cordon.status_code == 200, cordon.text
        try:
            with anyio.move_on_after(WINDOW_S):
                async for chunk in chunks:
                    wire += chunk
            window = time.monotonic() - start
        finally:
            await writer.post(f"/api/nodes/{touched}/uncordon")
    messages = bytes(wire).split(b"\n\n")
    patches = [m for m in messages if m.startswith(b"event: patch\n")]
    rate = len(wire) / window
    print(
        f"first snapshot {len(snapshot)} bytes; then {len(wire)} bytes in {window:.1f} s "
        f"({rate:.0f} B/s, {len(patches)} patches) with {NODES} idle nodes and one cordoned"
    )
    assert rate < BUDGET_BYTES_PER_S, f"{rate:.0f} B/s over {window:.1f} s"
    assert not any(m.startswith(b"event: view") for m in messages), "the whole view was sent again"
    cordoned = [p for p in patches if f"id='c-{touched}' class='c cordoned'".encode() in p]
    assert cordoned, f"the cordon of {touched} was not sent: {patches!r}"[:2000]
    # The cordon's own part of its patch: the events that came meanwhile (each its line, and the
    # list's new order) ride in the same patch, more of them on a busy machine.
    body = msgspec.json.decode(cordoned[0].partition(b"data: ")[2])
    own = {k: v for k, v in body["set"].items() if not k.startswith("e-")}
    assert f"c-{touched}" in own, sorted(own)
    assert len(msgspec.json.encode(own)) < 5_000, own


async def test_without_javascript_the_page_says_it_is_not_live_and_filters(fleet: Fleet) -> None:
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = await browser.new_context(java_script_enabled=False, viewport=SCREENS["phone"])
            page = await context.new_page()
            await page.goto(f"{fleet.base}/?token={fleet.read_token}")
            await expect(page.locator("#live")).to_contain_text("as of")
            await expect(page.locator("#live")).not_to_contain_text("connecting")
            await expect(page.locator("#nojs")).to_be_visible()
            await expect(page.locator("#nojs")).to_contain_text("reloads itself every 30 s")
            assert await page.locator("meta[http-equiv=refresh]").count() == 1
            await expect(page.locator("#problems [data-problem='crashes.r0']")).to_contain_text(
                "exited with code 42"
            )
            # The filter is a form: it lists the nodes asked for without a script.
            await page.locator("#find input[name=node]").fill("gone")
            await page.locator("#find button").click()
            await expect(page.locator("#listed-h")).to_contain_text("Nodes matching gone (2)")
            assert "node=gone" in page.url
            await expect(page.locator("#listed tr[data-node]")).to_have_count(2)
            await page.goto(f"{fleet.base}/?node=sim-0000*")
            await expect(page.locator("#listed tr[data-node]")).to_have_count(10)
            await page.goto(f"{fleet.base}/?state=cordoned")
            await expect(page.locator("#listed tr[data-node]")).to_have_count(1)
            width = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], width
        finally:
            await browser.close()


async def test_the_chat_box_sends_one_request_through_the_gateway(fleet: Fleet) -> None:
    """A deployment's view: the browser itself asks the gateway (its URL from placement's
    config, CORS on the gateway), with the key the user typed; placement never sees it."""
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = await browser.new_page(viewport=SCREENS["phone"])
            await page.goto(f"{fleet.base}/?token={fleet.read_token}")
            await page.locator("tr[data-deployment='talk'] a").click()
            assert "deployment=talk" in page.url
            chat = page.locator("#chat")
            await expect(page.locator("#dep-live")).to_contain_text("profile tiny")
            await expect(page.locator("#deployment [data-replica='talk.r0']")).to_contain_text("ready")
            await expect(page.locator("#live")).to_contain_text("live", timeout=30_000)

            # A wrong key: the gateway's own refusal, shown.
            await chat.locator("input[name=key]").fill("sk-llmgw-wrong")
            await chat.locator("button").click()
            await expect(page.locator("#chat-state")).to_have_text("gateway answered 401", timeout=30_000)

            await chat.locator("input[name=key]").fill(fleet.key)
            await chat.locator("textarea").fill("Hello from the page")
            await chat.locator("button").click()
            await expect(page.locator("#chat-state")).to_contain_text("answered (", timeout=30_000)
            answer = await page.locator("#chat-answer").inner_text()
            assert answer.strip(), "an empty answer"
            # The key stays in this tab, not in a cookie that placement would be sent.
            assert await page.evaluate("sessionStorage.getItem('llmgw-key')") == fleet.key
            assert all(fleet.key not in c["value"] for c in await page.context.cookies())
            print(f"chat box answer: {answer!r}")
            width = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
            assert width[0] <= width[1], width
        finally:
            await browser.close()
    # The request was the gateway's: counted against the key.
    async with httpx.AsyncClient(
        base_url=fleet.base, headers=fleet.cluster.api_headers, timeout=10
    ) as client:

        async def counted() -> bool:
            rows = (await client.get("/api/usage?by=key")).json()
            assert any(r["key"] == "page" and r["requests"] >= 1 for r in rows), rows
            return True

        await eventually(counted, timeout=30, interval=0.5)
