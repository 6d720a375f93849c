"""Seeing an engine run: `ldd` for missing libraries, `--version` with a timeout, parsed.

An engine is reported only after these pass: a binary that cannot start for
want of libgomp.so.1 must not look installed.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

# llama.cpp prints `version: 6789 (abc123)` or `version: 0.5.0-dev (build N, commit H)` on stderr.
_VERSION_BUILD = re.compile(r"version:\s*(\d+)\s*\(([0-9a-f]+|unknown)\)")
_VERSION_SEMVER = re.compile(r"version:\s*([0-9][\w.\-+]*)\s*\(build\s*(\d+),\s*commit\s*(\w+)\)")

# What a missing library is usually packaged as on Debian/Ubuntu, for the fix in the message.
DEBIAN_PACKAGE_FOR = {
    "libgomp.so.1": "libgomp1",
    "libssl.so.3": "libssl3",
    "libcrypto.so.3": "libssl3",
    "libcurl.so.4": "libcurl4",
    "libstdc++.so.6": "libstdc++6",
    "libvulkan.so.1": "libvulkan1",
}


class CheckError(Exception):
    """An engine binary did not pass its checks; the message is the node's reason."""


@dataclass(frozen=True)
class Version:
    text: str
    build: str = ""
    commit: str = ""


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
        done = subprocess.run(
            ["ldd", str(binary)], capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        return []  # no ldd (musl, minimal images): --version still has to pass
    except subprocess.TimeoutExpired as exc:
        raise CheckError(f"ldd {binary.name} timed out after {timeout:g}s") from exc
    missing = set()
    for line in done.stdout.splitlines():
        if "=> not found" in line:
            missing.add(line.split("=>", 1)[0].strip())
    return sorted(missing)


def describe_missing(binary: Path, missing: list[str]) -> str:
    libs = ", ".join(missing)
    packages = sorted({DEBIAN_PACKAGE_FOR[m] for m in missing if m in DEBIAN_PACKAGE_FOR})
    fix = f"; install {' '.join(packages)}" if packages else ""
    return f"{libs} not found (needed by {binary.name}){fix}"


def run_version(argv: list[str], timeout: float = 20.0, env: dict[str, str] | None = None) -> str:
    """Run a `--version`-style command; its combined output, or CheckError saying what went wrong."""
    name = Path(argv[0]).name
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError as exc:
        raise CheckError(f"{argv[0]}: not found") from exc
    except PermissionError as exc:
        raise CheckError(f"{argv[0]}: not executable") from exc
    except subprocess.TimeoutExpired as exc:
        raise CheckError(f"{name} {' '.join(argv[1:])} did not finish within {timeout:g}s") from exc
    output = (done.stdout or "") + (done.stderr or "")
    if done.returncode != 0:
        last = output.strip().splitlines()[-3:]
        raise CheckError(
            f"{name} {' '.join(argv[1:])} exited with code {done.returncode}: "
            + (" | ".join(last) if last else "no output")
        )
    return output


def check_binary(binary: Path, timeout: float = 20.0) -> Version:
    """ldd then `--version`; the parsed version or CheckError with the operator's sentence."""
    if not binary.exists():
        raise CheckError(f"{binary} does not exist")
    missing = missing_libraries(binary)
    if missing:
        raise CheckError(describe_missing(binary, missing))
    output = run_version([str(binary), "--version"], timeout)
    version = parse_version(output)
    if version is None:
        raise CheckError(f"{binary.name} --version printed no version line: {output.strip()[:200]!r}")
    return version
