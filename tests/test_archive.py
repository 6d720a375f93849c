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


# --- sizes judged before writing, and damaged archives -------------------------------


class Zeros(io.RawIOBase):
    """`size` zero bytes, read in pieces: a bomb packed without holding it in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf: bytearray) -> int:  # type: ignore[override]
        n = min(len(buf), self.left)
        buf[:n] = bytes(n)
        self.left -= n
        return n


ZEROS = 30 << 20  # 30 MiB of zeros pack into about 30 kB


def zeros_tar(path: Path, size: int = ZEROS) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        tf.addfile(info("bin/llama-server", size=2, mode=0o755), io.BytesIO(b"#!"))
        tf.addfile(info("bin/zeros.bin", size=size), Zeros(size))
    return path


def test_a_member_far_larger_than_its_archive_is_refused_before_a_byte_is_written(
    dirs: tuple[Path, Path],
) -> None:
    root, dest = dirs
    path = zeros_tar(root / "zeros.tar.gz")
    packed = path.stat().st_size
    assert packed < ZEROS // 500, "the bomb is small on the wire"
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        f"zeros.tar.gz: member 'bin/zeros.bin' claims {ZEROS} bytes, {ZEROS / packed:.0f}× the "
        f"archive's {packed} bytes, over the 100× limit; refused"
    )
    assert everything_under(dest) == set(), "refused before anything was written"


def test_a_zip_member_far_larger_than_its_archive_is_refused(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = root / "zeros.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("build/bin/llama-server", b"#!")
        with zf.open("build/bin/zeros.bin", "w") as out:
            for _ in range(ZEROS >> 20):
                out.write(bytes(1 << 20))
    packed = path.stat().st_size
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        f"zeros.zip: member 'build/bin/zeros.bin' claims {ZEROS} bytes, {ZEROS / packed:.0f}× the "
        f"archive's {packed} bytes, over the 100× limit; refused"
    )
    assert everything_under(dest) == set()


def test_the_total_is_capped_and_the_member_that_crosses_it_named(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    data = os.urandom(3000)  # incompressible: the ratio stays near 1
    path = tar_with(root / "big.tar.gz", (info("a", size=3000), data), (info("b", size=3000), data))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest, Limits(max_total_bytes=5000))
    assert str(err.value) == (
        "big.tar.gz: member 'b' takes the total to 6000 bytes, over the 5000-byte limit; refused"
    )
    assert everything_under(dest) == set()


def text_payload(seed: int, size: int) -> bytes:
    """Compressible, deterministic bytes (words from a seeded generator)."""
    import random

    r = random.Random(seed)
    words = [bytes(r.choice(b"abcdefghijklmnop") for _ in range(r.randint(3, 9))) for _ in range(300)]
    out = bytearray()
    while len(out) < size:
        out += r.choice(words) + b" "
    return bytes(out[:size])


def tar_bytes(*members: tuple[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members:
            tf.addfile(info(name, size=len(data), mode=0o755), io.BytesIO(data))
    return buf.getvalue()


def broken_deflate(tar: bytes, good_bytes: int) -> bytes:
    """A gzip stream whose first `good_bytes` of tar decompress, followed by a deflate block of
    the reserved type 3: zlib stops there with `invalid block type`, as on a damaged download."""
    import zlib

    c = zlib.compressobj(9, zlib.DEFLATED, 31)  # 31: gzip framing
    head = c.compress(tar[:good_bytes]) + c.flush(zlib.Z_FULL_FLUSH)
    return head + b"\x06" + os.urandom(64)


TWO_MEMBERS = (
    ("llama/llama-server", text_payload(1, 100_000)),
    ("llama/libggml.so", text_payload(2, 100_000)),
)


def test_a_broken_deflate_stream_is_refused_naming_the_member_nothing_written(
    dirs: tuple[Path, Path],
) -> None:
    root, dest = dirs
    tar = tar_bytes(*TWO_MEMBERS)
    path = root / "broken.tar.gz"
    path.write_bytes(broken_deflate(tar, 150_000))  # halfway through the second member
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        "broken.tar.gz: cannot read member 'llama/libggml.so': Error -3 while decompressing data: "
        "invalid block type; the archive is corrupt or truncated, refused"
    )
    assert everything_under(dest) == set(), "what the first member wrote is removed"


def test_a_truncated_stream_is_refused_naming_the_member(dirs: tuple[Path, Path]) -> None:
    import gzip

    root, dest = dirs
    packed = gzip.compress(tar_bytes(*TWO_MEMBERS), mtime=0)
    path = root / "cut.tar.gz"
    path.write_bytes(packed[: len(packed) * 3 // 4])
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        "cut.tar.gz: cannot read member 'llama/libggml.so': Compressed file ended before the "
        "end-of-stream marker was reached; the archive is corrupt or truncated, refused"
    )
    assert everything_under(dest) == set()


def test_a_damaged_checksum_at_the_end_of_the_stream_is_caught(dirs: tuple[Path, Path]) -> None:
    import gzip

    root, dest = dirs
    packed = bytearray(gzip.compress(tar_bytes(*TWO_MEMBERS), mtime=0))
    packed[-8] ^= 0xFF  # gzip's CRC-32 of the whole stream, after the tar's end blocks
    path = root / "crc.tar.gz"
    path.write_bytes(bytes(packed))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value).startswith("crc.tar.gz: cannot read member 'llama/libggml.so': CRC check failed ")
    assert everything_under(dest) == set()


def test_a_refused_tar_removes_what_it_wrote_and_keeps_what_was_there(dirs: tuple[Path, Path]) -> None:
    """A tar is unpacked in one pass, so members before a refused one are written first; the
    runtime archive unpacks beside the main build, which must survive its refusal."""
    root, dest = dirs
    (dest / "build" / "bin").mkdir(parents=True)
    (dest / "build" / "bin" / "llama-server").write_bytes(b"main")
    path = tar_with(
        root / "cudart.tar.gz",
        (info("libcudart.so.12", size=3), b"elf"),
        (info("build/bin/libcublas.so.12", size=3), b"elf"),
        (info("lib", kind=tarfile.DIRTYPE, mode=0o755), None),
        (info("lib/libcublasLt.so.12", size=3), b"elf"),
        (info("lib/libcublasLt.so", kind=tarfile.SYMTYPE, link="libcublasLt.so.12"), None),
        (info("../escape", size=3), b"bad"),
    )
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == "cudart.tar.gz: member '../escape' climbs out with '..'; refused"
    assert everything_under(dest) == {"build", "build/bin", "build/bin/llama-server"}
    assert (dest / "build" / "bin" / "llama-server").read_bytes() == b"main"


def test_a_zip_member_with_a_bad_crc_is_refused_naming_it(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = root / "bad.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("build/bin/llama-server", text_payload(3, 50_000))
    data = bytearray(path.read_bytes())
    central = data.index(b"PK\x01\x02")
    data[central + 16] ^= 0xFF  # the CRC-32 that zipfile checks the data against
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        "bad.zip: cannot read member 'build/bin/llama-server': Bad CRC-32 for file "
        "'build/bin/llama-server'; the archive is corrupt or truncated, refused"
    )


def test_a_zip_member_in_an_unknown_compression_method_is_refused(dirs: tuple[Path, Path]) -> None:
    root, dest = dirs
    path = zip_with(root / "zstd.zip", ("build/bin/llama-server", b"#!", 0o100755))
    data = bytearray(path.read_bytes())
    for header, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = data.index(header)
        data[at + offset : at + offset + 2] = (93).to_bytes(2, "little")  # 93: zstd
    path.write_bytes(bytes(data))
    with pytest.raises(ArchiveError) as err:
        extract(path, dest)
    assert str(err.value) == (
        "zstd.zip: member 'build/bin/llama-server' uses compression method 93, "
        "not one of bzip2, deflate, lzma, stored; refused"
    )
    assert everything_under(dest) == set()


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "junk.tar.gz",
            b"not gzip at all",
            "junk.tar.gz: not a readable tar archive: not a gzip file; refused",
        ),
        (
            "junk.zip",
            b"PK not really",
            "junk.zip: not a readable zip archive: File is not a zip file; refused",
        ),
        ("empty.tar.gz", b"", "empty.tar.gz: not a readable tar archive: empty file; refused"),
    ],
)
def test_files_that_are_not_archives_are_refused(
    dirs: tuple[Path, Path], name: str, content: bytes, message: str
) -> None:
    root, dest = dirs
    (root / name).write_bytes(content)
    with pytest.raises(ArchiveError) as err:
        extract(root / name, dest)
    assert str(err.value) == message
