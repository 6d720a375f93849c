"""Hostile archives, tar and zip: each refused naming the member, nothing written outside."""

from __future__ import annotations

import io
import os
import stat
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw_installer.archive import ArchiveError, Limits, extract

Builder = Callable[[Path], Path]


def tar_with(path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def info(
    name: str, *, kind: bytes = tarfile.REGTYPE, size: int = 0, link: str = "", mode: int = 0o644
) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.size = size
    ti.linkname = link
    ti.mode = mode
    return ti


def zip_with(path: Path, *members: tuple[str, bytes, int]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data, mode in members:
            zi = zipfile.ZipInfo(name)
            zi.external_attr = mode << 16
            zf.writestr(zi, data)
    return path


def everything_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    dest = tmp_path / "install" / "staging"
    dest.mkdir(parents=True)
    return tmp_path, dest


TAR_CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    (
        "dotdot",
        lambda p: tar_with(p, (info("../escape", size=3), b"bad")),
        "evil.tar.gz: member '../escape' climbs out with '..'; refused",
    ),
    (
        "absolute",
        lambda p: tar_with(p, (info("/abs/path", size=3), b"bad")),
        "evil.tar.gz: member '/abs/path' has an absolute path; refused",
    ),
    (
        "symlink-then-write",
        lambda p: tar_with(
            p,
            (info("etc", kind=tarfile.SYMTYPE, link="/etc"), None),
            (info("etc/llmgw-pwned", size=3), b"bad"),
        ),
        "evil.tar.gz: symlink 'etc' points to absolute path '/etc'; refused",
    ),
    (
        "relative-symlink-out",
        lambda p: tar_with(p, (info("bin/up", kind=tarfile.SYMTYPE, link="../../outside"), None)),
        "evil.tar.gz: symlink 'bin/up' points outside the install dir ('../../outside'); refused",
    ),
    (
        "hardlink-out",
        lambda p: tar_with(p, (info("passwd", kind=tarfile.LNKTYPE, link="/etc/passwd"), None)),
        "evil.tar.gz: hardlink 'passwd' points outside the install dir ('/etc/passwd'); refused",
    ),
    (
        "device",
        lambda p: tar_with(p, (info("dev/sda", kind=tarfile.BLKTYPE), None)),
        "evil.tar.gz: member 'dev/sda' is a device or fifo; refused",
    ),
    (
        "fifo",
        lambda p: tar_with(p, (info("pipe", kind=tarfile.FIFOTYPE), None)),
        "evil.tar.gz: member 'pipe' is a device or fifo; refused",
    ),
    (
        "ten-gigabytes",
        lambda p: tar_with(p, (info("huge.bin", size=10 << 30), None)),
        "evil.tar.gz: member 'huge.bin' claims 10737418240 bytes, over the 3221225472-byte limit; refused",
    ),
]


@pytest.mark.parametrize(("case", "build", "message"), TAR_CASES, ids=[c[0] for c in TAR_CASES])
def test_hostile_tar_is_refused_naming_the_member(
    dirs: tuple[Path, Path], case: str, build: Builder, message: str
) -> None:
    root, dest = dirs
    archive = build(root / "evil.tar.gz")
    before = everything_under(root)
    with pytest.raises(ArchiveError) as err:
        extract(archive, dest)
    assert str(err.value) == message
    assert everything_under(root) == before, "nothing written anywhere"
    assert not Path("/etc/llmgw-pwned").exists()


def test_tar_with_100000_entries_is_refused(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = root / "many.tar.gz"
    with tarfile.open(path, "w:gz") as tf:
        for i in range(100_000):
            tf.addfile(info(f"f{i}"), io.BytesIO(b""))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == "many.tar.gz: more than 20000 entries; refused"
    assert everything_under(dest) == set()


def test_tar_setuid_is_stripped_and_internal_symlinks_kept(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = tar_with(
        root / "good.tar.gz",
        (info("bin/llama-server", size=2, mode=0o4755), b"#!"),
        (info("bin/libllama.so.0.6.0", size=3), b"elf"),
        (info("bin/libllama.so.0", kind=tarfile.SYMTYPE, link="libllama.so.0.6.0"), None),
        (info("bin/libllama.so", kind=tarfile.SYMTYPE, link="libllama.so.0"), None),
    )
    extract(path, dest)
    mode = (dest / "bin/llama-server").stat().st_mode
    assert not mode & stat.S_ISUID
    assert mode & stat.S_IXUSR
    assert os.readlink(dest / "bin/libllama.so") == "libllama.so.0"
    assert (dest / "bin/libllama.so").read_bytes() == b"elf"


ZIP_CASES: list[tuple[str, Callable[[Path], Path], str]] = [
    (
        "dotdot",
        lambda p: zip_with(p, ("../escape", b"bad", 0o100644)),
        "evil.zip: member '../escape' climbs out with '..'; refused",
    ),
    (
        "absolute",
        lambda p: zip_with(p, ("/abs/path", b"bad", 0o100644)),
        "evil.zip: member '/abs/path' has an absolute path; refused",
    ),
    (
        "backslash",
        lambda p: zip_with(p, ("..\\evil.dll", b"bad", 0o100644)),
        "evil.zip: member '..\\\\evil.dll' has a backslash in its path; refused",
    ),
    (
        "symlink-then-write",
        lambda p: zip_with(p, ("etc", b"/etc", 0o120777), ("etc/llmgw-pwned", b"bad", 0o100644)),
        "evil.zip: symlink 'etc' points to absolute path '/etc'; refused",
    ),
    (
        "device",
        lambda p: zip_with(p, ("dev/sda", b"", 0o060644)),
        "evil.zip: member 'dev/sda' is a device or fifo; refused",
    ),
]


@pytest.mark.parametrize(("case", "build", "message"), ZIP_CASES, ids=[c[0] for c in ZIP_CASES])
def test_hostile_zip_is_refused_naming_the_member(
    dirs: tuple[Path, Path], case: str, build: Builder, message: str
) -> None:
    root, dest = dirs
    archive = build(root / "evil.zip")
    before = everything_under(root)
    with pytest.raises(ArchiveError) as err:
        extract(archive, dest)
    assert str(err.value) == message
    assert everything_under(root) == before
    assert not Path("/etc/llmgw-pwned").exists()


def test_zip_with_100000_entries_is_refused(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = root / "many.zip"
    with zipfile.ZipFile(path, "w") as zf:
        for i in range(100_000):
            zf.writestr(f"f{i}", b"")
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == "many.zip: more than 20000 entries; refused"
    assert everything_under(dest) == set()


def test_zip_member_claiming_more_than_the_limit_is_refused(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = zip_with(root / "big.zip", ("huge.bin", b"x", 0o100644))
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")
    data[central + 24 : central + 28] = (0xFFFFFFF0).to_bytes(4, "little")  # uncompressed size: ~4.3 GB
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert (
        str(err.value)
        == "big.zip: member 'huge.bin' claims 4294967280 bytes, over the 3221225472-byte limit; refused"
    )
    assert everything_under(dest) == set()


def test_zip_setuid_stripped_symlinks_kept_and_a_lying_size_caught(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = zip_with(
        root / "good.zip",
        ("build/bin/llama-server", b"#!", 0o104755),
        ("build/bin/libllama.so.0.6.0", b"elf", 0o100644),
        ("build/bin/libllama.so", b"libllama.so.0.6.0", 0o120777),
    )
    extract(path, dest)
    assert not (dest / "build/bin/llama-server").stat().st_mode & stat.S_ISUID
    assert (dest / "build/bin/libllama.so").read_bytes() == b"elf"
    small = Limits(max_member_bytes=1)
    with pytest.raises(ArchiveError) as err:
        extract(zip_with(root / "two.zip", ("a", b"abc", 0o100644)), root / "install" / "other", small)
    assert "member 'a' claims 3 bytes, over the 1-byte limit" in str(err.value)
