"""What every surface says when the truth is one a surface used to miss: a drain with nowhere to go,
an installer and launcher killed together, an installer killed mid-download.

The judgements are pure (`World`, the reconcile table's cluster without a bus); what an operator
reads is asserted over a real NATS, with placement in-process and its API and page served."""

from __future__ import annotations

import re

import anyio
import msgspec
import pytest

from llmgw.ctl import _nodes
from llmgw_core.bus import Bus
from llmgw_core.events import Deployment, Heartbeat, NodeFacts, NodeIntent, NodeStatus, ShardStatus, now
from llmgw_gateway.routing import refusal_text
from tests.control_support import all_ready, control_plane
from tests.test_reconcile import NOW, World
from tests.truth_support import describe, explain, last_status, served
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DOWNLOADING = "installing: downloading llama.cpp b4500 (20%, 1.0 of 5.0 MB)"
LLAMA = {"name": "gguf", "engine": "llamacpp", "model_path": "/models/m.gguf"}


# --- cell 9: an installer and its launcher killed together ------------------------------------


def _silent_replica(installer_at: float) -> str:
    """The reason of a ready replica on n0 once its launcher has been silent 4 s, its installer
    last heard at `installer_at` (heartbeats every 1 s, node_timeout_s 5)."""
    w = World({"n0": 1})
    w.state.heard_from = NOW - 100.0
    w.state.with_installer.add("n0")
    w.state.installer_seen["n0"] = installer_at
    w.holds("r0", "n0")
    w.shard_status["n0.chat-r0-0"] = ShardStatus(
        node="n0", shard="chat-r0-0", replica="r0", state="ready", url="http://n0:1"
    )
    w.deploy(replicas=1)
    [save] = w.step(NOW + 4.0).saves
    assert save.after.state == "unknown", save.after
    return save.after.reason


def test_an_installer_killed_with_its_launcher_is_not_said_to_beat() -> None:
    """Regression (cell 9): with both SIGKILLed, for 5-10 s every surface said `its installer still
    beats (an agent restart?)`: the launcher's silence was judged after a few heartbeats, the
    installer's only after node_timeout_s."""
    both = _silent_replica(installer_at=NOW)
    assert both == "launcher on n0 silent: readiness unknown", both
    # An agent restart (the installer beats on) is still told from a dead machine.
    restart = _silent_replica(installer_at=NOW + 3.5)
    assert restart.startswith(
        "launcher on n0 silent: readiness unknown; its installer still beats (an agent restart?)"
    ), restart


# --- cell 20: an installer killed mid-download -------------------------------------------------


def test_a_silent_installers_progress_is_quoted_stale_in_the_refusal() -> None:
    """Regression (cell 20): the node's own surfaces said `installer silent … stale`, while the
    deployment's refusal (summary, explain, page, the gateway's 503) quoted `downloading … (20%)`
    as live."""
    w = World({"n0": 0}, heartbeat_interval_s=1.0)
    w.state.nodes["n0"] = NodeStatus(node="n0", facts=NodeFacts(node="n0"), install=DOWNLOADING)
    w.state.heard_from = NOW - 100.0
    w.state.with_installer.add("n0")
    w.state.installer_seen["n0"] = NOW
    w.catalog["gguf"] = msgspec.convert(LLAMA, type(w.catalog["tp1"]))
    w.deploy(profile="gguf")
    live = w.step(NOW + 1.0)
    assert [r.status.summary for r in live.reports] == [
        f"chat: 0 of 1 ready; 1 cannot be placed: n0: {DOWNLOADING}"
    ]
    w.state.last_seen["n0"] = NOW + 4.0  # the launcher beats on; the installer does not
    stale = w.step(NOW + 4.0)
    said = f"{DOWNLOADING}, stale: installer on n0 silent"
    assert [r.status.summary for r in stale.reports] == [
        f"chat: 0 of 1 ready; 1 cannot be placed: n0: {said}"
    ]
    assert [r.reason for r in stale.reports[0].status.reasons] == [said]
    w.state.installer_seen["n0"] = NOW + 5.0  # it beats again: live, and said so
    w.state.last_seen["n0"] = NOW + 5.0
    again = w.step(NOW + 5.0)
    assert [r.status.summary for r in again.reports] == [
        f"chat: 0 of 1 ready; 1 cannot be placed: n0: {DOWNLOADING}"
    ]


async def test_a_silent_installers_progress_reads_stale_on_every_deployment_surface(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Cell 20 through the real path: a launcher that beats, an installer that stops mid-download;
    the deployment's summary, `explain`, `describe`, `/api/explain` and the page say stale."""
    names = bus.names
    installer_beats = anyio.Event()

    async def beats(stop: anyio.Event) -> None:
        while True:
            await bus.publish_core(
                names.heartbeat("n0", "launcher"), Heartbeat(node="n0", service="launcher", at=now())
            )
            if not stop.is_set():
                await bus.publish_core(
                    names.heartbeat("n0", "installer"), Heartbeat(node="n0", service="installer", at=now())
                )
            await anyio.sleep(0.1)

    async with control_plane(nats_url, prefix) as cp, served(cp, catalog=[LLAMA]) as s:
        await bus.put(
            names.nodes_bucket,
            "n0",
            NodeStatus(node="n0", facts=NodeFacts(node="n0"), install=DOWNLOADING),
        )
        cp.tg.start_soon(beats, installer_beats)
        await eventually(lambda: s.placement.service.is_leader, timeout=20)
        await bus.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="gguf", replicas=1))
        live = f"chat: 0 of 1 ready; 1 cannot be placed: n0: {DOWNLOADING}"

        async def said(summary: str) -> bool:
            status = await last_status(bus, "chat")
            assert status is not None
            assert status.summary == summary, status
            return True

        await eventually(lambda: said(live), timeout=30, interval=0.3)
        installer_beats.set()  # the installer is killed; its launcher beats on
        stale = f"{live}, stale: installer on n0 silent"
        await eventually(lambda: said(stale), timeout=30, interval=0.3)
        text = await explain(bus, "chat")
        assert text.splitlines()[0] == stale, text
        assert re.search(rf"^n0 +{re.escape(DOWNLOADING)}, stale: installer on n0 silent$", text, re.M), text
        assert f"Summary:      {stale}" in await describe(bus, "deployment", "chat")
        status = (await s.client.get("/api/explain/chat")).json()["status"]
        assert status["summary"] == stale, status
        # The gateway's 503 quotes the status it heard: stale there too.
        heard = await last_status(bus, "chat")
        assert heard is not None
        assert "stale: installer on n0 silent on n0. `llmgw ctl explain chat`" in refusal_text("chat", heard)
        page = await s.page()
        # The problems and the deployment's row quote it stale (the events keep their moment's words).
        assert f"<li data-problem='chat'>{stale}</li>" in page, page


# --- cell 25: a drain with nowhere to go -------------------------------------------------------


async def test_a_drain_with_nowhere_to_go_is_said_by_ctl_and_the_node_row_keeps_its_state(
    bus: Bus, nats_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (cell 25): `ctl drain` promised the replica would move when no node could take
    it, and the page's node row said `ready` (its shards' state written over the node's)."""
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=1)
        async with served(cp) as s:
            await eventually(lambda: s.placement.service.is_leader, timeout=20)
            await bus.put(
                bus.names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1)
            )
            [record] = (await eventually(lambda: all_ready(bus, 1), timeout=30, interval=0.3)).values()
            node = record.members[0].node
            other = "n1" if node == "n0" else "n0"
            await bus.put(
                bus.names.node_intent_bucket,
                other,
                NodeIntent(node=other, by="ops", at=1_800_000_000.0, reason="rack move"),
            )
            capsys.readouterr()

            said = await _nodes.cordon(bus, node, drain=True, reason="disk swap")
            assert re.fullmatch(
                rf"node {node} draining by \S+ at [-0-9: ]+UTC: disk swap: no new replica goes there; "
                r"its 1 replica is not moved: no other node can take it now",
                said,
            ), said
            err = capsys.readouterr().err
            assert re.fullmatch(
                rf"llmgw: warning: the drain of {node} is blocked: chat: 1 of 1 ready; drain of {node} "
                rf"blocked: no other node fits: (n0|n1): .*; its replica serves on there until a node can "
                r"take it \(`llmgw ctl explain chat`\)\n",
                err,
            ), err
            assert f"{other}: cordoned by ops at " in err, err

            async def row() -> str:
                page = await s.page()
                found = re.search(
                    rf"<tr id='n-{node}' data-node='{node}'><td>{node}</td><td>(.*?)</td>", page
                )
                assert found is not None, page
                cell = found.group(1)
                assert cell.startswith("<span class=ok>alive</span> <span class=warn>draining"), cell
                return cell

            await eventually(row, timeout=10, interval=0.3)
