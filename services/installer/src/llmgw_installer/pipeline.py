"""Installing one engine build, step by step, every step reported in the node's own words.

resolve release -> choose build -> download -> verify sha256 -> unpack (safely)
-> ldd every ELF file -> OS packages for what ldd found missing -> ldd again
-> --version -> marker, rename into place. Each step's event is published
when that step starts, so what the node says is what it is doing.

A crash anywhere leaves no marker; the next start removes the staging leftovers.
An expected failure is an InstallError (see `errors`), reported in its own
words; anything else is left to the service, which reports it as internal.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import msgspec

from llmgw_core.events import EngineSpec, EngineState, InstallProgress, NodeFacts, now
from llmgw_core.installed import MARKER, InstalledEngine, read_marker

from . import ospkg
from .archive import Limits, extract
from .builds import Asset, choose_again, choose_build
from .checks import describe_missing, missing_libraries, version_of
from .download import download
from .errors import CheckError, InstallError
from .release import CONFIGURED, github_assets, mirror_assets, parse_source
from .wheels import Share

SERVER = "llama-server"
RPC_SERVERS = ("ggml-rpc-server", "rpc-server")

Report = Callable[[InstallProgress], Awaitable[None]]
# The ldd seam: the libraries `binary` needs that cannot be found, within `timeout` seconds.
Ldd = Callable[[Path, float], list[str]]


class InstallFailed(InstallError):
    pass


@dataclass
class InstallContext:
    """What one converge pass shares between the installs it runs."""

    node: str
    root: Path
    facts: NodeFacts
    client: httpx.AsyncClient
    report: Report
    github_api: str = "https://api.github.com"
    mirror: str = ""
    packages: ospkg.PackageManager | None = None
    allow_os_packages: bool = True
    version_timeout_s: float = 20.0
    # Each step of building a vLLM or SGLang environment: importing vLLM alone takes 20 s
    # of a busy core.
    env_timeout_s: float = 600.0
    ldd_timeout_s: float = 15.0
    retry_backoff_s: float = 1.0
    retry_cap_s: float = 30.0
    attempts: int = 3
    limits: Limits = field(default_factory=Limits)
    ldd: Ldd = missing_libraries
    # The package index is refreshed at most once per pass, before its first install.
    packages_refreshed: bool = False
    # The node's claims and its peers' statuses, for engine wheels shared between nodes.
    wheels: Share | None = None


def mb(n: int) -> str:
    """Sizes as people read them: `16 MB`, `480 kB`."""
    if not n:
        return "size unknown"
    if n < 1_000_000:
        return f"{max(1, round(n / 1000))} kB"
    return f"{round(n / 1_000_000)} MB"


def clean_staging(root: Path) -> list[str]:
    """Remove what an interrupted install left; returns what was removed."""
    staging = root / ".staging"
    removed = []
    if staging.is_dir():
        for leftover in sorted(staging.iterdir()):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover.name)
    for engine_dir in (
        (p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")) if root.is_dir() else ()
    ):
        for build_dir in engine_dir.iterdir():
            if build_dir.is_dir() and not (build_dir / MARKER).exists():
                shutil.rmtree(build_dir, ignore_errors=True)
                removed.append(f"{engine_dir.name}/{build_dir.name}")
    return removed


def elf_files(bin_dir: Path) -> list[Path]:
    """Every ELF file in `bin_dir`: executables and the shared libraries llama.cpp loads at run time
    (its CPU backends are dlopen'ed, so ldd on llama-server alone misses what they need)."""
    out = []
    for p in sorted(bin_dir.iterdir()):
        if p.is_file() and not p.is_symlink():
            with p.open("rb") as f:
                if f.read(4) == b"\x7fELF":
                    out.append(p)
    return out


def find_bin_dir(tree: Path) -> Path:
    hits = sorted(tree.rglob(SERVER), key=lambda p: len(p.parts))
    hits = [h for h in hits if h.is_file()]
    if not hits:
        raise InstallFailed(f"the archive has no {SERVER}")
    return hits[0].parent


def missing_in(bin_dir: Path, ldd: Ldd, timeout: float) -> dict[str, str]:
    """Library -> the first file in `bin_dir` that needs it, for what ldd cannot find.

    A library that sits in `bin_dir` itself is not missing: a backend that llama-server
    dlopens finds libggml-base.so already loaded, whatever ldd says of the backend alone.
    """
    missing: dict[str, str] = {}
    for elf in elf_files(bin_dir):
        for lib in ldd(elf, timeout):
            if not (bin_dir / lib).exists():
                missing.setdefault(lib, elf.name)
    return missing


def check_installed(bin_dir: Path, ldd: Ldd, ldd_timeout: float, version_timeout: float) -> str:
    """ldd on every ELF file, then `llama-server --version`: the version as it says it, or CheckError."""
    missing = missing_in(bin_dir, ldd, ldd_timeout)
    if missing:
        raise CheckError(describe_missing(missing))
    return version_of(bin_dir / SERVER, version_timeout).full


def runtime_libraries(runtime_tree: Path, archive: str) -> dict[str, Path]:
    """The shared objects of a CUDA runtime archive, by file name, wherever in it they sit.

    llama.cpp packs them under a top-level directory named like the archive
    (`cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64/libcudart.so.12`); a mirror may
    pack them flat or under `lib64/`. Symlinks (`libcudart.so -> libcudart.so.12`)
    are kept as symlinks: their targets are file names beside them once merged.
    """
    found: dict[str, Path] = {}
    for path in sorted(runtime_tree.rglob("*.so*"), key=lambda p: (len(p.parts), str(p))):
        if not (path.is_symlink() or path.is_file()) or ".so" not in path.name:
            continue
        if path.name in found:
            raise InstallFailed(
                f"{archive} holds {path.name} twice ({found[path.name].relative_to(runtime_tree)} and "
                f"{path.relative_to(runtime_tree)}); refusing to guess which goes beside {SERVER}"
            )
        found[path.name] = path
    if not found:
        raise InstallFailed(f"{archive} holds no shared libraries (.so); it is not a CUDA runtime archive")
    for path in found.values():
        if path.is_symlink() and posixpath.basename(os.readlink(path)) not in found:
            raise InstallFailed(
                f"{archive}: {path.relative_to(runtime_tree)} points to {os.readlink(path)!r}, "
                "which is not among its libraries"
            )
    return found


def merge_runtime(runtime_tree: Path, bin_dir: Path, archive: str) -> list[str]:
    """Move the runtime's libraries beside llama-server, where its $ORIGIN rpath finds them;
    returns their names. A symlink whose target had a directory part is made to point to
    the file name beside it."""
    libs = runtime_libraries(runtime_tree, archive)
    for name, path in sorted(libs.items()):
        dest = bin_dir / name
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        if path.is_symlink():
            os.symlink(posixpath.basename(os.readlink(path)), dest)
            path.unlink()
        else:
            shutil.move(str(path), dest)
    return sorted(libs)


class Installation:
    def __init__(self, spec: EngineSpec, ctx: InstallContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.name = spec.name
        self.tag = spec.version

    async def step(
        self, step: str, message: str, outcome: str = "running", done: int = 0, total: int = 0
    ) -> None:
        await self.ctx.report(
            InstallProgress(
                node=self.ctx.node,
                engine=self.name,
                step=step,
                message=message,
                outcome=outcome,  # type: ignore[arg-type]
                bytes_done=done,
                bytes_total=total,
                at=now(),
            )
        )

    async def fail(self, step: str, reason: str) -> EngineState:
        await self.step(step, f"install failed: {reason}", "failed")
        return EngineState(name=self.name, state="failed", version=self.tag, detail=reason)

    async def run(self) -> EngineState:
        """Install (or recheck) the engine; an expected failure comes back as a `failed` state."""
        try:
            kind, _ = parse_source(self.spec.source)
        except InstallError as exc:
            return await self.fail("resolving", str(exc))
        if kind == CONFIGURED:
            return await self.fail(
                "resolving",
                f"{self.name} is to be configured on this node (source: configured), but agent.yaml "
                f"names no path for it; add engines: {{{self.name}: {{path: ...}}}} to agent.yaml",
            )
        if self.name != "llamacpp":
            return await self.fail(
                "resolving",
                f"{self.name} is not installed from releases; name its Python "
                f"environment under engines: in agent.yaml",
            )
        final = self.ctx.root / self.name / self.tag
        marker = read_marker(final)
        if marker is not None:
            why = choose_again(marker.asset, marker.cuda_driver, self.ctx.facts)
            if not why:
                return await self.recheck(final)
            await self.step(
                "resolving", f"installing: choosing the {self.name} {self.tag} build again: {why}"
            )
            try:
                return await self._install(final)
            except InstallError as exc:
                # What is installed still runs: it stays installed, saying why it was not replaced.
                await self.step(
                    "failed", f"could not replace the {self.name} {self.tag} build: {exc}", "failed"
                )
                state = await self.recheck(final)
                words = f"{why}; installing the build for it failed: {exc}"
                return msgspec.structs.replace(state, cpu_only=f"{state.cpu_only}; {words}".lstrip("; "))
        try:
            return await self._install(final)
        except InstallError as exc:
            return await self.fail("failed", str(exc))

    async def recheck(self, final: Path) -> EngineState:
        marker = read_marker(final)
        assert marker is not None
        bin_dir = Path(marker.bin_dir)
        seen = {"version": self.tag, "path": str(bin_dir), "cpu_only": marker.cpu_only}
        try:
            version = await anyio.to_thread.run_sync(
                check_installed, bin_dir, self.ctx.ldd, self.ctx.ldd_timeout_s, self.ctx.version_timeout_s
            )
        except CheckError as exc:
            return EngineState(
                name=self.name, state="broken", engine_version=marker.version, detail=str(exc), **seen
            )
        return EngineState(name=self.name, state="installed", engine_version=version, **seen)

    async def _assets(self) -> list[Asset]:
        kind, where = parse_source(self.spec.source)

        async def on_retry(attempt: int, exc: InstallError) -> None:
            await self.step(
                "resolving", f"installing: retrying the release lookup after attempt {attempt}: {exc}"
            )

        retry = {
            "attempts": self.ctx.attempts,
            "backoff_s": self.ctx.retry_backoff_s,
            "cap_s": self.ctx.retry_cap_s,
            "on_retry": on_retry,
        }
        if self.ctx.mirror or kind == "mirror":
            return await mirror_assets(self.ctx.client, self.ctx.mirror or where, **retry)  # type: ignore[arg-type]
        return await github_assets(self.ctx.client, self.ctx.github_api, where, self.tag, **retry)  # type: ignore[arg-type]

    async def _install(self, final: Path) -> EngineState:
        await self.step("resolving", f"installing: looking up {self.name} {self.tag}")
        assets = await self._assets()
        build = choose_build(assets, self.tag, self.ctx.facts)
        for asset in (build.main, build.runtime):
            if asset is not None and not asset.sha256:
                raise InstallFailed(
                    f"{asset.name} has no published sha256 (no digest, no checksum file); "
                    "refusing to install it unverified"
                )
        staging = self.ctx.root / ".staging" / f"{self.name}-{self.tag}-{uuid.uuid4().hex[:8]}"
        (staging / "downloads").mkdir(parents=True)
        tree = staging / "tree"
        tree.mkdir()
        # The runtime is unpacked apart: its libraries go beside llama-server, wherever
        # in its own archive they sit.
        runtime_tree = staging / "runtime"
        runtime_tree.mkdir()
        try:
            for asset, into in ((build.main, tree), (build.runtime, runtime_tree)):
                if asset is not None:
                    path = await self._download(asset, staging / "downloads" / asset.name)
                    await self.step("unpacking", f"installing: unpacking {asset.name}")
                    await anyio.to_thread.run_sync(extract, path, into, self.ctx.limits)
            bin_dir_in_tree = find_bin_dir(tree)
            if build.runtime is not None:
                await self._merge_runtime(runtime_tree, bin_dir_in_tree, build.runtime.name)
            await self._check_libraries(bin_dir_in_tree)
            await self.step("version", f"installing: running {SERVER} --version")
            version = (
                await anyio.to_thread.run_sync(
                    version_of, bin_dir_in_tree / SERVER, self.ctx.version_timeout_s
                )
            ).full
            bin_dir = final / bin_dir_in_tree.relative_to(tree)
            marker = InstalledEngine(
                name=self.name,
                tag=self.tag,
                version=version,
                bin_dir=str(bin_dir),
                asset=build.main.name,
                sha256=build.main.sha256,
                installed_at=time.time(),
                cpu_only=build.cpu_only,
                cuda_driver=self.ctx.facts.cuda_driver,
            )
            marker_path = tree / MARKER
            marker_path.write_bytes(msgspec.json.encode(marker))
            with marker_path.open("rb") as f:
                os.fsync(f.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            if final.exists():
                shutil.rmtree(final)
            # The commit point: the directory, marker inside, appears in one rename.
            os.replace(tree, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        cpu_only = f"; CPU build only: {build.cpu_only}" if build.cpu_only else ""
        await self.step(
            "installed",
            f"installed {self.name} {self.tag} in {bin_dir} ({SERVER} says {version}){cpu_only}",
            "done",
        )
        return EngineState(
            name=self.name,
            state="installed",
            version=self.tag,
            path=str(bin_dir),
            engine_version=version,
            cpu_only=build.cpu_only,
        )

    async def _merge_runtime(self, runtime_tree: Path, bin_dir: Path, archive: str) -> None:
        await self.step("unpacking", f"installing: putting {archive}'s libraries beside {SERVER}")
        await anyio.to_thread.run_sync(merge_runtime, runtime_tree, bin_dir, archive)

    async def _check_libraries(self, bin_dir: Path) -> None:
        """ldd every ELF file; install the OS packages for what is missing; ldd again."""
        await self.step("checking", f"installing: checking libraries of {bin_dir.name}/ with ldd")
        missing = await anyio.to_thread.run_sync(missing_in, bin_dir, self.ctx.ldd, self.ctx.ldd_timeout_s)
        if not missing:
            return
        await self._os_packages(missing)
        await self.step("checking", f"installing: checking libraries of {bin_dir.name}/ with ldd again")
        still = await anyio.to_thread.run_sync(missing_in, bin_dir, self.ctx.ldd, self.ctx.ldd_timeout_s)
        if still:
            table = ospkg.PACKAGE_FOR.get(self.ctx.packages.kind if self.ctx.packages else "", {})
            raise CheckError(describe_missing(still, table) + " (still missing after installing packages)")

    async def _os_packages(self, missing: dict[str, str]) -> None:
        """Install what provides `missing` (library -> file that needs it), or say what to install by hand."""
        pm = self.ctx.packages
        if pm is None:
            raise CheckError(describe_missing(missing) + " (this node has neither apt nor dnf)")
        table = ospkg.PACKAGE_FOR.get(pm.kind, {})
        packages, unknown = ospkg.packages_for(pm.kind, missing)
        if unknown:
            raise CheckError(
                describe_missing(missing, table)
                + f"; no {pm.kind} package is known for {', '.join(unknown)}: install it by hand"
            )
        if not self.ctx.allow_os_packages:
            raise CheckError(
                describe_missing(missing, table)
                + " (allow_os_packages is false: llmgw does not install them)"
            )
        if not self.ctx.packages_refreshed:
            await self.step("packages", f"installing: refreshing the {pm.kind} package index")
            await anyio.to_thread.run_sync(pm.refresh)
            self.ctx.packages_refreshed = True
        libs = ", ".join(sorted(missing))
        await self.step("packages", f"installing: {pm.kind} install {' '.join(packages)} (for {libs})")
        await anyio.to_thread.run_sync(pm.install, packages)

    async def _download(self, asset: Asset, dest: Path) -> Path:
        await self.step(
            "downloading", f"installing: downloading {asset.name} ({mb(asset.size)})", total=asset.size
        )
        last = [0.0]

        async def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] >= 1.0:
                last[0] = time.monotonic()
                pct = f"{100 * done // total}%, " if total else ""
                await self.step(
                    "downloading",
                    f"installing: downloading {asset.name} ({pct}{mb(done)} of {mb(total)})",
                    done=done,
                    total=total,
                )

        async def on_retry(attempt: int, exc: InstallError) -> None:
            await self.step(
                "downloading", f"installing: retrying {asset.name} after attempt {attempt}: {exc}"
            )

        got = await download(
            self.ctx.client,
            asset,
            dest,
            progress,
            attempts=self.ctx.attempts,
            backoff_s=self.ctx.retry_backoff_s,
            cap_s=self.ctx.retry_cap_s,
            on_retry=on_retry,
        )
        await self.step("verifying", "installing: verifying sha256")
        if got != asset.sha256:
            with contextlib.suppress(OSError):
                dest.unlink()
            raise InstallFailed(
                f"sha256 mismatch for {asset.name}: release says {asset.sha256}, downloaded file is {got}"
            )
        return dest
