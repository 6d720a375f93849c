"""LoRA adapters as desired state: `adapters:` in server.yaml and `ctl apply`, kept on their base
profile, checked where they enter (the base exists and its engine serves adapters, the name
routes to nothing else), listed, described and deleted by `ctl`."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from llmgw.cli import build_parser
from llmgw.ctl import _adapters
from llmgw.ctl._apply import Live, plan, reference_problems
from llmgw.ctl._commands import _dispatch, apply, read_apply_file, request_replicas
from llmgw.ctl._errors import NotFound, Refused
from llmgw_core.adapters import Adapter
from llmgw_core.bus import Bus
from llmgw_core.config import loads
from llmgw_core.engines import Profile
from llmgw_core.events import _LATE_DEFAULTS, Deployment
from llmgw_core.validate import check_profile
from llmgw_placement.api import Api
from llmgw_placement.config import ServerConfig
from tests.control_support import control_plane
from tests.waiting import eventually

BASE = {"name": "tiny", "engine": "llamacpp", "model": "file:///models/tiny.gguf"}
VLLM = {"name": "big", "engine": "vllm", "model_path": "/models/big", "gpu_class": "H100-80G"}
LEGAL = {"name": "legal", "base": "tiny", "source": "file:///models/legal.gguf", "scale": 0.5}


def _config(**sections: Any) -> ServerConfig:
    return loads(msgspec.yaml.encode(sections), ServerConfig)


@pytest.mark.parametrize(
    ("adapter", "words"),
    [
        ({**LEGAL, "base": "nope"}, "adapter legal: base profile nope is not in the catalog"),
        # vLLM loads a PEFT directory at run time, not llama.cpp's one .gguf file.
        ({**LEGAL, "base": "big"}, "names one file; vllm loads a PEFT adapter's directory"),
        ({**LEGAL, "name": "friendly"}, "adapter friendly: the name is an alias of deployment chat"),
        ({**LEGAL, "name": "chat"}, "adapter chat: the name is the name of deployment chat"),
        ({**LEGAL, "source": "hf://org/repo"}, "names a repository, not the adapter's .gguf file in it"),
        (
            {**LEGAL, "source": "https://h/legal.gguf"},
            "adapter legal: source 'https://h/legal.gguf' needs sha256",
        ),
        ({**LEGAL, "source": "legal"}, "adapter legal: source 'legal' names no file"),
        ({**LEGAL, "name": "a.b"}, "at `$.adapters[0].name`"),
        ({**LEGAL, "scale": 1000}, "at `$.adapters[0].scale`"),
        ({**LEGAL, "sacle": 2}, "unknown field `sacle` - at `$.adapters[0]`"),
    ],
)
def test_server_yaml_refuses_an_adapter_that_cannot_be_served_naming_it(
    adapter: dict[str, Any], words: str
) -> None:
    deployments = [{"name": "chat", "profile": "tiny", "aliases": ["friendly"]}]
    with pytest.raises(Exception, match="adapter") as caught:
        _config(catalog=[BASE, VLLM], deployments=deployments, adapters=[adapter])
    assert words in str(caught.value)


def test_server_yaml_keeps_each_adapter_on_its_base_and_a_profile_without_keeps_its_fingerprint() -> None:
    plain = _config(catalog=[BASE])
    config = _config(catalog=[BASE], adapters=[LEGAL, {**LEGAL, "name": "finance", "scale": 1}])
    held = config.profiles()["tiny"].adapters
    assert [(a.name, a.base, a.scale) for a in held] == [("finance", "tiny", 1.0), ("legal", "tiny", 0.5)]
    # An adapter added changes the base's fingerprint (its replicas are replaced with it); a
    # profile that names none keeps the digest it had before adapters existed.
    assert config.profiles()["tiny"].fingerprint() != plain.profiles()["tiny"].fingerprint()
    fields = msgspec.to_builtins(plain.profiles()["tiny"])
    for late, default in _LATE_DEFAULTS.items():
        if late != "adapters" and fields.get(late) == default:
            del fields[late]
    del fields["adapters"]
    digest = hashlib.sha256(msgspec.json.encode(fields, order="sorted")).hexdigest()[:16]
    assert plain.profiles()["tiny"].fingerprint() == digest
    with pytest.raises(Exception, match=r"adapters are listed under `adapters:`.*\$\.catalog\[0\]\.adapters"):
        _config(catalog=[{**BASE, "adapters": [LEGAL]}])


def test_a_stored_profile_holding_another_profiles_adapter_is_dead_lettered_by_name() -> None:
    wrong = Profile(**{**BASE, "adapters": (Adapter(**{**LEGAL, "base": "other"}),)})  # type: ignore[arg-type]
    assert check_profile("tiny", wrong) == (
        "profile tiny holds adapter legal, whose base is other: an adapter is kept on its own base profile"
    )
    good = Profile(**{**BASE, "adapters": (Adapter(**LEGAL),)})  # type: ignore[arg-type]
    assert check_profile("tiny", good) is None


def _live(*adapters: dict[str, Any]) -> Live:
    tiny = Profile(**{**BASE, "adapters": tuple(Adapter(**a) for a in adapters)})  # type: ignore[arg-type]
    other = Profile(name="other", engine="llamacpp", model="file:///models/other.gguf")
    return Live(
        engines=(),
        catalog={"tiny": tiny, "other": other},
        deployments={"chat": Deployment(name="chat", profile="tiny", aliases=("friendly",))},
    )


def test_a_file_of_adapters_alone_rewrites_only_their_bases_and_prune_alone_deletes() -> None:
    live = _live(LEGAL)
    config = _config(adapters=[{**LEGAL, "name": "finance"}])
    kept = plan(config, {"adapters"}, live, prune=False)
    assert sorted(kept.profiles) == ["tiny"]
    assert [a.name for a in kept.profiles["tiny"].adapters] == ["finance", "legal"]
    assert [c.line() for c in kept.changes if c.kind == "adapter"] == [
        "adapter finance: added",
        "adapter legal: not in the file, kept (--prune deletes it)",
    ]
    assert reference_problems(config, {"adapters"}, live, kept, engines={"llamacpp"}, path="f") == []
    pruned = plan(config, {"adapters"}, live, prune=True)
    assert [a.name for a in pruned.profiles["tiny"].adapters] == ["finance"]
    assert [c.line() for c in pruned.of("deleted")] == ["adapter legal: deleted"]
    # A catalog rewritten by a file that names no adapters keeps the cluster's.
    catalog_only = plan(_config(catalog=[BASE]), {"catalog"}, live, prune=False)
    assert [a.name for a in catalog_only.profiles["tiny"].adapters] == ["legal"]
    assert catalog_only.of("changed") == []


def test_apply_refuses_an_adapter_or_a_deployment_whose_name_meets_the_other() -> None:
    live = _live(LEGAL)
    config = _config(adapters=[{**LEGAL, "name": "friendly"}, {**LEGAL, "base": "nope", "name": "x"}])
    the_plan = plan(config, {"adapters"}, live, prune=False)
    assert reference_problems(config, {"adapters"}, live, the_plan, engines={"llamacpp"}, path="f") == [
        "f: $.adapters[0]: adapter friendly: the name is an alias of deployment chat: a model name routes to "
        "one deployment or adapter; name the adapter otherwise"
    ]
    deps = _config(deployments=[{"name": "legal", "profile": "tiny"}])
    the_plan = plan(deps, {"deployments"}, live, prune=False)
    assert reference_problems(deps, {"deployments"}, live, the_plan, engines={"llamacpp"}, path="f") == [
        "f: $.deployments[0]: deployment legal: its name is the name of adapter legal: a model name "
        "routes to one deployment or adapter; delete the adapter first, or name this otherwise"
    ]


@pytest.mark.anyio
async def test_adapters_seeded_applied_listed_described_and_deleted_through_the_bus(
    nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with control_plane(nats_url, prefix) as cp:
        p = await cp.start_placement(
            "p1",
            catalog=[BASE, {**BASE, "name": "other"}],
            deployments=[{"name": "chat", "profile": "tiny", "replicas": 0}],
            adapters=[LEGAL],
            http={"insecure": True},
        )
        bus: Bus = await cp.connect("ctl")
        names = bus.names

        async def stored() -> Profile:
            found = await bus.get(names.catalog_bucket, "tiny", Profile)
            assert found is not None
            return found[0]

        seeded = await eventually(stored, timeout=30)
        assert [a.name for a in seeded.adapters] == ["legal"]

        path = tmp_path / "adapters.yaml"
        finance = {**LEGAL, "name": "finance", "scale": 2.0}
        path.write_text(msgspec.yaml.encode({"adapters": [finance]}).decode())
        said = await apply(bus, str(path), checked=read_apply_file(str(path)))
        assert said.splitlines() == [
            "engines: not in the file, left as it is",
            "catalog: not in the file, left as it is",
            "deployments: not in the file, left as it is",
            "profile tiny: changed (adapters: "
            + msgspec.json.encode([msgspec.to_builtins(Adapter(**LEGAL))]).decode()
            + " -> "
            + msgspec.json.encode(
                [
                    msgspec.to_builtins(Adapter(**finance)),
                    msgspec.to_builtins(Adapter(**LEGAL)),
                ]
            ).decode()
            + ")",
            "adapter finance: added",
            "adapter legal: not in the file, kept (--prune deletes it)",
            f"applied {path}: 1 added, 1 changed, 0 deleted, 0 unchanged",
        ]
        assert [a.name for a in (await stored()).adapters] == ["finance", "legal"]

        table = await _adapters.get(bus, "", "")
        assert table.splitlines() == [
            "NAME     BASE  SCALE  LIMITS  DEPLOYMENTS  SOURCE",
            "finance  tiny  2      -       chat         file:///models/legal.gguf",
            "legal    tiny  0.5    -       chat         file:///models/legal.gguf",
        ]
        # As the operator types it.
        named = await _dispatch(bus, build_parser().parse_args(["ctl", "get", "adapters", "-o", "name"]))
        assert named == "adapter/finance\nadapter/legal"
        described = await _adapters.describe(bus, "legal")
        assert "Base:         profile tiny" in described
        assert "Deployments:  chat" in described

        # A deployment may not take an adapter's name, by ctl or by the API.
        with pytest.raises(Refused, match="deployment legal: its name is the name of adapter legal"):
            await request_replicas(bus, Deployment(name="legal", profile="tiny"), "requested")
        await eventually(lambda: "finance" in str(p.service.state.catalog["tiny"].adapters), timeout=30)
        transport = httpx.ASGITransport(app=Api(p.service).app())
        async with httpx.AsyncClient(transport=transport, base_url="http://placement") as client:
            r = await client.post("/api/deployments", json={"name": "finance", "profile": "tiny"})
        assert r.status_code == 409, r.text
        assert "its name is the name of adapter finance" in r.json()["error"]

        assert await _dispatch(bus, build_parser().parse_args(["ctl", "delete", "adapter", "legal"])) == (
            "adapter legal deleted from profile tiny: its replicas are replaced, one at a time, without it"
        )
        assert [a.name for a in (await stored()).adapters] == ["finance"]
        with pytest.raises(NotFound, match="no adapter legal"):
            await _adapters.describe(bus, "legal")
