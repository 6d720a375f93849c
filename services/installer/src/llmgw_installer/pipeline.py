"""Installing one engine build, step by step, every step reported in the node's own words.

resolve release -> choose build -> OS packages -> download -> verify sha256 ->
unpack (safely) -> ldd every executable -> --version -> marker, rename into place.
A crash anywhere leaves no marker; the next start removes the staging leftovers.
"""

from __future__ import annotations

import contextlib
import os
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
from .archive import ArchiveError, Limits, extract
from .builds import Asset, Build, NoBuildError, choose_build
from .checks import CheckError, check_binary, describe_missing, missing_libraries
from .download import DownloadError, download
from .release import SourceError, github_assets, mirror_assets

DEFAULT_SOURCE = "github:ggml-org/llama.cpp"
SERVER = "llama-server"
RPC_SERVERS = ("ggml-rpc-server", "rpc-server")

Report = Callable[[InstallProgress], Awaitable[None]]


class InstallFailed(Exception):
    pass


@dataclass
class InstallContext:
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
    retry_backoff_s: float = 1.0
    limits: Limits = field(default_factory=Limits)


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


def executables(bin_dir: Path) -> list[Path]:
    out = []
    for p in sorted(bin_dir.iterdir()):
        if p.is_file() and not p.is_symlink() and os.access(p, os.X_OK):
            with p.open("rb") as f:
                if f.read(4) == b"\x7fELF" and not p.name.endswith(".so") and ".so." not in p.name:
                    out.append(p)
    return out


def find_bin_dir(tree: Path) -> Path:
    hits = sorted(tree.rglob(SERVER), key=lambda p: len(p.parts))
    hits = [h for h in hits if h.is_file()]
    if not hits:
        raise InstallFailed(f"the archive has no {SERVER}")
    return hits[0].parent


def check_install(bin_dir: Path, timeout: float) -> str:
    """ldd on every executable, then `llama-server --version`; the version text, or CheckError."""
    for exe in executables(bin_dir):
        missing = missing_libraries(exe)
        if missing:
            raise CheckError(describe_missing(exe, missing))
    return check_binary(bin_dir / SERVER, timeout).text


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
        if self.name != "llamacpp":
            return await self.fail(
                "resolving",
                f"{self.name} is not installed from releases; name its Python "
                f"environment under engines: in agent.yaml",
            )
        final = self.ctx.root / self.name / self.tag
        if read_marker(final) is not None:
            return await self.recheck(final)
        try:
            return await self._install(final)
        except InstallFailed as exc:
            return await self.fail("failed", str(exc))

    async def recheck(self, final: Path) -> EngineState:
        marker = read_marker(final)
        assert marker is not None
        bin_dir = Path(marker.bin_dir)
        try:
            version = await anyio.to_thread.run_sync(check_install, bin_dir, self.ctx.version_timeout_s)
        except CheckError as exc:
            return EngineState(
                name=self.name, state="broken", version=marker.version, path=str(bin_dir), detail=str(exc)
            )
        return EngineState(name=self.name, state="installed", version=version, path=str(bin_dir))

    async def _assets(self) -> list[Asset]:
        source = self.spec.source or DEFAULT_SOURCE
        try:
            if self.ctx.mirror or source.startswith("mirror:"):
                return await mirror_assets(self.ctx.client, self.ctx.mirror or source.removeprefix("mirror:"))
            return await github_assets(
                self.ctx.client, self.ctx.github_api, source.removeprefix("github:"), self.tag
            )
        except SourceError as exc:
            raise InstallFailed(str(exc)) from exc

    async def _install(self, final: Path) -> EngineState:
        await self.step("resolving", f"installing: looking up {self.name} {self.tag}")
        assets = await self._assets()
        try:
            build = choose_build(assets, self.tag, self.ctx.facts)
        except NoBuildError as exc:
            raise InstallFailed(str(exc)) from exc
        for asset in (build.main, build.runtime):
            if asset is not None and not asset.sha256:
                raise InstallFailed(
                    f"{asset.name} has no published sha256 (no digest, no checksum file); "
                    "refusing to install it unverified"
                )
        await self._os_packages(build)
        staging = self.ctx.root / ".staging" / f"{self.name}-{self.tag}-{uuid.uuid4().hex[:8]}"
        (staging / "downloads").mkdir(parents=True)
        tree = staging / "tree"
        tree.mkdir()
        try:
            for asset in (build.main, build.runtime):
                if asset is not None:
                    path = await self._download(asset, staging / "downloads" / asset.name)
                    await self.step("unpacking", f"installing: unpacking {asset.name}")
                    try:
                        await anyio.to_thread.run_sync(extract, path, tree, self.ctx.limits)
                    except ArchiveError as exc:
                        raise InstallFailed(str(exc)) from exc
            bin_dir_in_tree = find_bin_dir(tree)
            if build.runtime is not None:
                await self._merge_runtime(tree, bin_dir_in_tree)
            await self.step("checking", f"installing: checking libraries of {bin_dir_in_tree.name}/ with ldd")
            await self.step("version", f"installing: running {SERVER} --version")
            try:
                version = await anyio.to_thread.run_sync(
                    check_install, bin_dir_in_tree, self.ctx.version_timeout_s
                )
            except CheckError as exc:
                raise InstallFailed(str(exc)) from exc
            bin_dir = final / bin_dir_in_tree.relative_to(tree)
            marker = InstalledEngine(
                name=self.name,
                tag=self.tag,
                version=version,
                bin_dir=str(bin_dir),
                asset=build.main.name,
                sha256=build.main.sha256,
                installed_at=time.time(),
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
        await self.step("installed", f"installed {self.name} {version} in {bin_dir}", "done")
        return EngineState(name=self.name, state="installed", version=version, path=str(bin_dir))

    async def _merge_runtime(self, tree: Path, bin_dir: Path) -> None:
        # The cudart archive's libraries go beside llama-server, where its $ORIGIN rpath finds them.
        for lib in tree.glob("*.so*"):
            if lib.parent == tree and lib.parent != bin_dir:
                shutil.move(str(lib), bin_dir / lib.name)

    async def _os_packages(self, build: Build) -> None:
        pm = self.ctx.packages
        if pm is None:
            return
        wanted = (ospkg.CUDA_PACKAGES if build.cuda else ospkg.CPU_PACKAGES).get(pm.kind, ())
        missing = await anyio.to_thread.run_sync(pm.missing, wanted)
        if not missing:
            return
        if not self.ctx.allow_os_packages:
            await self.step(
                "packages",
                f"installing: would install {' '.join(missing)} ({pm.kind}), but "
                "allow_os_packages is false; install them by hand",
            )
            return
        await self.step("packages", f"installing: {pm.kind} install {' '.join(missing)}")
        try:
            await anyio.to_thread.run_sync(pm.install, missing)
        except ospkg.PackageError as exc:
            raise InstallFailed(str(exc)) from exc

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

        async def on_retry(attempt: int, exc: DownloadError) -> None:
            await self.step(
                "downloading", f"installing: retrying {asset.name} after attempt {attempt}: {exc}"
            )

        try:
            got = await download(
                self.ctx.client, asset, dest, progress, backoff_s=self.ctx.retry_backoff_s, on_retry=on_retry
            )
        except DownloadError as exc:
            raise InstallFailed(str(exc)) from exc
        await self.step("verifying", "installing: verifying sha256")
        if got != asset.sha256:
            with contextlib.suppress(OSError):
                dest.unlink()
            raise InstallFailed(
                f"sha256 mismatch for {asset.name}: release says {asset.sha256}, downloaded file is {got}"
            )
        return dest
