"""Unpacking release archives without ever writing outside the install directory.

tar: Python's own `data` extraction filter (PEP 706) does the heavy lifting;
before it runs, every member is checked here so that a hostile archive is
refused, naming the member, rather than silently rewritten: absolute paths,
`..`, device nodes and fifos, links that resolve outside, and size or
entry-count bombs. setuid/setgid bits are stripped (the filter does too).

zip has no such filter: the same rules are applied by hand, including its
own (symlinks encoded in the external attributes, names with backslashes or
drive letters).

The archive's own internal symlinks are kept: llama.cpp ships `.so` chains
(`libllama.so -> libllama.so.0 -> libllama.so.0.6.0`).

Sizes are judged before a member is written: a member whose declared size
is over `max_ratio` times the archive's own (compressed) size, or that takes
the total over `max_total_bytes`, is refused naming the member; a 300 MB
member of zeros packs into 300 kB and must not fill the disk to be noticed.
tar copies exactly the size its header declares; a zip member's stream is
counted while it is written and cut off at the declared size.

A corrupt or truncated archive (its published sha256 may well match: the
release itself is broken) is refused naming the member being read and what
the decompressor said. A tar stream is decompressed once: each member is
checked when its header is read and written before the next is read; after
the last, the stream is read to its end, the compressor's checksum included.
Whatever a refused archive had written by then is removed, so a hostile or
broken archive never leaves half a tree.
"""

from __future__ import annotations

import gzip
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

from .errors import ArchiveError

# What reading a damaged archive raises, from tarfile, zipfile and the decompressors.
_READ_ERRORS = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    zlib.error,
    lzma.LZMAError,
    gzip.BadGzipFile,
)

_TAR_MODES: dict[str, Literal["r:gz", "r:xz", "r:"]] = {
    ".tar.gz": "r:gz",
    ".tgz": "r:gz",
    ".tar.xz": "r:xz",
    ".tar": "r:",
}

# tarfile copies a member's data in pieces of 16 kB unless told otherwise.
_COPY_BYTES = 1 << 20

_ZIP_METHODS = {
    zipfile.ZIP_STORED: "stored",
    zipfile.ZIP_DEFLATED: "deflate",
    zipfile.ZIP_BZIP2: "bzip2",
    zipfile.ZIP_LZMA: "lzma",
}


@dataclass(frozen=True)
class Limits:
    max_entries: int = 20_000
    max_member_bytes: int = 3 << 30
    max_total_bytes: int = 4 << 30
    # A member may unpack to at most this many times the archive's own size.
    max_ratio: float = 100.0


def _reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return text if text else type(exc).__name__


def _unreadable(archive: str, member: str | None, exc: BaseException) -> ArchiveError:
    where = f"member {member!r}" if member else "its first member"
    return ArchiveError(
        f"{archive}: cannot read {where}: {_reason(exc)}; the archive is corrupt or truncated, refused"
    )


def _check_name(name: str, archive: str) -> PurePosixPath:
    if not name or "\x00" in name:
        raise ArchiveError(f"{archive}: member with an empty or NUL name refused")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":") or name.startswith("\\"):
        raise ArchiveError(f"{archive}: member {name!r} has an absolute path; refused")
    if "\\" in name:
        raise ArchiveError(f"{archive}: member {name!r} has a backslash in its path; refused")
    parts = PurePosixPath(name).parts
    if ".." in parts:
        raise ArchiveError(f"{archive}: member {name!r} climbs out with '..'; refused")
    return PurePosixPath(*[p for p in parts if p not in (".", "")])


def _link_inside(member: PurePosixPath, target: str, archive: str, kind: str) -> None:
    """A link's target, resolved from the member's directory, must stay inside the archive root."""
    if target.startswith("/"):
        raise ArchiveError(f"{archive}: {kind} {str(member)!r} points to absolute path {target!r}; refused")
    resolved = posixpath.normpath(posixpath.join(str(member.parent), target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveError(
            f"{archive}: {kind} {str(member)!r} points outside the install dir ({target!r}); refused"
        )


def _count_size(archive: str, name: str, size: int, total: int, compressed: int, limits: Limits) -> int:
    """The running total with this member added, or ArchiveError for a member or archive too large.

    `compressed` is the archive's own size on disk (0: unknown, no ratio is judged).
    """
    if size > limits.max_member_bytes:
        raise ArchiveError(
            f"{archive}: member {name!r} claims {size} bytes, "
            f"over the {limits.max_member_bytes}-byte limit; refused"
        )
    ratio = size / compressed if compressed else 0.0
    if ratio > limits.max_ratio:
        raise ArchiveError(
            f"{archive}: member {name!r} claims {size} bytes, {ratio:.0f}× the archive's "
            f"{compressed} bytes, over the {limits.max_ratio:g}× limit; refused"
        )
    total += size
    if total > limits.max_total_bytes:
        raise ArchiveError(
            f"{archive}: member {name!r} takes the total to {total} bytes, "
            f"over the {limits.max_total_bytes}-byte limit; refused"
        )
    return total


class _Unpacking:
    """One pass over a tar stream: the member being read, to name it when the stream breaks; and
    what the pass has added under `dest`, to remove it when the archive is refused."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.member: str | None = None
        self.added: list[Path] = []

    def adding(self, name: PurePosixPath) -> None:
        """Writing `name` creates the first part of its path that does not exist yet: note it."""
        path = self.dest
        for part in name.parts:
            path = path / part
            if not os.path.lexists(path):
                self.added.append(path)
                return

    def remove_added(self) -> None:
        for path in reversed(self.added):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def checked_tar(
    tf: tarfile.TarFile, archive: str, limits: Limits, compressed: int, unpacking: _Unpacking
) -> Iterator[tarfile.TarInfo]:
    """Every member, checked (and setuid/setgid stripped) before it is handed on to be written;
    after the last, the rest of the stream, so that a damaged one fails the unpacking."""
    total = 0
    links: dict[str, str] = {}
    for count, m in enumerate(tf, start=1):
        unpacking.member = m.name
        if count > limits.max_entries:
            raise ArchiveError(f"{archive}: more than {limits.max_entries} entries; refused")
        name = _check_name(m.name, archive)
        if m.ischr() or m.isblk() or m.isfifo() or m.isdev():
            raise ArchiveError(f"{archive}: member {m.name!r} is a device or fifo; refused")
        if m.issym():
            _link_inside(name, m.linkname, archive, "symlink")
            links[str(name)] = m.linkname
        elif m.islnk():
            # Hardlink targets are paths from the archive root.
            target = m.linkname
            if target.startswith("/") or ".." in PurePosixPath(target).parts:
                raise ArchiveError(
                    f"{archive}: hardlink {m.name!r} points outside the install dir ({target!r}); refused"
                )
        elif not (m.isfile() or m.isdir()):
            raise ArchiveError(f"{archive}: member {m.name!r} has an unsupported type; refused")
        # A file written through a directory symlink that was unpacked earlier
        # ends up wherever that symlink points.
        for parent in name.parents:
            if str(parent) in links:
                raise ArchiveError(
                    f"{archive}: member {m.name!r} is written through symlink {str(parent)!r}; refused"
                )
        total = _count_size(archive, m.name, m.size, total, compressed, limits)
        m.mode &= ~(stat.S_ISUID | stat.S_ISGID)
        unpacking.adding(name)
        yield m
    # tarfile stops at the end-of-archive blocks; the compressor's own checksum
    # (gzip's CRC, xz's) sits after them and is only checked when read.
    fileobj = tf.fileobj
    if fileobj is not None:
        trailing = 0
        while chunk := fileobj.read(1 << 20):
            trailing += len(chunk)
            if trailing > limits.max_total_bytes:
                raise ArchiveError(
                    f"{archive}: more than {limits.max_total_bytes} bytes after the last member; refused"
                )


def extract_tar(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    archive = path.name
    unpacking = _Unpacking(dest)
    mode = _TAR_MODES[next(e for e in _TAR_MODES if archive.endswith(e))]
    try:
        compressed = path.stat().st_size
        tf = tarfile.open(path, mode)  # noqa: SIM115 (closed below; opening is what may fail here)
    except FileNotFoundError as exc:
        raise ArchiveError(f"{archive}: cannot open: {exc.strerror}") from exc
    except (*_READ_ERRORS, OSError) as exc:
        raise ArchiveError(f"{archive}: not a readable tar archive: {_reason(exc)}; refused") from exc
    with tf:
        tf.copybufsize = _COPY_BYTES  # type: ignore[attr-defined]  # (a TarFile argument typeshed lacks)
        try:
            try:
                # Members are read in order and each written as it comes: the stream is
                # decompressed once. (Checking them all first and then extracting the list
                # seeks back to the start: decompressing twice was most of an install's time.)
                members = checked_tar(tf, archive, limits, compressed, unpacking)
                tf.extractall(dest, members=members, filter="data")
            except tarfile.FilterError as exc:
                raise ArchiveError(f"{archive}: {exc}; refused") from exc
            except _READ_ERRORS as exc:
                raise _unreadable(archive, unpacking.member, exc) from exc
            except OSError as exc:  # the node's own disk: full, read-only, quota
                raise ArchiveError(
                    f"{archive}: cannot write member {unpacking.member!r}: {exc.strerror or exc}"
                ) from exc
        except BaseException:
            # A refused archive leaves nothing behind, however far the pass got.
            unpacking.remove_added()
            raise


def _zip_mode(info: zipfile.ZipInfo) -> int:
    return (info.external_attr >> 16) & 0xFFFF


def extract_zip(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    archive = path.name
    try:
        compressed = path.stat().st_size
        zf = zipfile.ZipFile(path)
    except (*_READ_ERRORS, OSError, ValueError) as exc:
        raise ArchiveError(f"{archive}: not a readable zip archive: {_reason(exc)}; refused") from exc
    with zf:
        infos = zf.infolist()
        if len(infos) > limits.max_entries:
            raise ArchiveError(f"{archive}: more than {limits.max_entries} entries; refused")
        total = 0
        links: dict[str, str] = {}
        plan: list[tuple[zipfile.ZipInfo, PurePosixPath, int]] = []
        for info in infos:
            name = _check_name(info.filename, archive)
            mode = _zip_mode(info)
            kind = stat.S_IFMT(mode)
            if kind in (stat.S_IFCHR, stat.S_IFBLK, stat.S_IFIFO, stat.S_IFSOCK):
                raise ArchiveError(f"{archive}: member {info.filename!r} is a device or fifo; refused")
            if info.flag_bits & 0x1:
                raise ArchiveError(f"{archive}: member {info.filename!r} is encrypted; refused")
            if info.compress_type not in _ZIP_METHODS:
                raise ArchiveError(
                    f"{archive}: member {info.filename!r} uses compression method {info.compress_type}, "
                    f"not one of {', '.join(sorted(_ZIP_METHODS.values()))}; refused"
                )
            for parent in name.parents:
                if str(parent) in links:
                    raise ArchiveError(
                        f"{archive}: member {info.filename!r} is written through symlink "
                        f"{str(parent)!r}; refused"
                    )
            if kind == stat.S_IFLNK:
                if info.file_size > 4096:
                    raise ArchiveError(
                        f"{archive}: symlink {info.filename!r} has a {info.file_size}-byte target; refused"
                    )
                try:
                    target = zf.read(info).decode("utf-8", "replace")
                except (*_READ_ERRORS, OSError) as exc:
                    raise _unreadable(archive, info.filename, exc) from exc
                _link_inside(name, target, archive, "symlink")
                links[str(name)] = target
            total = _count_size(archive, info.filename, info.file_size, total, compressed, limits)
            plan.append((info, name, mode))
        for info, name, mode in plan:
            _write_zip_member(zf, archive, info, name, mode, dest, links, limits)


def _write_zip_member(
    zf: zipfile.ZipFile,
    archive: str,
    info: zipfile.ZipInfo,
    name: PurePosixPath,
    mode: int,
    dest: Path,
    links: dict[str, str],
    limits: Limits,
) -> None:
    target_path = dest.joinpath(*name.parts) if name.parts else dest
    kind = stat.S_IFMT(mode)
    try:
        if info.is_dir():
            target_path.mkdir(parents=True, exist_ok=True)
            return
        target_path.parent.mkdir(parents=True, exist_ok=True)
        if kind == stat.S_IFLNK:
            os.symlink(links[str(name)], target_path)
            return
        out = open(target_path, "xb")  # noqa: SIM115 (closed below, with the source)
    except OSError as exc:
        raise ArchiveError(
            f"{archive}: cannot write member {info.filename!r}: {exc.strerror or exc}"
        ) from exc
    written = 0
    with out:
        try:
            src = zf.open(info)
        except (*_READ_ERRORS, OSError) as exc:
            raise _unreadable(archive, info.filename, exc) from exc
        with src:
            while True:
                try:
                    chunk = src.read(1 << 20)
                except (*_READ_ERRORS, OSError) as exc:
                    raise _unreadable(archive, info.filename, exc) from exc
                if not chunk:
                    break
                written += len(chunk)
                # The header's size is a claim; the stream is what counts.
                if written > limits.max_member_bytes or written > info.file_size:
                    raise ArchiveError(
                        f"{archive}: member {info.filename!r} is larger than it claims; refused"
                    )
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise ArchiveError(
                        f"{archive}: cannot write member {info.filename!r}: {exc.strerror or exc}"
                    ) from exc
    perms = mode & 0o777 if mode else 0o644
    os.chmod(target_path, perms & ~(stat.S_ISUID | stat.S_ISGID))


def extract(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    """Unpack a .tar.gz/.tgz/.tar.xz/.tar or .zip into `dest` (which must exist and be empty)."""
    name = path.name
    if name.endswith(".zip"):
        extract_zip(path, dest, limits)
    elif name.endswith(tuple(_TAR_MODES)):
        extract_tar(path, dest, limits)
    else:
        raise ArchiveError(f"{name}: unknown archive type (expected .tar.gz or .zip)")
