"""An engine's load, read from its metrics and shown where operators look: the parsing of each
engine's gauges, and a sim engine under load as `llmgw ctl` shows it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import anyio
import httpx
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.events import EngineLoad, ShardStatus, decoder
from llmgw_launcher.load import LOAD_METRICS, changed, parse_load
from tests.cluster_support import Cluster, cluster, sim_catalog
from tests.waiting import eventually

CTL = [sys.executable, "-c", "import sys; from llmgw.cli import main; sys.exit(main())", "ctl"]

# In the form vLLM's /metrics has them (v1 engine, two data-parallel engines), among the
# histograms a real exposition carries.
VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.625
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 7.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 7.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.4
"""


def test_vllm_load_adds_requests_over_engines_and_reports_the_fullest_cache() -> None:
    load = parse_load(VLLM_METRICS, LOAD_METRICS["vllm"], at=12.0)
    assert load == EngineLoad(running=5, waiting=4, kv_cache_usage=0.625, at=12.0)
    assert load.summary == "5 running, 4 waiting, KV 62%"
    older = VLLM_METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_load(older, LOAD_METRICS["vllm"]) == EngineLoad(running=5, waiting=4, kv_cache_usage=0.625)


def test_metrics_without_the_gauges_are_no_load() -> None:
    assert parse_load(VLLM_METRICS, LOAD_METRICS["llamacpp"]) is None
    assert parse_load("", LOAD_METRICS["sim"]) is None
    assert parse_load("not prometheus {{{\n", LOAD_METRICS["vllm"]) is None


def test_a_load_is_republished_only_when_it_moved() -> None:
    a = EngineLoad(running=1, waiting=0, kv_cache_usage=0.300, at=1.0)
    assert changed(None, a)
    assert not changed(a, EngineLoad(running=1, waiting=0, kv_cache_usage=0.305, at=2.0))
    assert changed(a, EngineLoad(running=1, waiting=0, kv_cache_usage=0.310))
    assert changed(a, EngineLoad(running=2, waiting=0, kv_cache_usage=0.300))
    assert changed(a, EngineLoad(running=1, waiting=1, kv_cache_usage=0.300))
    assert changed(a, EngineLoad(running=1, waiting=0, kv_cache_usage=None))


def ctl(c: Cluster, *args: str) -> str:
    done = subprocess.run(
        [*CTL, "--prefix", c.prefix, *args], capture_output=True, text=True, env=c.ctl_env(), timeout=60
    )
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


@pytest.mark.anyio
@pytest.mark.timeout(240)
async def test_a_sim_engine_under_load_shows_its_running_requests_in_ctl(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    ready_events: list[ShardStatus] = []

    async def on_shard(msg: Msg) -> None:
        status = decoder(ShardStatus).decode(msg.data)
        if status.state == "ready":
            ready_events.append(status)

    sub = await bus.nc.subscribe(f"{prefix}.events.shard.>", cb=on_shard)
    with cluster(tmp_path, nats_url, prefix) as c:
        c.start_node("node-1", gpus=1)
        # Four tokens a second: a request of 80 tokens is generated for 20 s.
        c.start_placement(
            "p1",
            [sim_catalog("--tokens-per-second", "4")],
            [{"name": "chat", "profile": "tiny", "replicas": 1}],
        )

        async def engine_url() -> str | None:
            for line in ctl(c, "get", "replicas", "-o", "wide").splitlines()[1:]:
                if line.split()[:2] == ["chat/r0", "ready"]:
                    return next(w for w in line.split() if w.startswith("http://"))
            return None

        url = await eventually(engine_url, timeout=60, interval=0.5)
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 80, "stream": True}
        async with httpx.AsyncClient(base_url=url, timeout=60) as client, anyio.create_task_group() as tg:

            async def stream() -> None:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass

            tg.start_soon(stream)
            tg.start_soon(stream)

            def loaded(text: str) -> str | None:
                line = next((x for x in text.splitlines() if x.startswith("chat/r0 ") or " r0 " in x), "")
                return line if "2 running, 0 waiting, KV " in line else None

            # The launcher reads the engine every 5 s (the default): within two reads.
            row = await eventually(lambda: loaded(ctl(c, "get", "replicas", "-o", "wide")), timeout=30)
            assert "LOAD" in ctl(c, "get", "replicas", "-o", "wide").splitlines()[0]
            assert "ready" in row
            described = ctl(c, "describe", "deployment", "chat")
            assert "LOAD" in described
            assert loaded(described), described
            shards = ctl(c, "get", "shards", "-o", "wide")
            assert "2 running, 0 waiting, KV " in shards, shards
            tg.cancel_scope.cancel()
        # Once the requests are gone, the next read says so.
        await eventually(
            lambda: "0 running, 0 waiting, KV 0%" in ctl(c, "get", "replicas", "-o", "wide"), timeout=30
        )
    await sub.unsubscribe()
    # Loads went to the status bucket only: the events carry the one transition to ready.
    assert len(ready_events) == 1, ready_events
