"""OS packages a build needs, installed through the node's own package manager (a seam for tests).

What a build needs is what `ldd` says is missing, mapped from the library's
soname to the distribution's package name. The package index is refreshed
(`apt-get update`, `dnf makecache`) before the first install of an install
run, so a node whose lists are stale or were never fetched (container images
ship none) can still install.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Protocol

from .errors import PackageError
from .process import TimedOut, run_bounded

# soname -> package, per package manager. Only libraries that llama.cpp builds
# link against and that distributions package; the CUDA runtime comes in the
# release's cudart archive and libcuda.so.1 with the NVIDIA driver, never from here.
PACKAGE_FOR: dict[str, dict[str, str]] = {
    "apt": {
        "libgomp.so.1": "libgomp1",
        "libssl.so.3": "libssl3",
        "libcrypto.so.3": "libssl3",
        "libcurl.so.4": "libcurl4",
        "libstdc++.so.6": "libstdc++6",
        "libgcc_s.so.1": "libgcc-s1",
        "libvulkan.so.1": "libvulkan1",
    },
    "dnf": {
        "libgomp.so.1": "libgomp",
        "libssl.so.3": "openssl-libs",
        "libcrypto.so.3": "openssl-libs",
        "libcurl.so.4": "libcurl",
        "libstdc++.so.6": "libstdc++",
        "libgcc_s.so.1": "libgcc",
        "libvulkan.so.1": "vulkan-loader",
    },
}


def packages_for(kind: str, libraries: Iterable[str]) -> tuple[list[str], list[str]]:
    """The packages that provide `libraries` on a `kind` system, and the libraries none known provides."""
    table = PACKAGE_FOR.get(kind, {})
    packages = sorted({table[lib] for lib in libraries if lib in table})
    unknown = sorted({lib for lib in libraries if lib not in table})
    return packages, unknown


class PackageManager(Protocol):
    kind: str

    def refresh(self) -> None:
        """Bring the package index up to date; PackageError if it cannot."""

    def install(self, packages: list[str]) -> None:
        """Install `packages`; PackageError naming them if it cannot."""


def _run(argv: list[str], timeout: float, what: str) -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        done = run_bounded(argv, timeout, env=env)
    except TimedOut as exc:
        raise PackageError(f"{what}: did not finish within {timeout:g}s") from exc
    except OSError as exc:
        raise PackageError(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from exc
    if done.returncode != 0:
        tail = " | ".join(done.output.strip().splitlines()[-3:]) or "no output"
        raise PackageError(f"{what} failed (exit code {done.returncode}): {tail}")


class Apt:
    kind = "apt"

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s = timeout_s

    def refresh(self) -> None:
        _run(["apt-get", "update"], self.timeout_s, "apt-get update")

    def install(self, packages: list[str]) -> None:
        _run(
            ["apt-get", "install", "-y", "--no-install-recommends", *packages],
            self.timeout_s,
            f"apt-get install {' '.join(packages)}",
        )


class Dnf:
    kind = "dnf"

    def __init__(self, timeout_s: float = 900.0) -> None:
        self.timeout_s = timeout_s

    def refresh(self) -> None:
        _run(["dnf", "makecache", "-y"], self.timeout_s, "dnf makecache")

    def install(self, packages: list[str]) -> None:
        _run(["dnf", "install", "-y", *packages], self.timeout_s, f"dnf install {' '.join(packages)}")


def detect() -> PackageManager | None:
    if shutil.which("dpkg-query") and shutil.which("apt-get"):
        return Apt()
    if shutil.which("rpm") and shutil.which("dnf"):
        return Dnf()
    return None
