"""Real ELF binaries built from C, packed as llama.cpp-shaped release archives; and the
installer's test harness: a release server on loopback, an agent config, its events."""

from __future__ import annotations

import contextlib
import io
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.config import AgentConfig
from llmgw_core.events import DesiredEngines, EngineSpec, InstallProgress, NodeStatus, decoder
from llmgw_core.web import serve
from llmgw_installer import Installer
from tests.release_server import ReleaseServer

TAG = "b9999"
ASSET = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
LLAMA = EngineSpec(name="llamacpp", version=TAG)

SERVER_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#define PID_FILE "%(pid_file)s"
%(extern)s
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        %(call)s
        %(behaviour)s
    }
    return 0;
}
"""

BEHAVIOURS = {
    "ok": 'fprintf(stderr, "version: 1234 (abc1234)\\nbuilt with cc for x86_64-linux-gnu\\n"); return 0;',
    "semver": 'fprintf(stderr, "version: 0.5.0-dev (build 42, commit deadbee)\\n"); return 0;',
    "exit1": 'fprintf(stderr, "error: unsupported CPU\\n"); return 1;',
    "hang": "sleep(3600); return 0;",
    # Forks a helper that records its pid and sleeps; then hangs itself. A timeout
    # that kills only the child it started leaves the helper running under PID 1.
    "fork-hang": r"""
        if (fork() == 0) {
            FILE *f = fopen(PID_FILE ".tmp", "w");
            fprintf(f, "%d\n", (int)getpid());
            fclose(f);
            rename(PID_FILE ".tmp", PID_FILE);
            sleep(3600);
            return 0;
        }
        while (access(PID_FILE, F_OK) != 0) usleep(1000);
        sleep(3600);
        return 0;
    """,
}


def build_server(
    out_dir: Path,
    behaviour: str = "ok",
    *,
    lib: str | None = None,
    needs: str | None = None,
    pid_file: Path | None = None,
) -> Path:
    """A `llama-server` stand-in; with `lib`, it links against lib<lib>.so found through $ORIGIN.

    `needs` is a soname (`libvulkan.so.1`) the binary is linked against without
    calling into it, through a stub that is not shipped: ldd reports it missing
    until the system provides the real one. `pid_file` is where `fork-hang`'s helper
    writes its pid.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "server.c"
    extern = f"int {lib}_answer(void);" if lib else ""
    call = f"{lib}_answer();" if lib else ""
    src.write_text(
        SERVER_C
        % {
            "extern": extern,
            "call": call,
            "behaviour": BEHAVIOURS[behaviour],
            "pid_file": str(pid_file or out_dir / "helper.pid"),
        }
    )
    argv = ["gcc", "-O1", "-o", str(out_dir / "llama-server"), str(src)]
    if needs:
        stub_dir = out_dir.parent / f"{out_dir.name}-stub"
        stub_dir.mkdir(exist_ok=True)
        stub_src = stub_dir / "stub.c"
        stub_src.write_text("int llmgw_stub_unused(void) { return 0; }\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", f"-Wl,-soname,{needs}", "-o", str(stub_dir / needs), str(stub_src)],
            check=True,
        )
        argv += [f"-L{stub_dir}", "-Wl,--no-as-needed", f"-l:{needs}"]
    if lib:
        lib_src = out_dir / f"{lib}.c"
        lib_src.write_text(f"int {lib}_answer(void) {{ return 42; }}\n")
        subprocess.run(
            ["gcc", "-shared", "-fPIC", "-o", str(out_dir / f"lib{lib}.so"), str(lib_src)], check=True
        )
        argv += [f"-L{out_dir}", f"-l{lib}", "-Wl,-rpath,$ORIGIN"]
    subprocess.run(argv, check=True)
    src.unlink()
    return out_dir / "llama-server"


def pack(
    archive: Path, files: dict[str, Path], *, symlinks: dict[str, str] | None = None, root: str = ""
) -> Path:
    """A .tar.gz with `files` (archive name -> file) and symlinks, under `root/` if given."""
    with tarfile.open(archive, "w:gz") as tf:
        for name, path in sorted(files.items()):
            tf.add(path, arcname=f"{root}/{name}" if root else name)
        for name, target in sorted((symlinks or {}).items()):
            ti = tarfile.TarInfo(f"{root}/{name}" if root else name)
            ti.type = tarfile.SYMTYPE
            ti.linkname = target
            tf.addfile(ti, io.BytesIO())
    return archive


def pack_llama_cpp_bin(bin_dir: Path, archive: Path, *, root: str = "") -> tuple[Path, dict[str, str]]:
    """llama.cpp's server, RPC server and shared libraries, with their .so symlink chains, packed."""
    import os

    files = {
        p.name: p
        for p in bin_dir.iterdir()
        if p.is_file()
        and not p.is_symlink()
        and (p.name in ("llama-server", "ggml-rpc-server") or ".so" in p.name)
    }
    links = {p.name: os.readlink(p) for p in bin_dir.iterdir() if p.is_symlink()}
    return pack(archive, files, symlinks=links, root=root), links


# --- the installer's harness -------------------------------------------------------


class RecordingPackages:
    """The OS package seam: records what the installer asks of the package manager.

    `provides` is what installing a package makes available (package -> sonames);
    `provided` is what has been "installed" so far, for a fake ldd to consult.
    """

    def __init__(self, kind: str = "apt", provides: dict[str, tuple[str, ...]] | None = None) -> None:
        self.kind = kind
        self.provides = provides or {}
        self.calls: list[str] = []
        self.provided: set[str] = set()

    def refresh(self) -> None:
        self.calls.append("refresh")

    def install(self, packages: list[str]) -> None:
        self.calls.append("install " + " ".join(packages))
        for p in packages:
            self.provided.update(self.provides.get(p, ()))


@contextlib.asynccontextmanager
async def release_server() -> AsyncIterator[ReleaseServer]:
    server = ReleaseServer(tag=TAG)
    async with anyio.create_task_group() as tg:
        server.port = await tg.start(serve, server.app(), "127.0.0.1", 0)
        yield server
        tg.cancel_scope.cancel()


def agent(tmp_path: Path, nats_url: str, prefix: str, api: str, **kw: object) -> AgentConfig:
    return msgspec.convert(
        {
            "node": "node-a",
            "state_dir": str(tmp_path / "state"),
            "nats": {"url": nats_url, "prefix": prefix},
            "github_api": api,
            "recheck_interval_s": 1.0,
            "heartbeat_interval_s": 0.5,
            "allow_os_packages": False,
            **kw,
        },
        AgentConfig,
    )


@contextlib.asynccontextmanager
async def install_events(bus: Bus) -> AsyncIterator[list[InstallProgress]]:
    seen: list[InstallProgress] = []

    async def on_msg(msg: Msg) -> None:
        seen.append(decoder(InstallProgress).decode(msg.data))

    sub = await bus.nc.subscribe(bus.names.node_install("node-a"), cb=on_msg)
    try:
        yield seen
    finally:
        await sub.unsubscribe()


async def want(bus: Bus, *specs: EngineSpec) -> None:
    await bus.put(bus.names.config_bucket, "engines", DesiredEngines(engines=specs))


def installer(config: AgentConfig, bus: Bus, packages: object | None = None, **kw: object) -> Installer:
    return Installer(
        config,
        bus,
        packages=packages or RecordingPackages(),  # type: ignore[arg-type]
        retry_backoff_s=0.05,
        version_timeout_s=2.0,
        http_timeout_s=1.0,
        **kw,  # type: ignore[arg-type]
    )


async def converge(config: AgentConfig, bus: Bus, **kw: object) -> NodeStatus:
    inst = installer(config, bus, **kw)
    await inst.load_desired()
    status = await inst.converge_once()
    assert status is not None, "the pass reported nothing"
    assert not inst.faulted, inst.install_words
    return status


def engine(status: NodeStatus, name: str = "llamacpp") -> dict[str, str]:
    [found] = [e for e in status.engines if e.name == name]
    return {"state": found.state, "version": found.version, "path": found.path, "detail": found.detail}
