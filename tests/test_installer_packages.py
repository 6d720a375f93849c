"""OS packages: what ldd says is missing, mapped to the distribution's names, installed after
the package index is refreshed. Through the package-manager and ldd seams, and once for real."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import EngineSpec
from llmgw_core.installed import installed
from llmgw_installer import Installer
from llmgw_installer.checks import missing_libraries
from llmgw_installer.ospkg import Apt, packages_for
from tests.installer_support import (
    ASSET,
    LLAMA,
    RecordingPackages,
    agent,
    build_server,
    converge,
    engine,
    install_events,
    pack,
    release_server,
    want,
)

pytestmark = pytest.mark.anyio


def test_sonames_map_to_each_distributions_package_names() -> None:
    libs = ["libgomp.so.1", "libcrypto.so.3", "libssl.so.3", "libllmgw-unknown.so.7"]
    assert packages_for("apt", libs) == (["libgomp1", "libssl3"], ["libllmgw-unknown.so.7"])
    assert packages_for("dnf", libs) == (["libgomp", "openssl-libs"], ["libllmgw-unknown.so.7"])


def fake_ldd(pm: RecordingPackages, needs: dict[str, str]) -> object:
    """ldd for binaries named in `needs` (file name -> soname): missing until `pm` provided it."""

    def ldd(binary: Path, timeout: float) -> list[str]:
        lib = next((soname for part, soname in needs.items() if part in str(binary)), None)
        return [lib] if lib is not None and lib not in pm.provided else missing_libraries(binary, timeout)

    return ldd


@pytest.mark.parametrize(("kind", "package"), [("apt", "libgomp1"), ("dnf", "libgomp")])
async def test_the_packages_come_from_what_ldd_says_is_missing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, kind: str, package: str
) -> None:
    pm = RecordingPackages(kind, provides={package: ("libgomp.so.1",)})
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel, install_events(bus) as events:
        rel.add_file(archive)
        await want(bus, LLAMA)
        config = agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=True)
        status = await converge(config, bus, packages=pm, ldd=fake_ldd(pm, {"llama-server": "libgomp.so.1"}))
    assert engine(status)["state"] == "installed"
    assert pm.calls == ["refresh", f"install {package}"], "the index is refreshed before installing"
    messages = [e.message for e in events]
    assert f"installing: refreshing the {kind} package index" in messages
    assert f"installing: {kind} install {package} (for libgomp.so.1)" in messages
    steps = [e.step for i, e in enumerate(events) if i == 0 or events[i - 1].step != e.step]
    assert steps == [
        "resolving",
        "downloading",
        "verifying",
        "unpacking",
        "checking",
        "packages",
        "checking",
        "version",
        "installed",
    ]


async def test_the_index_is_refreshed_once_per_run_however_many_installs_need_packages(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # Two builds in one pass: b9999 from the release API, b9998 from a mirror directory.
    pm = RecordingPackages("apt", provides={"libgomp1": ("libgomp.so.1",), "libssl3": ("libssl.so.3",)})
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    other = pack(mirror / "llama-b9998-bin-ubuntu-x64.tar.gz", {"llama-server": build_server(tmp_path / "c")})
    (mirror / "SHA256SUMS").write_text(f"{hashlib.sha256(other.read_bytes()).hexdigest()}  {other.name}\n")
    ldd = fake_ldd(pm, {"b9999": "libgomp.so.1", "b9998": "libssl.so.3"})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA, EngineSpec(name="llamacpp", version="b9998", source=f"mirror:{mirror}"))
        config = agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=True)
        await converge(config, bus, packages=pm, ldd=ldd)
        assert pm.calls == ["refresh", "install libgomp1", "install libssl3"]
        # A new run refreshes again, before its first install.
        pm.provided.clear()
        fresh = msgspec.structs.replace(config, state_dir=str(tmp_path / "s2"))
        await converge(fresh, bus, packages=pm, ldd=ldd)
    assert pm.calls[3:] == ["refresh", "install libgomp1", "install libssl3"]


async def test_with_os_packages_disallowed_the_node_names_what_to_install(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    pm = RecordingPackages("apt")
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=False),
            bus,
            packages=pm,
            ldd=fake_ldd(pm, {"llama-server": "libgomp.so.1"}),
        )
    assert engine(status)["detail"] == (
        "libgomp.so.1 not found (needed by llama-server); install libgomp1 "
        "(allow_os_packages is false: llmgw does not install them)"
    )
    assert pm.calls == []
    assert installed(tmp_path / "state") == {}


async def test_a_library_still_missing_after_the_install_fails_the_install(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    pm = RecordingPackages("dnf")  # installs, but provides nothing
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=True),
            bus,
            packages=pm,
            ldd=fake_ldd(pm, {"llama-server": "libgomp.so.1"}),
        )
    assert engine(status)["detail"] == (
        "libgomp.so.1 not found (needed by llama-server); install libgomp "
        "(still missing after installing packages)"
    )
    assert pm.calls == ["refresh", "install libgomp"]


async def test_a_node_without_a_package_manager_says_so(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    pm = RecordingPackages()
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        inst = Installer(
            agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=True),
            bus,
            packages=False,
            ldd=fake_ldd(pm, {"llama-server": "libgomp.so.1"}),  # type: ignore[arg-type]
            retry_backoff_s=0.05,
        )
        await inst.load_desired()
        status = await inst.converge_once()
    assert status is not None
    assert engine(status)["detail"] == (
        "libgomp.so.1 not found (needed by llama-server); install libgomp1 "
        "(this node has neither apt nor dnf)"
    )


# --- the real thing ------------------------------------------------------------------------

REAL_LIB, REAL_PACKAGE = "libvulkan.so.1", "libvulkan1"  # about 150 kB, depends only on libc6


def _dpkg_installed(package: str) -> bool:
    done = subprocess.run(["dpkg", "-s", package], capture_output=True, text=True, check=False)
    return done.returncode == 0 and "Status: install ok installed" in done.stdout


def _real_apt_or_skip() -> None:
    if os.geteuid() != 0:
        pytest.skip("installing a real package needs root")
    if not (shutil.which("apt-get") and shutil.which("dpkg")):
        pytest.skip("installing a real package needs apt-get and dpkg (Debian or Ubuntu)")
    if _dpkg_installed(REAL_PACKAGE):
        pytest.skip(
            f"{REAL_PACKAGE} is already installed here; this test installs only what the machine lacks"
        )
    done = subprocess.run(["apt-get", "update"], capture_output=True, text=True, check=False, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"apt-get update failed, no package mirror reachable: {done.stderr.strip()[-200:]}")


async def test_apt_for_real_installs_the_library_ldd_found_missing(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    _real_apt_or_skip()
    # A llama-server linked against libvulkan.so.1 (through a stub that is not shipped).
    server = build_server(tmp_path / "b", needs=REAL_LIB)
    assert missing_libraries(server) == [REAL_LIB]
    archive = pack(tmp_path / ASSET, {"llama-server": server})
    try:
        async with release_server() as rel, install_events(bus) as events:
            rel.add_file(archive)
            await want(bus, LLAMA)
            status = await converge(
                agent(tmp_path, nats_url, prefix, rel.api, allow_os_packages=True), bus, packages=Apt()
            )
        assert engine(status)["state"] == "installed", engine(status)
        assert _dpkg_installed(REAL_PACKAGE)
        messages = [e.message for e in events]
        assert "installing: refreshing the apt package index" in messages
        assert f"installing: apt install {REAL_PACKAGE} (for {REAL_LIB})" in messages
    finally:
        # Only what this test installed: the package was absent when it started.
        if _dpkg_installed(REAL_PACKAGE):
            subprocess.run(["dpkg", "--purge", REAL_PACKAGE], capture_output=True, check=True, timeout=300)
    assert not _dpkg_installed(REAL_PACKAGE)
