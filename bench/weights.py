"""Weights moved inside the cluster: a model staged from a peer against curl + sha256sum, and many
nodes staging one model at once against the origin's bytes.

    python -m bench --only weights

(a) One node holds a 1 GB file (random bytes) in its blob store; another stages it as a
    profile's `https://… model_sha256` source, through the launcher's own code: `Weights.stage`
    asks the cluster on NATS (`Peers`, the launcher's peer protocol and blob server, on a real
    nats-server), reads the holder's blob server over loopback while hashing, fsyncs, and
    commits by rename. The baseline, in the same run and alternating with it, is `curl` of the
    same file from the same blob server (with a token it granted) into a file, then `sha256sum`
    of that file. Target: at most 1.1x the baseline. The staging also pays what curl does not:
    the peers' answer window (`weights_peer_window_s`), the fsync and the commit; a second
    baseline adds `sync` to curl's file so that the disk's share shows.
(b) Eight nodes (eight `Weights` with their own `Peers` and bus connections) stage one model at
    once from one Hugging Face-shaped origin (`tests/hf_server.py`, which counts the bytes it
    sends). Target: the origin sends the model's bytes once, not once per node.

The files live in a temporary directory, removed at the end; the free space is checked first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.engines import ModelSource, parse_source
from llmgw_core.natsd import NatsServer

SIZE = 10**9
TARGET = 1.1
NODES = 8
PREFIX = "weightsbench"


def _source(model: str, sha256: str = "") -> ModelSource:
    source = parse_source(model, sha256)
    assert source is not None
    return source


async def _bus(url: str) -> Bus:
    return await Bus.connect(BusOptions(url=url, prefix=PREFIX, insecure=True), service="bench")


def _curl(url: str, token: str, out: Path, sync: bool) -> tuple[float, str]:
    started = time.perf_counter()
    subprocess.run(
        ["curl", "-sS", "-f", "-H", f"Authorization: Bearer {token}", "-o", str(out), url],
        check=True,
    )
    digest = subprocess.run(["sha256sum", str(out)], check=True, capture_output=True, text=True)
    if sync:
        subprocess.run(["sync", str(out)], check=True)
    took = time.perf_counter() - started
    out.unlink()
    return took, digest.stdout.split()[0]


def _holder(url: str, root: Path, log: Path) -> subprocess.Popen[bytes]:
    """A real launcher process (no shards) whose store holds the blob: its peer server serves it."""
    import msgspec

    from llmgw_core.config import AgentConfig

    config = msgspec.convert(
        {
            "node": "holder",
            "state_dir": str(root),
            "mgmt_addr": "127.0.0.1",
            "nats": {"url": url, "prefix": PREFIX, "insecure": True},
        },
        AgentConfig,
    )
    path = root / "agent.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw_launcher", "--config", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


async def _peer_vs_curl(url: str, root: Path, size: int, rounds: int) -> dict[str, Any]:
    from llmgw_launcher.peers import Peers
    from llmgw_launcher.weights import Weights
    from tests.hf_server import hf_hub

    data = os.urandom(size)
    sha = hashlib.sha256(data).hexdigest()
    blob = f"sha256-{sha}"
    holder_root = root / "holder"
    (holder_root / "models" / "blobs").mkdir(parents=True)
    (holder_root / "models" / "blobs" / blob).write_bytes(data)
    reader_root = root / "reader" / "models"
    holder = _holder(url, holder_root, root / "holder.log")
    try:
        with hf_hub() as hub:
            origin = hub.add_plain("model.gguf", data)
            del data
            source = _source(origin, sha)
            bus = await _bus(url)
            reader = Peers(bus, "reader", reader_root / "blobs", "127.0.0.1")
            llmgw: list[float] = []
            curl: list[float] = []
            curl_sync: list[float] = []
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(reader.run)
                    deadline = time.monotonic() + 60
                    while not [o for o in await reader.ask(blob, size) if o.node == "holder"]:
                        if time.monotonic() > deadline or holder.poll() is not None:
                            raise RuntimeError(f"the holder's launcher never offered the blob; see {root}")
                        await anyio.sleep(0.2)
                    for i in range(rounds):
                        shutil.rmtree(reader_root, ignore_errors=True)
                        weights = Weights(reader_root, environ={}, peers=reader)
                        started = time.perf_counter()
                        path = await weights.stage(source, lambda _w: None)
                        llmgw.append(time.perf_counter() - started)
                        assert path.stat().st_size == size
                        print(f"bench: weights: round {i + 1}: staged in {llmgw[-1]:.2f} s", file=sys.stderr)
                        shutil.rmtree(reader_root, ignore_errors=True)
                        for sync, into in ((False, curl), (True, curl_sync)):
                            # A token as any node gets one: in the holder's answer to a query.
                            (offer,) = [o for o in await reader.ask(blob, size) if o.node == "holder"]
                            took, digest = await anyio.to_thread.run_sync(
                                _curl, offer.url, offer.token, root / "curl.out", sync
                            )
                            assert digest == sha, (digest, sha)
                            into.append(took)
                        print(
                            f"bench: weights: round {i + 1}: curl + sha256sum {curl[-1]:.2f} s, "
                            f"+ sync {curl_sync[-1]:.2f} s",
                            file=sys.stderr,
                        )
                    tg.cancel_scope.cancel()
            finally:
                await bus.close()
            origin_bytes = hub.state.served["model.gguf"]
    finally:
        holder.terminate()
        holder.wait(timeout=30)
    return {
        "llmgw": statistics.median(llmgw),
        "curl": statistics.median(curl),
        "curl_sync": statistics.median(curl_sync),
        "window": reader.window_s,
        "pairs": list(zip(llmgw, curl, strict=True)),
        "origin": origin_bytes,
        "rounds": rounds,
    }


async def _many_nodes(url: str, root: Path, size: int) -> dict[str, Any]:
    from llmgw_launcher.peers import Peers
    from llmgw_launcher.weights import Weights
    from tests.hf_server import hf_hub

    data = os.urandom(size)
    sha = hashlib.sha256(data).hexdigest()
    with hf_hub() as hub:
        hub.add("org/shared", {"m.gguf": data})
        del data
        buses = [await _bus(url) for _ in range(NODES)]
        peers: list[Peers] = []
        stores: list[Weights] = []
        for i, bus in enumerate(buses):
            models = root / f"node-{i}" / "models"
            p = Peers(bus, f"node-{i}", models / "blobs", "127.0.0.1")
            peers.append(p)
            stores.append(Weights(models, environ={"HF_ENDPOINT": hub.url}, peers=p))
        paths: list[Path] = []
        try:
            async with anyio.create_task_group() as tg:
                for p in peers:
                    await tg.start(p.run)
                started = time.perf_counter()

                async def stage(w: Weights) -> None:
                    paths.append(await w.stage(_source("hf://org/shared/m.gguf"), lambda _w: None))

                async with anyio.create_task_group() as staging:
                    for w in stores:
                        staging.start_soon(stage, w)
                took = time.perf_counter() - started
                tg.cancel_scope.cancel()
        finally:
            for bus in buses:
                await bus.close()
        for path in paths:
            with path.open("rb") as f:
                assert hashlib.file_digest(f, "sha256").hexdigest() == sha
        origin = hub.state.served["m.gguf"]
    return {
        "took": took,
        "origin": origin,
        "size": size,
        "staged": len(paths),
        "peer_bytes": sum(p.served_bytes for p in peers),
    }


async def _run(url: str, root: Path, size: int, rounds: int, shared: int) -> dict[str, Any]:
    a = await _peer_vs_curl(url, root / "a", size, rounds)
    shutil.rmtree(root / "a", ignore_errors=True)
    b = await _many_nodes(url, root / "b", shared)
    return {"a": a, "b": b}


def run(*, quick: bool = False) -> str:
    repo = Path(__file__).parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    size = SIZE // 10 if quick else SIZE
    rounds = 1 if quick else 5
    shared = 16 * 2**20 if quick else 256 * 2**20
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-weights-") as tmp:
        root = Path(tmp)
        # The holder's copy, the reader's, curl's: three times the file at most at once.
        need = 3 * size + NODES * shared + 2**30
        free = shutil.disk_usage(root).free
        if free < need:
            return (
                "## Weights inside the cluster\n\n"
                f"Not run: needs {need / 1e9:.1f} GB free in {root.parent}, {free / 1e9:.1f} GB there.\n"
            )
        server = NatsServer(store_dir=root / "nats", sync_always=False)
        server.start()
        try:
            figures = anyio.run(_run, server.url, root, size, rounds, shared)
        finally:
            server.stop()
    return render(figures, size)


def render(figures: dict[str, Any], size: int) -> str:
    a, b = figures["a"], figures["b"]
    ratio = a["llmgw"] / a["curl"]
    verdict = "met" if ratio <= TARGET else "missed"
    origin_x = b["origin"] / b["size"]
    return (
        "## Weights inside the cluster\n\n"
        "`python -m bench --only weights`. (a) A node stages a "
        f"{size / 1e9:.1f} GB file (random bytes, a `model_sha256` source) held by another node: "
        "the launcher's `Weights.stage` asks the cluster on a real nats-server (`Peers`), reads the "
        "holder's blob server over loopback hashing as the bytes arrive, fsyncs and commits; the "
        "baseline is `curl` of the same blob from the same server into a file, then `sha256sum` of it, "
        f"alternating with it, median of {a['rounds']} rounds. Target: at most {TARGET}x.\n\n"
        "| staging from a peer | seconds | MB/s | vs curl + sha256sum |\n"
        "|---|---|---|---|\n"
        f"| llmgw (`Weights.stage`, peer) | {a['llmgw']:.2f} | {size / 1e6 / a['llmgw']:.0f} "
        f"| {ratio:.2f}x |\n"
        f"| curl + sha256sum | {a['curl']:.2f} | {size / 1e6 / a['curl']:.0f} | 1.00x |\n"
        f"| curl + sha256sum + sync | {a['curl_sync']:.2f} | {size / 1e6 / a['curl_sync']:.0f} "
        f"| {a['curl_sync'] / a['curl']:.2f}x |\n\n"
        "Each round, llmgw then curl + sha256sum (seconds): "
        + ", ".join(f"{x:.2f} / {y:.2f}" for x, y in a["pairs"])
        + ". The machine is shared: rounds vary, hence the median.\n\n"
        f"Target ≤ {TARGET}x: {verdict} ({ratio:.2f}x). The staging includes the peers' answer window "
        f"({a['window']:g} s, `weights_peer_window_s`), the fsync and the commit, which curl does not "
        "do. The holder is a launcher process of its own (as on another machine); the origin sent "
        f"{a['origin']} bytes.\n\n"
        f"(b) {NODES} nodes stage one {b['size'] / 2**20:.0f} MiB model at once from one Hugging "
        "Face-shaped origin (`tests/hf_server.py`, counting what it sends): "
        f"the origin sent {b['origin']} bytes, {origin_x:.2f}x the model "
        f"(target 1x: {'met' if b['origin'] == b['size'] else 'missed'}); the nodes sent each other "
        f"{b['peer_bytes'] / 2**20:.0f} MiB; all {b['staged']} staged and verified in {b['took']:.2f} s.\n"
    )


def main() -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.weights")
    parser.add_argument("--quick", action="store_true", help="a 100 MB file, one round")
    args = parser.parse_args()
    print(run(quick=args.quick))
    return 0


if __name__ == "__main__":
    sys.exit(main())
