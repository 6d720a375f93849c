"""A node's refusal carried as fields from where placement makes it to where it is said: the
words and their kind (`failures.REFUSAL_KINDS`), so that the gateway acts on the kind.

Regression: feasibility split the engine checks' sentences on `": "` to drop the profile's
name, and the gateway matched placement's wording (`installing`, `engine … not installed`)
with a pattern to tell a node getting ready from one refusing for good."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core import failures
from llmgw_core.engines import GPUInfo, Profile, profile_problems, validate_profile
from llmgw_core.events import Deployment, DeploymentStatus, EngineState, NodeReason, decoder, encode
from llmgw_gateway import Table
from llmgw_placement.decide import Refusal, decide
from llmgw_placement.feasibility import NodeView, Reason, unfit
from llmgw_placement.gpuclass import gpu_class

DEP = Deployment(name="chat", profile="tiny")
TINY = Profile(name="tiny", engine="llamacpp", model_path="/m.gguf")


INSTALLED = {"llamacpp": EngineState(name="llamacpp", state="installed")}


def _node(**fields: Any) -> NodeView:
    return NodeView(**{"node": "n1", "engines": INSTALLED, **fields})


@pytest.mark.parametrize(
    ("node", "words", "kind"),
    [
        (_node(alive=False, lost_for_s=31.5), "lost 31 s ago", failures.LOST),
        (_node(cordoned="cordoned by ops"), "cordoned by ops", failures.CORDONED),
        (_node(engines={}), "engine llamacpp not installed", failures.ENGINE_MISSING),
        (
            _node(engines={}, install="installing: looking up llamacpp b1"),
            "installing: looking up llamacpp b1",
            failures.ENGINE_INSTALLING,
        ),
        (
            _node(engines={}, install="internal error: OSError: disk full"),
            "internal error: OSError: disk full",
            failures.ENGINE_DOWN,
        ),
        (
            _node(
                engines={"llamacpp": EngineState(name="llamacpp", state="installing")},
                install="installing: unpacking x.zip",
            ),
            "engine llamacpp installing: unpacking x.zip",
            failures.ENGINE_INSTALLING,
        ),
        (
            _node(
                engines={
                    "llamacpp": EngineState(name="llamacpp", state="broken", detail="libgomp.so.1 not found")
                }
            ),
            "engine llamacpp broken: libgomp.so.1 not found",
            failures.ENGINE_DOWN,
        ),
        (
            _node(avx2=False),
            "no AVX2: llama.cpp's CPU build would run several times slower here; "
            "place CPU profiles on nodes with AVX2 (`llmgw ctl nodes` marks those without), "
            "or give the profile a gpu_class",
            failures.AVX2,
        ),
    ],
)
def test_each_refusal_carries_its_words_and_kind(node: NodeView, words: str, kind: str) -> None:
    reason = unfit(node, TINY, DEP)
    assert isinstance(reason, Reason)
    assert (reason, reason.kind) == (words, kind)
    assert kind in failures.REFUSAL_KINDS


def test_an_engine_check_is_quoted_by_its_words_never_split_out_of_a_sentence() -> None:
    """The engine's own check names the profile (`profile fp8: …`); the refusal, of that profile
    already, quotes its words, which may hold `": "` themselves."""
    old = GPUInfo(index=0, name="NVIDIA H100", compute_capability="8.0", memory_mb=81559)
    profile = Profile(
        name="fp8", engine="vllm", model="hf://org", gpu_class=gpu_class(old), args=("--quantization", "fp8")
    )
    problems = profile_problems(profile, [old])
    assert [p.about for p in problems] == ["profile fp8", "profile fp8"]
    assert [str(p) for p in problems] == validate_profile(profile, [old])
    node = NodeView(node="n1", gpus=(old,), engines={"vllm": EngineState(name="vllm", state="configured")})
    reason = unfit(node, profile, DEP)
    assert isinstance(reason, Reason)
    assert (reason, reason.kind) == (
        "model 'hf://org' must name a repository: hf://<org>/<repo>[/<file>]",
        failures.PROFILE,
    )
    fixed = msgspec.structs.replace(profile, model="hf://org/repo")
    reason = unfit(node, fixed, DEP)
    assert isinstance(reason, Reason)
    assert (reason, reason.kind) == (
        "fp8 needs compute capability 8.9, GPU 0 (NVIDIA H100) has 8.0",
        failures.PROFILE,
    )


def test_the_kind_travels_to_the_gateway_which_holds_for_a_node_getting_ready() -> None:
    """From feasibility through the decision and the bus to the gateway: the kind, not the
    words, tells it that a node is installing the engine (the request is held, not answered)."""
    installing = _node(
        engines={"llamacpp": EngineState(name="llamacpp", state="installing", detail="fetching b1")}
    )
    decision = decide(DEP, TINY, [installing])
    assert isinstance(decision, Refusal)
    told = DeploymentStatus(deployment="chat", desired=1, unplaceable=1, reasons=decision.node_reasons())
    heard = decoder(DeploymentStatus).decode(encode(told))
    assert heard.reasons == (
        NodeReason(
            node="n1", reason="engine llamacpp installing: fetching b1", kind=failures.ENGINE_INSTALLING
        ),
    )
    table = Table()
    table.set_status(heard)
    assert table.refused("chat") is None
    # The kind is read, not the words: words that read as installing, of a node refused for good,
    # are answered at once; words that do not, of a node getting ready, are held for.
    for kind, answered in ((failures.GPUS, True), (failures.ENGINE_INSTALLING, False)):
        reasons = (
            NodeReason(
                node="n1",
                reason="installing nothing: 0 of 1 GPUs free" if answered else "fetching b1",
                kind=kind,
            ),
        )
        table.set_status(DeploymentStatus(deployment="chat", desired=1, unplaceable=1, reasons=reasons))
        assert (table.refused("chat") is not None) == answered, kind
    # Kept and told again (`Refusal.of`), the kinds stay with the words.
    assert Refusal.of(heard.reasons).node_reasons() == heard.reasons


def test_old_and_new_peers_read_each_others_reasons() -> None:
    """A placement that predates kinds sends none: its words are read as before. A reader that
    predates them skips the field."""

    class OldNodeReason(msgspec.Struct, frozen=True, kw_only=True):
        node: str
        reason: str

    old = msgspec.json.encode(OldNodeReason(node="n1", reason="engine vllm not installed"))
    heard = msgspec.json.decode(old, type=NodeReason)
    assert (heard.kind, failures.readying(heard)) == ("", True)
    assert not failures.readying(NodeReason(node="n1", reason="engine vllm broken"))
    new = msgspec.json.encode(NodeReason(node="n1", reason="lost 3 s ago", kind=failures.LOST))
    assert msgspec.json.decode(new, type=OldNodeReason) == OldNodeReason(node="n1", reason="lost 3 s ago")


@given(st.text(max_size=200), st.text(max_size=40))
@settings(max_examples=200, deadline=None)
def test_fuzz_readying_is_total_over_any_reason(words: str, kind: str) -> None:
    failures.readying(NodeReason(node="n", reason=words, kind=kind))
