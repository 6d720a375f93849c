"""Seeing an engine run: `ldd` for missing libraries, `--version` with a timeout, parsed.

An engine is reported only after these pass: a binary that cannot start for
want of libgomp.so.1 must not look installed. Both run through `run_bounded`,
so a check that hangs is killed with everything it started.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from . import ospkg
from .errors import CheckError
from .process import TimedOut, run_bounded

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
