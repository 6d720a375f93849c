"""Real ELF binaries built from C, packed as llama.cpp-shaped release archives; and the
installer's test harness: a release server on loopback, an agent config, its events."""

from __future__ import annotations

import contextlib
import io
import shutil
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
            # This machine alone: loopback (unset, a node takes its default route's address).
            "mgmt_addr": "127.0.0.1",
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
    return {
        "state": found.state,
        "version": found.version,
        "engine_version": found.engine_version,
        "path": found.path,
        "detail": found.detail,
    }


# --- releases made by the rules of llama.cpp's release workflow -----------------------

B11434 = "b11434"
B11434_ASSETS = [
    line.strip()
    for line in (Path(__file__).parent / "fixtures" / "llama-b11434-assets.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]
# The full CUDA toolkit version of each label llama.cpp builds with (its container image tag).
CUDA_TOOLKITS = {"12.8": "12.8.90", "13.4": "13.4.48"}

_RUNTIME_C = "int %(fn)s(void) { return %(value)s; }\n"
_LLAMA_SERVER_C = r"""
#include <stdio.h>
#include <string.h>
int ggml_base_answer(void);
%(extern)s
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        ggml_base_answer();
        %(cuda)s
        fprintf(stderr, "version: 0.6.0-dev (build %(build)s, commit 6a5e2f1)\n");
        fprintf(stderr, "built with cc for x86_64-linux-gnu\n");
        return 0;
    }
    return 0;
}
"""


def _cc(argv: list[str]) -> None:
    subprocess.run(["cc", *argv], check=True)


def _shared(
    out: Path, soname: str, fn: str, value: str, *, needs: tuple[str, ...] = (), libdir: Path | None = None
) -> Path:
    src = out.parent / f"{out.name}.c"
    src.write_text(_RUNTIME_C % {"fn": fn, "value": value})
    argv = ["-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)]
    if needs:
        argv += [f"-L{libdir}", "-Wl,--no-as-needed", *(f"-l:{n}" for n in needs), "-Wl,-rpath,$ORIGIN"]
    _cc(argv)
    src.unlink()
    return out


def cuda_runtime(out_dir: Path, cuda: str) -> dict[str, Path]:
    """A CUDA runtime as the toolkit installs it: real ELF shared objects under their full
    versioned names with the soname chains (`libcudart.so -> libcudart.so.12 ->
    libcudart.so.12.8.90`). `cudaRuntimeGetVersion` answers 12080 for 12.8."""
    out_dir.mkdir(parents=True, exist_ok=True)
    full = CUDA_TOOLKITS[cuda]
    major, minor = cuda.split(".")
    libs = {}
    for lib, fn in (
        ("cudart", "cudaRuntimeGetVersion"),
        ("cublas", "cublasGetVersion"),
        ("cublasLt", "cublasLtGetVersion"),
    ):
        real = _shared(out_dir / f"lib{lib}.so.{full}", f"lib{lib}.so.{major}", fn, f"{major}0{minor}0")
        (out_dir / f"lib{lib}.so.{major}").symlink_to(real.name)
        (out_dir / f"lib{lib}.so").symlink_to(f"lib{lib}.so.{major}")
        libs[lib] = real
    return libs


def llama_build(out_dir: Path, tag: str, *, cuda: str = "", toolkit: Path | None = None) -> Path:
    """llama.cpp's build/bin for `tag`: real ELF files with $ORIGIN rpaths and the .so chains
    llama.cpp ships (`libggml-base.so -> libggml-base.so.0 -> libggml-base.so.0.26.0`).

    With `cuda`, llama-server and the CUDA backend (libggml-cuda.so) are linked against
    the CUDA runtime found in `toolkit` (see `cuda_runtime`) and need `libcudart.so.<major>`,
    `libcublas.so.<major>`: ldd resolves them only once the runtime is beside them.
    `--version` calls into the runtime, so it runs only where the runtime loads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    base = _shared(out_dir / "libggml-base.so.0.26.0", "libggml-base.so.0", "ggml_base_answer", "42")
    (out_dir / "libggml-base.so.0").symlink_to(base.name)
    (out_dir / "libggml-base.so").symlink_to("libggml-base.so.0")
    src = out_dir / "server.c"
    major = cuda.split(".")[0]
    src.write_text(
        _LLAMA_SERVER_C
        % {
            "build": tag.removeprefix("b"),
            "extern": "int cudaRuntimeGetVersion(void);" if cuda else "",
            "cuda": 'fprintf(stderr, "CUDA runtime %d\\n", cudaRuntimeGetVersion());' if cuda else "",
        }
    )
    argv = ["-O1", "-o", str(out_dir / "llama-server"), str(src), f"-L{out_dir}", "-l:libggml-base.so.0"]
    if cuda:
        assert toolkit is not None
        _shared(
            out_dir / "libggml-cuda.so",
            "libggml-cuda.so",
            "ggml_backend_cuda_answer",
            "7",
            needs=(f"libcudart.so.{major}", f"libcublas.so.{major}", f"libcublasLt.so.{major}"),
            libdir=toolkit,
        )
        argv += [f"-L{toolkit}", "-Wl,--no-as-needed", f"-l:libcudart.so.{major}"]
    _cc([*argv, "-Wl,-rpath,$ORIGIN"])
    src.unlink()
    (out_dir / "LICENSE").write_text("MIT License\n")
    return out_dir


def pack_tree(archive: Path, src_dir: Path, root: str) -> Path:
    """`tar -czvf <archive> --transform "s,^\\.,<root>," -C <src_dir> .`, as llama.cpp packs:
    every member under `root/`, symlinks kept as symlinks."""
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src_dir, arcname=root)
    return archive


def release_assets(
    out: Path, tag: str, *, cuda: tuple[str, ...] = (), runtime_links: bool = False
) -> dict[str, Path]:
    """The x64 CPU build of `tag`, and a CUDA build with its cudart archive per `cuda` label,
    made by the rules of llama.cpp's release workflow; asset name -> archive.

    b11434's workflow packs the runtime with `cp -L`: the soname files as plain files
    (`libcudart.so.12`), no chains. `runtime_links` packs the whole chains instead, as a
    mirror made with `cp -P` (or an older release) has them."""
    assets = {}
    cpu = llama_build(out / "cpu", tag)
    name = f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    assets[name] = pack_tree(out / name, cpu, f"llama-{tag}")
    for label in cuda:
        toolkit = out / f"toolkit-{label}"
        libs = cuda_runtime(toolkit, label)
        build = llama_build(out / f"cuda-{label}", tag, cuda=label, toolkit=toolkit)
        name = f"llama-{tag}-bin-ubuntu-cuda-{label}-x64.tar.gz"
        assets[name] = pack_tree(out / name, build, f"llama-{tag}")
        rt = out / f"cudart-{label}"
        rt.mkdir()
        major = label.split(".")[0]
        for lib, real in libs.items():
            if runtime_links:
                shutil.copy(real, rt / real.name)
                (rt / f"lib{lib}.so.{major}").symlink_to(real.name)
                (rt / f"lib{lib}.so").symlink_to(f"lib{lib}.so.{major}")
            else:
                shutil.copy(real, rt / f"lib{lib}.so.{major}")
        stem = f"cudart-llama-{tag}-bin-ubuntu-cuda-{label}-x64"
        assets[f"{stem}.tar.gz"] = pack_tree(out / f"{stem}.tar.gz", rt, stem)
    return assets
