"""Desired state that no restart, leader change or bad write takes back, and a leader that
says it leads only while it can prove it.

- What a user deleted stays deleted whichever placement's server.yaml names it, and two
  placements whose files differ are warned about (real placement processes).
- A value that does not decode never replaces the last good one, across restarts of
  every placement too (in-process placements over a simulated fleet).
- `/healthz` of a placement cut off from NATS stops saying it leads within one lease
  period, and answers 503; a standby's replicas answer 503 naming the leader.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, decoder
from llmgw_core.natsd import NatsServer
from llmgw_placement.config import ServerConfig
from llmgw_placement.desired import PlacementFile, file_difference, last_good, placement_file
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.control_support import TP1, control_plane, dlq, ready_replicas, replicas
from tests.metrics_support import value
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(240)]

CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]
_API = re.compile(r"llmgw-placement: API on (http://\S+)")


async def api_url(c: Cluster, name: str, nth: int = 1) -> str:
    """The address the `nth` start of process `name` serves its API on (its log says)."""

    def said() -> str | None:
        found = _API.findall(c.log(name))
        return found[nth - 1] if len(found) >= nth else None

    return await eventually(said, timeout=60, interval=0.1)


async def leads(client: httpx.AsyncClient, url: str) -> bool:
    r = await client.get(f"{url}/healthz")
    return r.status_code == 200 and r.json()["leader"] is True


# --- pure parts ------------------------------------------------------------------------


def _config(**raw: object) -> ServerConfig:
    return msgspec.convert({"engines": [], "catalog": [TP1], **raw}, ServerConfig)


def test_a_file_difference_names_every_entry_that_differs() -> None:
    chat = {"name": "chat", "profile": "tp1"}
    a = placement_file("a", _config(deployments=[chat, {"name": "docs", "profile": "tp1"}]))
    b = placement_file(
        "b", _config(deployments=[{**chat, "replicas": 3}], catalog=[TP1, {**TP1, "name": "x"}])
    )
    assert file_difference(a, b) == (
        "placement b's server.yaml differs from this placement's (a): deployment chat differs; "
        "deployment docs only in a's; profile x only in b's"
    )
    # The same file written in another order seeds the same: no warning.
    again = placement_file("c", _config(deployments=[chat, {"name": "docs", "profile": "tp1"}]))
    assert file_difference(a, again) is None
    many = PlacementFile(placement="m", digest="x", entries={f"deployment d{i}": "1" for i in range(12)})
    assert file_difference(a, many) is not None
    # 16 entries differ (every one of each file): 8 are named.
    assert file_difference(a, many).endswith("deployment d4 only in m's; 8 more")  # type: ignore[union-attr]


def test_the_last_good_revision_stops_at_a_delete() -> None:
    def judge(data: bytes) -> Deployment | str:
        try:
            return decoder(Deployment).decode(data)
        except msgspec.ValidationError as exc:
            return str(exc)
        except msgspec.DecodeError as exc:
            return str(exc)

    good = msgspec.json.encode(Deployment(name="chat", profile="tp1"))
    assert last_good([(9, b"x"), (7, b"{}"), (5, good), (3, b"y")], judge) == (
        5,
        Deployment(name="chat", profile="tp1"),
    )
    # Deleted before the bad write: what came before the delete must not come back.
    assert last_good([(9, b"x"), (8, None), (5, good)], judge) is None
    assert last_good([(9, b"x")], judge) is None


# --- deleted stays deleted ----------------------------------------------------------------


async def test_a_deleted_deployment_stays_deleted_whichever_placement_leads(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a deployment deleted while it was in a placement's server.yaml came back the
    next time that placement took the lease (KV create succeeds over a delete marker)."""
    catalog = [sim_catalog()]
    chat = {"name": "chat", "profile": "tiny", "replicas": 1}
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_placement("a", catalog, [chat, {"name": "docs", "profile": "tiny", "replicas": 1}])
        a = await api_url(c, "placement-a")
        async with httpx.AsyncClient(timeout=10) as client:
            await eventually(lambda: leads(client, a), timeout=60, interval=0.2)
            c.start_placement("b", catalog, [{**chat, "replicas": 2}])
            b = await api_url(c, "placement-b")
            # Each placement says how the other's file differs, in its log, its API and metrics.
            said_by_a = (
                "placement b's server.yaml differs from this placement's (a): deployment chat differs; "
                "deployment docs only in a's"
            )
            said_by_b = (
                "placement a's server.yaml differs from this placement's (b): deployment chat differs; "
                "deployment docs only in a's"
            )
            await eventually(lambda: said_by_a in c.log("placement-a"), timeout=60, interval=0.2)
            await eventually(lambda: said_by_b in c.log("placement-b"), timeout=60, interval=0.2)
            warned = (await client.get(f"{a}/api/warnings", headers=c.api_headers)).json()
            assert warned == {"warnings": [said_by_a]}
            metrics = (await client.get(f"{a}/metrics", headers=c.api_headers)).text
            assert value(metrics, "llmgw_placement_warnings") == 1
            # b stands by, and says so where it cannot answer for the leader.
            r = await client.get(f"{b}/api/replicas", headers=c.api_headers)
            assert (r.status_code, r.json()) == (
                503,
                {"error": "standby: the leader is a; replicas and decisions are the leader's", "leader": "a"},
            )

            done = subprocess.run(
                [*CTL, "--prefix", c.prefix, "delete", "deployment", "chat"],
                capture_output=True,
                text=True,
                env=c.ctl_env(),
                timeout=60,
            )
            assert done.returncode == 0, done.stderr
            c.kill("placement-a")
            await eventually(lambda: leads(client, b), timeout=60, interval=0.2)
            # Leading means it took over (seeding included): chat, in b's file, is not back.
            assert await bus.get(bus.names.deployments_bucket, "chat", Deployment) is None
            docs = await bus.get(bus.names.deployments_bucket, "docs", Deployment)
            assert docs is not None, "what a seeded and nobody deleted stays"

            # a comes back, and leads again: chat is in its file too, and stays deleted.
            c.respawn("placement-a")
            a = await api_url(c, "placement-a", nth=2)
            r = await client.get(f"{a}/healthz")
            assert (r.status_code, r.json()) == (200, {"leader": False, "identity": "a"})
            c.kill("placement-b")
            await eventually(lambda: leads(client, a), timeout=60, interval=0.2)
            assert await bus.get(bus.names.deployments_bucket, "chat", Deployment) is None
            assert not [r for r in (await replicas(bus)).values() if r.deployment == "chat"]
            listed = (await client.get(f"{a}/api/deployments", headers=c.api_headers)).json()
            assert sorted(listed) == ["docs"]


# --- the last good value survives restarts ---------------------------------------------


async def test_a_value_that_does_not_decode_never_replaces_the_last_good_one_across_restarts(
    bus: Bus, nats_url: str, prefix: str
) -> None:
    """Regression: a garbage catalog entry and deployment, then both placements restarted:
    the profile was gone and the replicas removed (the last good value lived in memory only)."""
    names = bus.names
    async with control_plane(nats_url, prefix) as cp:
        await cp.start_fleet(["n0", "n1"], gpus=8)
        a = await cp.start_placement("a")
        b = await cp.start_placement("b")
        await eventually(lambda: len(cp.leaders()) == 1, timeout=30)
        dep_rev = await bus.put(
            names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=2)
        )

        async def two_ready() -> list[str]:
            ready = await ready_replicas(bus, "chat")
            assert len(ready) == 2, ready
            return ready

        before = await eventually(two_ready, timeout=60, interval=0.3)
        profile = await bus.get(names.catalog_bucket, "tp1", Profile)
        assert profile is not None
        bad_profile = b"{not json"
        bad_dep = b'{"kind":"Deployment","name":"chat"}'
        catalog_rev = await (await bus.kv(names.catalog_bucket)).put("tp1", bad_profile)
        bad_dep_rev = await (await bus.kv(names.deployments_bucket)).put("chat", bad_dep)
        await eventually(lambda: len(a.service.held) == 2 and len(b.service.held) == 2, timeout=30)
        a.kill()
        b.kill()
        await a.stopped.wait()
        await b.stopped.wait()

        a2 = await cp.start_placement("a")
        b2 = await cp.start_placement("b")
        leader = await eventually(lambda: (cp.leaders() or [None])[0], timeout=30)
        controller = leader.service.controller
        assert controller is not None

        def judged() -> str:
            status = controller.statuses.get("chat")
            assert status is not None, "the new leader judged chat"
            return status.summary

        # Judged on the kept revisions: the same two replicas, ready, nothing removed or added.
        assert await eventually(judged, timeout=30) == "chat: 2 of 2 ready"
        assert await ready_replicas(bus, "chat") == before
        assert sorted(await replicas(bus)) == before

        def error(kind: type[msgspec.Struct], data: bytes) -> str:
            try:
                decoder(kind).decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return str(exc)
            raise AssertionError("it decodes")

        for p in (a2, b2):
            assert p.service.warnings() == [
                f"{names.catalog_bucket}/tp1: revision {catalog_rev} is refused "
                f"({error(Profile, bad_profile)}); placement keeps revision {profile[1]}, the last good one; "
                "write a good value or delete the key",
                f"{names.deployments_bucket}/chat: revision {bad_dep_rev} is refused "
                f"({error(Deployment, bad_dep)}); placement keeps revision {dep_rev}, the last good one; "
                "write a good value or delete the key",
            ]
        dead = {m.headers.get("Llmgw-Subject") for m in await dlq(bus) if m.headers}
        assert {f"$KV.{names.catalog_bucket}.tp1", f"$KV.{names.deployments_bucket}.chat"} <= dead

        # A good value ends the warning, and is acted on.
        await bus.put(names.deployments_bucket, "chat", Deployment(name="chat", profile="tp1", replicas=1))
        await eventually(lambda: judged() == "chat: 1 of 1 ready", timeout=30)
        assert [w for w in leader.service.warnings() if "/chat" in w] == []
        assert cp.crashes() == []


# --- leadership only while proven -------------------------------------------------------


async def test_healthz_stops_saying_leader_within_a_lease_period_of_losing_nats(
    own_nats: NatsServer, prefix: str, tmp_path: Path
) -> None:
    """Regression: both placements cut off from NATS answered `{"leader": true}` with 200 (a load
    balancer kept sending to them), and a standby's `/api/replicas` answered `{}` with 200."""
    with cluster(tmp_path, own_nats.url, prefix) as c:
        c.start_placement("p1", [sim_catalog()], [])
        p1 = await api_url(c, "placement-p1")
        async with httpx.AsyncClient(timeout=5) as client:
            await eventually(lambda: leads(client, p1), timeout=60, interval=0.2)
            c.start_placement("p2", [sim_catalog()], [])
            p2 = await api_url(c, "placement-p2")

            async def standby_says_so() -> bool:
                r = await client.get(f"{p2}/api/replicas")
                assert r.status_code == 503, r.text
                assert r.json()["leader"] == "p1", r.text
                return True

            await eventually(standby_says_so, timeout=60, interval=0.2)
            r = await client.get(f"{p2}/healthz")
            assert (r.status_code, r.json()) == (200, {"leader": False, "identity": "p2"})

            stopped = time.monotonic()
            own_nats.stop()

            async def not_leading() -> dict[str, object]:
                r = await client.get(f"{p1}/healthz")
                assert r.status_code == 503, r.text
                body: dict[str, object] = r.json()
                assert body["leader"] is False, body
                return body

            body = await eventually(not_leading, timeout=30, interval=0.05)
            took = time.monotonic() - stopped
            print(
                f"\n/healthz stopped saying leader {took:.2f} s after NATS stopped "
                f"(lease period {c.node_timeout_s} s)"
            )
            # Its last renewal came before the stop, so a lease period is the bound; the rest is
            # this test's own stop and polling on a busy machine.
            assert took < c.node_timeout_s + 2.0
            assert body == {
                "leader": False,
                "identity": "p1",
                "error": f"placement p1 cannot reach NATS at {own_nats.url}: "
                "it can neither lead nor stand by until it does",
            }
            metrics = (await client.get(f"{p1}/metrics")).text
            assert value(metrics, "llmgw_placement_leader") == 0
            assert (await client.get(f"{p2}/healthz")).status_code == 503

            # NATS back: one placement leads again, and says so.
            own_nats.start()

            async def one_leads() -> bool:
                answers = [await leads(client, url) for url in (p1, p2)]
                return answers.count(True) == 1

            await eventually(one_leads, timeout=60, interval=0.2)
