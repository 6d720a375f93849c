"""Secrets in environments reach the engine, and nothing else: not logs, not events."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from llmgw_core.bus import Bus
from llmgw_core.events import ShardStatus
from llmgw_core.redact import is_secret, redact_env, scrub, secret_values
from tests.launcher_support import agent_config, running_launcher, shard, shard_events, sim_profile
from tests.waiting import eventually


@pytest.mark.parametrize(
    ("name", "secret"),
    [
        ("HF_TOKEN", True),
        ("HF_HOME", True),
        ("hf_endpoint", True),
        ("OPENAI_API_KEY", True),
        ("GITHUB_TOKEN", True),
        ("AWS_SECRET_ACCESS_KEY", True),
        ("DB_PASSWORD", True),
        ("client_secret", True),
        ("CUDA_VISIBLE_DEVICES", False),
        ("NCCL_IB_HCA", False),
        ("TOKENIZERS_PARALLELISM", False),
        ("KEYBOARD", False),
        ("PATH", False),
    ],
)
def test_which_names_hold_secrets(name: str, secret: bool) -> None:
    assert is_secret(name) is secret


def test_redacted_environments_and_text() -> None:
    env = {"HF_TOKEN": "hf_abcdef123456", "VLLM_API_KEY": "k3y-value", "PORT": "8000", "X_PASSWORD": "on"}
    assert redact_env(env) == {"HF_TOKEN": "***", "VLLM_API_KEY": "***", "PORT": "8000", "X_PASSWORD": "***"}
    values = secret_values(env, {"OTHER_TOKEN": "hf_abcdef123456-long"})
    assert values == ["hf_abcdef123456-long", "hf_abcdef123456", "k3y-value"]
    text = "login with hf_abcdef123456-long failed; key k3y-value; port 8000; verbose on"
    assert scrub(text, values) == "login with *** failed; key ***; port 8000; verbose on"


@pytest.mark.anyio
async def test_an_engine_that_prints_its_token_fails_with_the_token_masked(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = "hf_Zq8x3Lp0secretvalue"
    caplog.set_level(logging.INFO)
    # The sim engine's --refuse prints its message and exits: an engine echoing its credentials.
    profile = sim_profile("--refuse", f"bad credentials {token} for tiny", env={"HF_TOKEN": token})
    config = agent_config(nats_url, prefix, tmp_path / "agent")
    async with shard_events(bus) as events, running_launcher(config):
        await bus.put(bus.names.shards_bucket, "node-a.s1", shard("node-a", "s1", profile))
        failed = await eventually(lambda: [s for s in events.of("s1") if s.state == "failed"], timeout=20)
        reason = failed[0].reason
        assert "llmgw-sim: refusing to start: bad credentials *** for tiny" in reason
        assert token not in reason
        stored = await bus.get(bus.names.shard_status_bucket, "node-a.s1", ShardStatus)
        assert stored is not None
        assert token not in stored[0].reason
    assert token not in caplog.text
    assert "bad credentials *** for tiny" in caplog.text
    # The engine itself had it: the log it wrote says so.
    logs = list((tmp_path / "agent" / "logs").rglob("*.log"))
    assert any(token in p.read_text() for p in logs)
