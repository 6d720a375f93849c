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
"""

from __future__ import annotations

import os
import posixpath
import stat
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath


class ArchiveError(Exception):
    """The archive was refused; nothing outside the destination was written."""


@dataclass(frozen=True)
class Limits:
    max_entries: int = 20_000
    max_member_bytes: int = 3 << 30
    max_total_bytes: int = 16 << 30


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


def _count_size(archive: str, name: str, size: int, total: int, limits: Limits) -> int:
    """The running total with this member added, or ArchiveError for a member or archive too large."""
    if size > limits.max_member_bytes:
        raise ArchiveError(
            f"{archive}: member {name!r} claims {size} bytes, "
            f"over the {limits.max_member_bytes}-byte limit; refused"
        )
    total += size
    if total > limits.max_total_bytes:
        raise ArchiveError(f"{archive}: more than {limits.max_total_bytes} bytes in all; refused")
    return total


def check_tar(tf: tarfile.TarFile, archive: str, limits: Limits) -> list[tarfile.TarInfo]:
    members = []
    total = 0
    links: dict[str, str] = {}
    for count, m in enumerate(tf, start=1):
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
        total = _count_size(archive, m.name, m.size, total, limits)
        members.append(m)
    return members


def extract_tar(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    archive = path.name
    try:
        with tarfile.open(path, "r:*") as tf:
            members = check_tar(tf, archive, limits)
            for m in members:
                m.mode &= ~(stat.S_ISUID | stat.S_ISGID)
            try:
                tf.extractall(dest, members=members, filter="data")
            except tarfile.FilterError as exc:
                raise ArchiveError(f"{archive}: {exc}; refused") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        if isinstance(exc, ArchiveError):
            raise
        raise ArchiveError(f"{archive}: not a readable tar archive: {exc}") from exc


def _zip_mode(info: zipfile.ZipInfo) -> int:
    return (info.external_attr >> 16) & 0xFFFF


def extract_zip(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    archive = path.name
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise ArchiveError(f"{archive}: not a readable zip archive: {exc}") from exc
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
                target = zf.read(info).decode("utf-8", "replace")
                _link_inside(name, target, archive, "symlink")
                links[str(name)] = target
            total = _count_size(archive, info.filename, info.file_size, total, limits)
            plan.append((info, name, mode))
        for info, name, mode in plan:
            target_path = dest.joinpath(*name.parts) if name.parts else dest
            kind = stat.S_IFMT(mode)
            if info.is_dir():
                target_path.mkdir(parents=True, exist_ok=True)
                continue
            target_path.parent.mkdir(parents=True, exist_ok=True)
            if kind == stat.S_IFLNK:
                os.symlink(links[str(name)], target_path)
                continue
            written = 0
            with zf.open(info) as src, open(target_path, "xb") as out:
                while chunk := src.read(1 << 20):
                    written += len(chunk)
                    # The header's size is a claim; the stream is what counts.
                    if written > limits.max_member_bytes or written > info.file_size:
                        raise ArchiveError(
                            f"{archive}: member {info.filename!r} is larger than it claims; refused"
                        )
                    out.write(chunk)
            perms = mode & 0o777 if mode else 0o644
            os.chmod(target_path, perms & ~(stat.S_ISUID | stat.S_ISGID))


def extract(path: Path, dest: Path, limits: Limits = Limits()) -> None:
    """Unpack a .tar.gz/.tgz/.tar.xz/.tar or .zip into `dest` (which must exist and be empty)."""
    name = path.name
    if name.endswith(".zip"):
        extract_zip(path, dest, limits)
    elif name.endswith((".tar.gz", ".tgz", ".tar.xz", ".tar", ".tar.zst")):
        extract_tar(path, dest, limits)
    else:
        raise ArchiveError(f"{name}: unknown archive type (expected .tar.gz or .zip)")
