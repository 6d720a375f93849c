"""OS packages a build needs, installed through the node's own package manager (a seam for tests)."""

from __future__ import annotations

import shutil
import subprocess
from typing import Protocol

# Debian/Ubuntu names; dnf names differ.
CPU_PACKAGES = {"apt": ("libgomp1", "libssl3"), "dnf": ("libgomp", "openssl-libs")}
CUDA_PACKAGES = {"apt": ("libgomp1",), "dnf": ("libgomp",)}


class PackageManager(Protocol):
    kind: str

    def missing(self, packages: tuple[str, ...]) -> list[str]: ...

    def install(self, packages: list[str]) -> None: ...


class PackageError(Exception):
    pass


class Apt:
    kind = "apt"

    def missing(self, packages: tuple[str, ...]) -> list[str]:
        out = []
        for p in packages:
            r = subprocess.run(
                ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True, check=False
            )
            if "install ok installed" not in r.stdout:
                out.append(p)
        return out

    def install(self, packages: list[str]) -> None:
        r = subprocess.run(
            ["apt-get", "install", "-y", "--no-install-recommends", *packages],
            capture_output=True,
            text=True,
            check=False,
            timeout=900,
        )
        if r.returncode != 0:
            raise PackageError(f"apt-get install {' '.join(packages)} failed: {r.stderr.strip()[-300:]}")


class Dnf:
    kind = "dnf"

    def missing(self, packages: tuple[str, ...]) -> list[str]:
        return [
            p
            for p in packages
            if subprocess.run(["rpm", "-q", p], capture_output=True, check=False).returncode != 0
        ]

    def install(self, packages: list[str]) -> None:
        r = subprocess.run(
            ["dnf", "install", "-y", *packages], capture_output=True, text=True, check=False, timeout=900
        )
        if r.returncode != 0:
            raise PackageError(f"dnf install {' '.join(packages)} failed: {r.stderr.strip()[-300:]}")


def detect() -> PackageManager | None:
    if shutil.which("dpkg-query") and shutil.which("apt-get"):
        return Apt()
    if shutil.which("rpm") and shutil.which("dnf"):
        return Dnf()
    return None
