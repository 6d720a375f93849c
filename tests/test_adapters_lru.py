"""LoRA adapters loaded at run time, as pure decisions: which adapter a full engine unloads (the
least recently used), what the gateway's index makes of a runtime engine's status, which
sources a runtime engine's base takes, and the engines' flags."""

from __future__ import annotations

import msgspec
import pytest

from llmgw_core.adapter_rules import adapter_problem
from llmgw_core.adapters import Adapter, ServedAdapter
from llmgw_core.engines import Profile
from llmgw_core.engines.sim import Sim
from llmgw_core.engines.vllm import VLLM
from llmgw_core.events import ShardStatus
from llmgw_gateway.adapters import AdapterIndex
from llmgw_launcher.adapter_loads import victim
from tests.launcher_support import shard


@pytest.mark.parametrize(
    ("loaded", "recent", "room", "out"),
    [
        ((), (), 2, None),
        (("a",), ("a",), 2, None),
        # Full: the one used longest ago goes.
        (("a", "b"), ("a", "b"), 2, "b"),
        (("a", "b"), ("b", "a"), 2, "a"),
        # One never used through this gateway is older than any used; the first loaded first.
        (("a", "b", "c"), ("c",), 3, "a"),
        (("a", "b", "c"), ("a", "c"), 3, "b"),
    ],
)
def test_a_full_engine_unloads_the_least_recently_used(
    loaded: tuple[str, ...], recent: tuple[str, ...], room: int, out: str | None
) -> None:
    assert victim(loaded, recent, room) == out


def _status(
    state: str = "ready", loaded: tuple[str, ...] = (), loadable: tuple[str, ...] = ()
) -> ShardStatus:
    return ShardStatus(
        node="n1",
        shard="chat-r0-0",
        replica="r0",
        deployment="chat",
        state=state,  # type: ignore[arg-type]
        adapters=tuple(ServedAdapter(name=n) for n in loaded),
        adapters_loadable=loadable,
    )


def test_the_index_knows_what_a_runtime_replica_may_load_and_what_it_used_last() -> None:
    index = AdapterIndex()
    index.observe("n1.chat-r0-0", _status(loadable=("finance", "legal", "tax")))
    assert index.holders("legal") is None
    assert index.loaders("legal") == ("chat", {"chat.r0": ("n1", "chat-r0-0")})
    assert index.names() == ["finance", "legal", "tax"]
    assert index.runtime("chat.r0")
    index.observe("n1.chat-r0-0", _status(loaded=("legal", "tax"), loadable=("finance", "legal", "tax")))
    assert index.holders("legal") == ("chat", frozenset({"chat.r0"}))
    # vLLM selects an adapter by `model`: no llama.cpp `lora` field, and no base request forced
    # off the express lane.
    assert index.lora("chat.r0", "legal") is None
    assert not index.any_on("chat")
    index.used("chat.r0", "tax")
    index.used("chat.r0", "legal")
    index.used("chat.r0", "finance")  # not held: not named
    assert index.recent("chat.r0") == ("legal", "tax")
    index.observe("n1.chat-r0-0", _status(state="failed", loadable=("legal",)))
    assert index.loaders("legal") is None
    index.observe("n1.chat-r0-0", _status(loadable=("legal",)))
    index.observe("n1.chat-r0-0", None)
    assert index.loaders("legal") is None
    assert not index.runtime("chat.r0")


def _profile(engine: str, **kw: object) -> Profile:
    return msgspec.convert({"name": "base", "engine": engine, "model_path": "/m/base", **kw}, Profile)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("file:///adapters/legal", None),
        ("hf://org/legal-lora", None),
        ("hf://org/legal-lora/legal.gguf", "names one file; vllm loads a PEFT adapter's directory"),
        ("file:///adapters/legal.gguf", "names one file; vllm loads a PEFT adapter's directory"),
    ],
)
def test_a_runtime_engine_takes_a_peft_directory(source: str, words: str | None) -> None:
    problem = adapter_problem(Adapter(name="legal", base="base", source=source), {"base": _profile("vllm")})
    assert (problem is None) if words is None else (problem is not None and words in problem), problem


def test_a_rank_bound_vllm_does_not_take_is_refused() -> None:
    base = _profile("vllm", max_lora_rank=48)
    problem = adapter_problem(Adapter(name="legal", base="base", source="file:///a/legal"), {"base": base})
    assert problem == (
        "adapter legal: base profile base has max_lora_rank 48; "
        "vLLM takes 1, 8, 16, 32, 64, 128, 256, 320, 512"
    )


def test_engines_are_started_with_room_for_max_loras_and_vllm_may_load_at_run_time() -> None:
    adapters = [{"name": "legal", "base": "base", "source": "file:///a/legal"}]
    profile = _profile("vllm", adapters=adapters, max_loras=2, max_lora_rank=16)
    cmd = VLLM().commands(shard("n1", "base-r0-0", profile))[0]
    assert "--enable-lora --max-loras 2 --max-lora-rank 16" in " ".join(cmd.args)
    assert ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True") in cmd.env
    sim = Sim().commands(shard("n1", "base-r0-0", _profile("sim", adapters=adapters)))[0]
    assert "--max-loras 4 --max-lora-rank 64" in " ".join(sim.args)
    # Without adapters neither changes: the same processes as before adapters existed.
    plain = VLLM().commands(shard("n1", "base-r0-0", _profile("vllm")))[0]
    assert "--enable-lora" not in plain.args
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in dict(plain.env)
