"""Real ELF binaries built from C, packed as llama.cpp-shaped release archives."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

SERVER_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
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
}


def build_server(out_dir: Path, behaviour: str = "ok", *, lib: str | None = None) -> Path:
    """A `llama-server` stand-in; with `lib`, it links against lib<lib>.so found through $ORIGIN."""
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "server.c"
    extern = f"int {lib}_answer(void);" if lib else ""
    call = f"{lib}_answer();" if lib else ""
    src.write_text(SERVER_C % {"extern": extern, "call": call, "behaviour": BEHAVIOURS[behaviour]})
    argv = ["gcc", "-O1", "-o", str(out_dir / "llama-server"), str(src)]
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
