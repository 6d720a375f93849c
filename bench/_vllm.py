"""Two real vLLM replicas for a benchmark: a tiny model, each replica's spec as the launcher gives
it, the processes started by the vLLM adapter's own command, their prefix cache counters read, and
their caches emptied, with the launcher's relay of their KV events seen to say so."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import anyio
import httpx

from bench.procs import terminate
from bench.routing import _free_port
from llmgw_core.bus import Bus
from llmgw_core.engines import VLLM
from llmgw_core.engines.vllm import VLLMConfig
from llmgw_core.events import Profile, ShardSpec
from llmgw_core.prefixes import RoutingHeld

T = TypeVar("T")

BLOCK = 32
# Each replica's KV cache, in blocks of BLOCK tokens: about two of `bench.routing_vllm`'s
# contexts (~1,230 tokens, 39 blocks, each), fewer than its customers, so the engines evict. vLLM needs
# room for one request of MAX_MODEL_LEN (64 blocks) at least.
KV_BLOCKS = 96
# The tiny model's position limit (512) is a config check only (RoPE: positions are computed),
# raised to hold a context long enough to match in the gateway's text index (at least
# `min_match_blocks` x 256 bytes, 1 KiB, shared by a customer's prompts).
MAX_MODEL_LEN = 2048
# vLLM on two busy cores: torch's import and the model's warm-up, two servers at once.
LOAD_TIMEOUT_S = 600.0
# vLLM's prefix cache counters, in tokens: (hits, queries).
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def tiny_model(directory: Path) -> Path:
    from tests.tiny_hf import write_tiny_hf_llama

    model = write_tiny_hf_llama(directory)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = MAX_MODEL_LEN
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def replica_spec(i: int, model: Path) -> ShardSpec:
    """Replica `r<i>` of deployment `chat`, as the launcher gives it: an HTTP port and, last of
    its extra ports, the one its KV events go to."""
    profile = Profile(
        name="tiny",
        engine="vllm",
        model_path=str(model),
        served_model_name="tiny",
        kv_events=True,
        args=(
            *("--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager"),
            *("--block-size", str(BLOCK), "--num-gpu-blocks-override", str(KV_BLOCKS)),
            # Each answer's `usage` says how many of its prompt's tokens came from the cache.
            "--enable-prompt-tokens-details",
        ),
        env={
            # One thread, unbound: two servers share the machine's cores with the gateway.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            # /reset_prefix_cache: each run starts from empty caches.
            "VLLM_SERVER_DEV_MODE": "1",
        },
    )
    return ShardSpec(
        replica=f"r{i}",
        shard=f"chat-r{i}-0",
        node="bench",
        profile=profile,
        deployment="chat",
        host="127.0.0.1",
        port=_free_port(),
        extra_ports=(_free_port(),),
    )


@contextlib.contextmanager
def vllms(specs: list[ShardSpec], logs: Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Each spec's vLLM, started by the vLLM adapter's command from this environment. Terminated
    (then killed) on the way out, whatever happened."""
    engine = VLLM(VLLMConfig(bin_dir=str(Path(sys.executable).parent)))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for spec in specs:
            [command] = engine.commands(spec, dict(os.environ))
            assert "--kv-events-config" in command.args, command.args
            with open(logs / f"vllm-{spec.replica}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        command.argv, env=command.env_dict(), stdout=log, stderr=subprocess.STDOUT
                    )
                )
            print(f"bench: routing_vllm: vLLM {spec.replica} pid {procs[-1].pid}", file=sys.stderr)
        yield procs
    finally:
        for p in procs:
            terminate(p, grace_s=30)


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError as exc:
        return f"({path}: {exc})"


async def ready(specs: list[ShardSpec], procs: list[subprocess.Popen[bytes]], logs: Path) -> list[str]:
    """The replicas' URLs, once each answers /health; an error with its log's end where one
    exits or does not answer within LOAD_TIMEOUT_S."""
    urls = [f"http://127.0.0.1:{spec.port}" for spec in specs]
    async with httpx.AsyncClient(timeout=5) as client:
        for url, spec, proc in zip(urls, specs, procs, strict=True):
            deadline = time.monotonic() + LOAD_TIMEOUT_S
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                log = logs / f"vllm-{spec.replica}.log"
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"vLLM {spec.replica} exited while loading; its log ends:\n{_tail(log)}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM at {url} not ready in {LOAD_TIMEOUT_S:.0f} s:\n{_tail(log)}")
                await anyio.sleep(0.5)
    return urls


async def eventually(check: Callable[[], Awaitable[T | None]], what: str, timeout: float = 30) -> T:
    """`check()`'s first answer that is not None, polled until `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        await anyio.sleep(0.1)


def prefix_counters(metrics: str) -> tuple[int, int]:
    """(hits, queries) in tokens: vLLM's `vllm:prefix_cache_hits_total` and
    `vllm:prefix_cache_queries_total`, summed over their series; ValueError naming the series
    whose value is not a count."""
    sums = dict.fromkeys(COUNTERS, 0)
    for line in metrics.splitlines():
        name = line.partition("{")[0].partition(" ")[0]
        if name not in sums:
            continue
        value = line.rpartition(" ")[2]
        try:
            count = float(value)
        except ValueError:
            count = -1.0
        if not 0 <= count < 2**53:  # NaN too
            raise ValueError(f"{name}: {value[:40]!r} is not a count of tokens")
        sums[name] += int(count)
    return sums[COUNTERS[0]], sums[COUNTERS[1]]


async def counters(client: httpx.AsyncClient, urls: list[str]) -> tuple[int, int]:
    hits = queries = 0
    for url in urls:
        r = await client.get(f"{url}/metrics")
        r.raise_for_status()
        h, q = prefix_counters(r.text)
        hits, queries = hits + h, queries + q
    return hits, queries


async def held(bus: Bus, key: str) -> RoutingHeld | None:
    found = await bus.get(bus.names.routing_bucket, key, RoutingHeld)
    return found[0] if found else None


async def empty_caches(client: httpx.AsyncClient, urls: list[str], bus: Bus, keys: list[str]) -> None:
    """Both replicas' prefix caches reset, and the relay's view of each written empty. vLLM sends
    a step's events as the step ends: the reset goes out with the next request (one of no whole
    block)."""
    for url in urls:
        r = await client.post(f"{url}/reset_prefix_cache")
        r.raise_for_status()
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
        (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
    for key in keys:

        async def emptied(key: str = key) -> bool | None:
            value = await held(bus, key)
            return True if value is not None and not value.hashes() and value.block_tokens == BLOCK else None

        await eventually(emptied, f"the relay's view of {key} emptied")


async def first_blocks(client: httpx.AsyncClient, urls: list[str], bus: Bus, keys: list[str]) -> None:
    """One prompt of whole blocks to each replica, seen relayed: the view has its block size
    (`block_tokens`) before any run, so the first run's gateway tokenizes from its first request."""
    for url in urls:
        body = {"model": "tiny", "prompt": "the llama runs on a node " * 30, "max_tokens": 1}
        (await client.post(f"{url}/v1/completions", json=body)).raise_for_status()
    for key in keys:

        async def stored(key: str = key) -> bool | None:
            value = await held(bus, key)
            return True if value is not None and value.block_tokens == BLOCK and value.hashes() else None

        await eventually(stored, f"the relay's first view of {key}")
