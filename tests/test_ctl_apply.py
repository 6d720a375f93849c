"""`llmgw ctl apply -f` against a real cluster, run as the operator runs it: a file writes only
what it names, a reference to nothing is refused before anything is written, `--dry-run` says
what would change and writes nothing, and only `--prune` deletes. Placement's API refuses a
deployment whose profile is not in the catalog the same way."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.engines import Profile
from llmgw_core.events import Deployment, DesiredEngines, NodeStatus
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.test_ctl import as_json, ctl, ok
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

# The catalog as placement's file seeded it.
TINY = msgspec.yaml.encode({"catalog": [sim_catalog()]}).decode()


async def revisions(bus: Bus) -> dict[str, int]:
    """Every desired-state key with its revision: equal before and after, nothing was written."""
    n = bus.names
    found = {f"catalog/{k}": c.revision for k, c in (await bus.entries(n.catalog_bucket, Profile)).items()}
    found |= {
        f"deployments/{k}": c.revision
        for k, c in (await bus.entries(n.deployments_bucket, Deployment)).items()
    }
    engines = await bus.get(n.config_bucket, "engines", DesiredEngines)
    found["config/engines"] = engines[1] if engines else 0
    return found


def ready(c: Cluster, deployment: str, count: int) -> list[Any]:
    listed = [r for r in as_json(c, "get", "replicas") if r["deployment"] == deployment]
    assert sorted(r["replica"] for r in listed if r["state"] == "ready") == [f"r{i}" for i in range(count)], (
        listed
    )
    return listed


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


async def test_apply_writes_only_what_the_file_names_and_refuses_a_reference_to_nothing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=2)
        c.start_placement("p1", [sim_catalog()], [{"name": "chat", "profile": "tiny", "replicas": 1}])
        await eventually(lambda: ready(c, "chat", 1), timeout=60, interval=0.5)
        before = await revisions(bus)
        assert before["config/engines"] > 0, "placement seeded the desired engines (none)"

        # No `engines:` in the file: the desired engines stay as they are (they used to be reset
        # to llama.cpp, and every node started an install).
        scaled = write(tmp_path, "scale.yaml", "deployments:\n  - {name: chat, profile: tiny, replicas: 2}\n")
        done = ctl(c, "apply", "-f", str(scaled))
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines() == [
            "engines: not in the file, left as it is",
            "catalog: not in the file, left as it is",
            "deployment chat: changed (replicas: 1 -> 2)",
            f"applied {scaled}: 0 added, 1 changed, 0 deleted, 0 unchanged",
        ]
        await eventually(lambda: ready(c, "chat", 2), timeout=60, interval=0.5)
        after = await revisions(bus)
        assert after["config/engines"] == before["config/engines"]
        assert after["catalog/tiny"] == before["catalog/tiny"]
        engines = await bus.get(bus.names.config_bucket, "engines", DesiredEngines)
        assert engines is not None
        assert engines[0].engines == ()
        # The node reported again since (its second replica is ready) and installs nothing.
        status = await bus.get(bus.names.nodes_bucket, "node-1", NodeStatus)
        assert status is not None
        assert (status[0].install, [e.name for e in status[0].engines]) == ("", ["sim"])

        # A deployment naming a profile that is nowhere: exit 4, where it is, nothing written,
        # and the healthy replicas stay ready.
        typo = write(
            tmp_path, "typo.yaml", "deployments:\n  - {name: chat, profile: tiny-chta, replicas: 2}\n"
        )
        refused = ctl(c, "apply", "-f", str(typo))
        assert (refused.returncode, refused.stderr) == (
            4,
            f"llmgw: {typo}: $.deployments[0].profile: unknown profile 'tiny-chta' for deployment chat: "
            "the catalog has tiny\nnothing was written\n",
        )
        assert refused.stdout == ""
        # An engine llmgw does not run, named by a profile and by the desired engines.
        engine = write(
            tmp_path,
            "engine.yaml",
            "engines: [{name: llamacp}]\n"
            "catalog:\n  - {name: other, engine: simm, model_path: sim://tiny}\n"
            "deployments:\n  - {name: chat, profile: other, replicas: 1}\n",
        )
        refused = ctl(c, "apply", "-f", str(engine))
        assert (refused.returncode, refused.stderr) == (
            4,
            f"llmgw: {engine}: $.engines[0].name: unknown engine 'llamacp' for the desired engines: "
            "llmgw runs llamacpp, sglang, sim, vllm\n"
            f"{engine}: $.catalog[0].engine: unknown engine 'simm' for profile other: "
            "llmgw runs llamacpp, sglang, sim, vllm\nnothing was written\n",
        )
        # Pruning a profile that a deployment the file leaves alone still uses.
        orphan = write(tmp_path, "orphan.yaml", "catalog: []\n")
        refused = ctl(c, "apply", "-f", str(orphan), "--prune")
        assert (refused.returncode, refused.stderr) == (
            4,
            f"llmgw: {orphan}: --prune would delete profile tiny, which deployment chat uses (it is not "
            "in the file, so it stays): name the profile in the file, or delete the deployment\n"
            "nothing was written\n",
        )
        assert await revisions(bus) == after
        ready(c, "chat", 2)

        # --dry-run: the diff against the live state, written nowhere.
        ok(c, "deploy", "old", "--profile", "tiny", "--replicas", "0")
        live = await revisions(bus)
        whole = write(
            tmp_path,
            "whole.yaml",
            TINY
            + "deployments:\n  - {name: chat, profile: tiny, replicas: 1}\n"
            + "  - {name: fresh, profile: tiny, replicas: 0}\n",
        )
        planned = ok(c, "apply", "-f", str(whole), "--dry-run", "--prune")
        assert planned.splitlines() == [
            "engines: not in the file, left as it is",
            "profile tiny: unchanged",
            "deployment chat: changed (replicas: 2 -> 1)",
            "deployment fresh: added",
            "deployment old: deleted",
            f"dry run of {whole}: nothing written; 1 added, 1 changed, 1 deleted, 1 unchanged",
        ]
        assert await revisions(bus) == live

        # Without --prune nothing is deleted; with it, what the file omits is.
        applied = ok(c, "apply", "-f", str(whole))
        assert applied.splitlines() == [
            "engines: not in the file, left as it is",
            "profile tiny: unchanged",
            "deployment chat: changed (replicas: 2 -> 1)",
            "deployment fresh: added",
            "deployment old: not in the file, kept (--prune deletes it)",
            f"applied {whole}: 1 added, 1 changed, 0 deleted, 1 unchanged",
        ]
        assert await bus.keys(bus.names.deployments_bucket) == {"chat", "fresh", "old"}
        assert (await revisions(bus))["catalog/tiny"] == live["catalog/tiny"]
        pruned = ok(c, "apply", "-f", str(whole), "--prune")
        assert pruned.splitlines()[-2:] == [
            "deployment old: deleted",
            f"applied {whole}: 0 added, 0 changed, 1 deleted, 3 unchanged",
        ]
        assert await bus.keys(bus.names.deployments_bucket) == {"chat", "fresh"}
        # A file that names the engines writes them (sim is built in: nothing to install).
        sim = write(tmp_path, "engines.yaml", "engines: [{name: sim}]\n")
        assert ok(c, "apply", "-f", str(sim)).splitlines() == [
            "catalog: not in the file, left as it is",
            "deployments: not in the file, left as it is",
            "engines: changed (none -> sim)",
            f"applied {sim}: 0 added, 1 changed, 0 deleted, 0 unchanged",
        ]
        engines = await bus.get(bus.names.config_bucket, "engines", DesiredEngines)
        assert engines is not None
        assert [e.name for e in engines[0].engines] == ["sim"]

        # Placement's API: the same rule, the same words, nothing stored.
        found = await eventually(lambda: re.search(r"API on (http://\S+)", c.log("placement-p1")), timeout=30)
        stored = await revisions(bus)
        async with httpx.AsyncClient(base_url=found.group(1), timeout=10, headers=c.api_headers) as client:
            r = await client.post("/api/deployments", json={"name": "chat", "profile": "tiny-chta"})
            assert (r.status_code, r.json()) == (
                400,
                {
                    "error": "invalid deployment: unknown profile 'tiny-chta' for deployment chat: "
                    "the catalog has tiny"
                },
            )
            assert await revisions(bus) == stored
            r = await client.post("/api/deployments", json={"name": "chat", "profile": "tiny", "replicas": 1})
            assert r.status_code == 200, r.text
        ready(c, "chat", 1)


# --- the plan, as pure functions ----------------------------------------------------------------


def test_an_empty_section_is_named_and_an_absent_one_is_not() -> None:
    from llmgw.ctl._apply import named_sections

    assert named_sections(b"deployments: []\n") == {"deployments"}
    assert named_sections(b"engines: []\ncatalog: []\n") == {"engines", "catalog"}
    assert named_sections(b"max_replicas: 3\n") == set()


def test_only_prune_deletes_and_a_profile_and_a_deployment_may_share_a_name() -> None:
    from llmgw.ctl._apply import Live, plan, reference_problems
    from llmgw_core.config import loads
    from llmgw_placement.config import ServerConfig

    tiny = Profile(name="chat", engine="sim", model_path="sim://tiny")
    live = Live(
        engines=(),
        catalog={"chat": tiny},
        deployments={
            "chat": Deployment(name="chat", profile="chat"),
            "old": Deployment(name="old", profile="chat"),
        },
    )
    raw = b"deployments:\n  - {name: chat, profile: chat, replicas: 3}\n"
    config = loads(raw, ServerConfig)
    kept = plan(config, {"deployments"}, live, prune=False)
    assert kept.lines() == [
        "engines: not in the file, left as it is",
        "catalog: not in the file, left as it is",
        "deployment chat: changed (replicas: 1 -> 3)",
        "deployment old: not in the file, kept (--prune deletes it)",
    ]
    pruned = plan(config, {"deployments"}, live, prune=True)
    assert [c.line() for c in pruned.of("deleted")] == ["deployment old: deleted"]
    # The absent catalog is not pruned, so the deployments' profile stays.
    assert reference_problems(config, {"deployments"}, live, pruned, engines={"sim"}, path="f") == []
