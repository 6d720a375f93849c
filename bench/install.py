"""What installing a llama.cpp release costs through the installer, against doing it by hand:
`curl -o` + `sha256sum` + `tar -xzf` of the same 200 MB .tar.gz from the same HTTP server.

The release is made at bench time, shaped like llama.cpp's Linux builds: `build/bin/` with
`llama-server`, shared libraries with their `.so` symlink chains, and one large backend
(`libggml-cuda.so`). The libraries are real ELF shared objects (so `ldd` has real work)
padded with a mix of random bytes and text-like and table-like runs, which gzip packs about
2x, as it does real builds. `llama-server` is a tiny script that answers `--version` the way
the real one does. The deflate stream is made from independently compressed 1 MiB pieces
(each ends in a full flush), so making 400 MB of it takes seconds, not a minute; a reader
sees one ordinary gzip stream, and decompressing it is the same work.

A GitHub-shaped release API serves it from a separate process on loopback (so neither side
shares a core with the server's event loop). The installer's side is one `converge_once`
pass of `llmgw_installer.Installer` against a local nats-server, with a fresh state
directory. The install (the installer's own install-duration metric) is the release lookup,
download (hashing while it downloads), the sha256 check, the archive checks and unpacking,
`ldd` on every ELF file, `llama-server --version`, the marker (fsync'ed) and the rename into
place, and every progress event and status it publishes on the way; the whole pass adds the
probe, the built-in sim engine's check and the final reports. The baseline: `curl -sSf -o`,
`sha256sum`, `tar -xzf`, one after another. The two alternate, starting with each in turn;
the machine is shared and noisy. Target: the install within 1.1x the baseline (medians).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import anyio
import msgspec

from bench.procs import terminate
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.events import DesiredEngines, EngineSpec
from llmgw_core.natsd import NatsServer

REPO = "ggml-org/llama.cpp"
TAG = "b6543"
ASSET = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
TARGET = 1.1

# What the real llama-server prints for --version (on stderr).
SERVER_SCRIPT = b"""#!/bin/sh
if [ "$1" = "--version" ]; then
    echo "version: 6543 (4f2a1c9)" >&2
    echo "built with cc (Ubuntu 11.4.0-1ubuntu1~22.04) 11.4.0 for x86_64-linux-gnu" >&2
    exit 0
fi
echo "error: this is a benchmark's stand-in for llama-server" >&2
exit 1
"""

UNIT = 1 << 20  # the release's bulk is made of pieces this size, each deflated once
CHUNK = 64 << 10


# --- the release ---------------------------------------------------------------------------


def _pool(rng: random.Random, units: int) -> list[bytes]:
    """`units` distinct 1 MiB pieces: each 64 KiB chunk random (packed code or data: gzip cannot
    shrink it), text-like (symbols, strings) or table-like (relocations, padding)."""
    vocab = [
        bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz_0123456789", k=rng.randint(3, 14))) for _ in range(800)
    ]
    text = b"\0".join(rng.choices(vocab, k=(4 * UNIT) // 8))[: 4 * UNIT]
    record = [struct.pack("<QQ", rng.getrandbits(20), rng.getrandbits(8)) for _ in range(64)]
    table = b"".join(rng.choice(record) for _ in range(4 * UNIT // 16))
    pieces = []
    for _ in range(units):
        out = bytearray()
        while len(out) < UNIT:
            kind = rng.random()
            if kind < 0.3:
                out += rng.randbytes(CHUNK)
            else:
                source = text if kind < 0.75 else table
                at = rng.randrange(0, len(source) - CHUNK)
                out += source[at : at + CHUNK]
        pieces.append(bytes(out))
    return pieces


def _deflate(data: bytes) -> bytes:
    """`data` as raw deflate blocks that stand on their own: no reference before them, byte-aligned
    at the end (a full flush), no final block; so such pieces concatenate into one valid stream."""
    c = zlib.compressobj(6, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush(zlib.Z_FULL_FLUSH)


class _GzipWriter:
    """One gzip stream made of independently deflated pieces; repeated pieces are deflated once."""

    def __init__(self, out: io.BufferedWriter) -> None:
        self.out = out
        self.crc = 0
        self.size = 0
        self.cache: dict[int, bytes] = {}
        out.write(b"\x1f\x8b\x08\x00" + struct.pack("<I", 0) + b"\x00\x03")

    def write(self, data: bytes, key: int | None = None) -> None:
        if key is None:
            packed = _deflate(data)
        else:
            if key not in self.cache:
                self.cache[key] = _deflate(data)
            packed = self.cache[key]
        self.out.write(packed)
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)

    def close(self) -> None:
        self.out.write(zlib.compressobj(6, zlib.DEFLATED, -15).flush(zlib.Z_FINISH))
        self.out.write(struct.pack("<II", self.crc, self.size & 0xFFFFFFFF))


def _elf_head() -> bytes:
    """A real, tiny shared object that needs libc (`ldd` reads it as one); the libraries are
    this plus padding."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "head.c"
        src.write_text('#include <stdio.h>\nint llmgw_bench_answer(void) { return puts("42"); }\n')
        so = Path(d) / "head.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
        return so.read_bytes()


def make_release(work: Path, packed_bytes: int, seed: int = 11) -> Path:
    """A llama.cpp-shaped .tar.gz of about `packed_bytes`, written under `work`."""
    rng = random.Random(seed)
    pool = _pool(rng, 16)
    per_unit = sum(len(_deflate(p)) for p in pool) / len(pool)
    head = _elf_head()
    libs = {  # real file name -> MiB of padding; the big backend takes what is left
        "libggml-base.so.0.9.4": 2,
        "libggml.so.0.9.4": 1,
        "libggml-cpu-haswell.so": 3,
        "libggml-cpu-skylakex.so": 3,
        "libggml-cpu-icelake.so": 3,
        "libggml-rpc.so": 1,
        "libllama.so.0.0.6543": 5,
        "libmtmd.so.0.0.6543": 2,
        "libggml-cuda.so": 0,
    }
    small = sum(libs.values())
    libs["libggml-cuda.so"] = max(1, round(packed_bytes / per_unit) - small)
    links = {
        "libggml-base.so.0": "libggml-base.so.0.9.4",
        "libggml-base.so": "libggml-base.so.0",
        "libggml.so.0": "libggml.so.0.9.4",
        "libggml.so": "libggml.so.0",
        "libllama.so.0": "libllama.so.0.0.6543",
        "libllama.so": "libllama.so.0",
        "libmtmd.so.0": "libmtmd.so.0.0.6543",
        "libmtmd.so": "libmtmd.so.0",
    }
    archive = work / ASSET
    with archive.open("wb") as f:
        gz = _GzipWriter(f)

        def member(name: str, size: int, *, mode: int = 0o755, link: str = "") -> None:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime, ti.uname, ti.gname = size, mode, 1_750_000_000, "runner", "runner"
            if link:
                ti.type, ti.linkname = tarfile.SYMTYPE, link
            elif name.endswith("/"):
                ti.type = tarfile.DIRTYPE
            gz.write(ti.tobuf(tarfile.GNU_FORMAT))

        def pad(size: int) -> None:
            if size % tarfile.BLOCKSIZE:
                gz.write(bytes(tarfile.BLOCKSIZE - size % tarfile.BLOCKSIZE))

        member("build/", 0)
        member("build/bin/", 0)
        member("build/bin/llama-server", len(SERVER_SCRIPT))
        gz.write(SERVER_SCRIPT)
        pad(len(SERVER_SCRIPT))
        for name, units in libs.items():
            size = len(head) + units * UNIT
            member(f"build/bin/{name}", size)
            gz.write(head)
            for _ in range(units):
                key = rng.randrange(len(pool))
                gz.write(pool[key], key)
            pad(size)
        for name, target in links.items():
            member(f"build/bin/{name}", 0, mode=0o777, link=target)
        gz.write(bytes(2 * tarfile.BLOCKSIZE))
        gz.write(bytes(-gz.size % tarfile.RECORDSIZE))
        gz.close()
    return archive


# --- the release server (a process of its own) ---------------------------------------------


def serve(directory: Path) -> None:
    """Serve the files in `directory` as release TAG of REPO on a GitHub-shaped API; prints the port."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from llmgw_core.web import serve as serve_app

    files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            port: int = await tg.start(
                serve_app, Starlette(routes=[Route("/{path:path}", handle)]), "127.0.0.1", 0
            )
            api = f"http://127.0.0.1:{port}"
            release["assets"] = [
                {
                    "name": name,
                    "size": len(data),
                    "digest": "sha256:" + hashlib.sha256(data).hexdigest(),
                    "browser_download_url": f"{api}/download/{TAG}/{name}",
                }
                for name, data in files.items()
            ]
            print(port, flush=True)

    release: dict[str, object] = {"tag_name": TAG, "assets": []}

    async def handle(req: Request) -> Response:
        path = req.url.path
        if path == f"/repos/{REPO}/releases/tags/{TAG}":
            return Response(json.dumps(release).encode(), media_type="application/json")
        name = path.removeprefix(f"/download/{TAG}/")
        if name in files:
            return Response(files[name], media_type="application/octet-stream")
        return Response(b'{"message": "Not Found"}', 404, media_type="application/json")

    anyio.run(main)


@contextlib.contextmanager
def release_server(directory: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.install", "--serve", str(directory)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip()
        if not port.isdigit():
            raise RuntimeError(f"the release server did not start (said {port!r})")
        yield f"http://127.0.0.1:{port}"
    finally:
        terminate(proc)


# --- the two sides -------------------------------------------------------------------------


def by_hand(api: str, sha256: str, work: Path) -> float:
    """curl -o, sha256sum, tar -xzf: seconds."""
    dest = work / "by-hand"
    dest.mkdir()
    archive = work / ASSET
    start = time.perf_counter()
    subprocess.run(["curl", "-sSf", "-o", str(archive), f"{api}/download/{TAG}/{ASSET}"], check=True)
    summed = subprocess.run(["sha256sum", str(archive)], check=True, capture_output=True, text=True)
    if summed.stdout.split()[0] != sha256:
        raise RuntimeError(f"sha256sum says {summed.stdout.split()[0]}, the release {sha256}")
    subprocess.run(["tar", "-xzf", str(archive), "-C", str(dest)], check=True)
    took = time.perf_counter() - start
    if not (dest / "build" / "bin" / "llama-server").is_file():
        raise RuntimeError("tar -xzf left no build/bin/llama-server")
    return took


async def through_installer(bus: Bus, api: str, work: Path) -> tuple[float, float]:
    """One converge pass of a fresh installer that has the release to install: seconds for the
    install (the installer's own install-duration metric) and for the whole pass."""
    from llmgw_installer import Installer

    config = msgspec.convert(
        {
            "node": "bench-node",
            "state_dir": str(work / "state"),
            "github_api": api,
            "allow_os_packages": False,
        },
        AgentConfig,
    )
    inst = Installer(config, bus, packages=None)
    await inst.load_desired()
    start = time.perf_counter()
    status = await inst.converge_once()
    took = time.perf_counter() - start
    found = [e for e in (status.engines if status else ()) if e.name == "llamacpp"]
    if not found or found[0].state != "installed" or found[0].version != "b6543":
        raise RuntimeError(f"the install did not succeed: {found or inst.install_words}")
    install = inst.metrics_registry.get_sample_value(
        "llmgw_installer_install_duration_seconds_sum", {"engine": "llamacpp", "outcome": "installed"}
    )
    assert install is not None, "the installer measured no install"
    return install, took


async def _measure(api: str, nats_url: str, sha256: str, work: Path, rounds: int) -> dict[str, list[float]]:
    bus = await Bus.connect(BusOptions(url=nats_url, prefix="installbench", insecure=True), service="bench")
    async with bus:
        await bus.ensure()
        await bus.put(
            bus.names.config_bucket,
            "engines",
            DesiredEngines(engines=(EngineSpec(name="llamacpp", version=TAG, source=f"github:{REPO}"),)),
        )
        times: dict[str, list[float]] = {"install": [], "pass": [], "by hand": []}
        for i in range(rounds):
            order = ("installer", "by hand") if i % 2 == 0 else ("by hand", "installer")
            for side in order:
                side_dir = work / f"round-{i}-{side.replace(' ', '-')}"
                side_dir.mkdir()
                os.sync()  # the previous round's writes are not this one's to pay for
                if side == "installer":
                    install, whole = await through_installer(bus, api, side_dir)
                    times["install"].append(install)
                    times["pass"].append(whole)
                else:
                    times["by hand"].append(await anyio.to_thread.run_sync(by_hand, api, sha256, side_dir))
                shutil.rmtree(side_dir)
        return times


def run(quick: bool = False) -> str:
    packed = (50 if quick else 200) * 1_000_000
    rounds = 2 if quick else 5
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-install-") as d:
        work = Path(d)
        release_dir = work / "release"
        release_dir.mkdir()
        made = time.perf_counter()
        archive = make_release(release_dir, packed)
        made = time.perf_counter() - made
        size = archive.stat().st_size
        with tarfile.open(archive) as tf:
            unpacked = sum(m.size for m in tf)
        sha256 = hashlib.sha256(archive.read_bytes()).hexdigest()
        nats = NatsServer(store_dir=work / "nats")
        nats.start()
        try:
            with release_server(release_dir) as api:
                times = anyio.run(_measure, api, nats.url, sha256, work, rounds)
        finally:
            nats.stop()
    base = times["by hand"]

    def row(what: str, t: list[float]) -> str:
        return (
            f"| {what} | {statistics.median(t):.2f} | {min(t):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in t)} | {statistics.median(t) / statistics.median(base):.2f}x |"
        )

    ratio = statistics.median(times["install"]) / statistics.median(base)
    lines = [
        "## Installing a release",
        "",
        f"`python -m bench.install{' --quick' if quick else ''}`: one install of a llama.cpp-shaped "
        f"release, {size / 1e6:.0f} MB packed ({unpacked / 1e6:.0f} MB unpacked; made in {made:.0f} s), "
        "served on loopback by a GitHub-shaped release API in a process of its own. "
        "By hand: `curl -sSf -o`, `sha256sum`, `tar -xzf` of the same file from the same server. "
        "The installer: a fresh `Installer`'s `converge_once` against a local nats-server; "
        "*install* is its own install-duration metric (release lookup, download hashing as it "
        "goes, sha256 check, archive checks and unpacking, `ldd` on every ELF file, "
        "`llama-server --version`, fsync'ed marker, rename into place, and every progress event "
        "and status it publishes on the way), *pass* the whole `converge_once` (adding the probe, "
        f"the built-in sim engine's check, which starts a Python, and the final reports). {rounds} "
        "alternating rounds, each side starting after `sync`. "
        f"Target: install within {TARGET}x by hand (medians).",
        "",
        "| | median (s) | best (s) | rounds (s) | / by hand |",
        "|---|---|---|---|---|",
        row("by hand: curl + sha256sum + tar -xzf", base),
        row("installer: install", times["install"]),
        row("installer: whole pass", times["pass"]),
        "",
        f"Install / by hand: {ratio:.2f}x (target ≤ {TARGET}x: {'met' if ratio <= TARGET else 'missed'}).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]))
    else:
        print(run(quick="--quick" in sys.argv))
