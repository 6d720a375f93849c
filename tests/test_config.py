from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_core.config import AgentConfig, load
from llmgw_core.errors import ConfigError
from llmgw_placement.config import ServerConfig


def test_agent_yaml_errors_name_the_file_and_the_path(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node: gpu-01\nsimulate:\n  gpu_count: many\n")
    with pytest.raises(ConfigError) as err:
        load(path, AgentConfig)
    assert str(err.value) == f"{path}: Expected `int`, got `str` - at `$.simulate.gpu_count`"
    assert err.value.retryable is False


def test_a_node_id_that_would_split_a_subject_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node: gpu-01.dc1.example.com\n")
    with pytest.raises(ConfigError) as err:
        load(path, AgentConfig)
    assert str(err.value) == (f"{path}: Expected `str` matching regex '^[A-Za-z0-9_-]+$' - at `$.node`")


def test_a_restart_backoff_that_cannot_be_drawn_is_refused(tmp_path: Path) -> None:
    """Regression: a cap below the base, or a base of 0 (an engine restarted in a hot loop),
    was taken as given; the shard's runner now draws its waits between the two."""
    path = tmp_path / "agent.yaml"
    path.write_text("node: gpu-01\nrestart_backoff_s: 10\nrestart_backoff_cap_s: 5\n")
    with pytest.raises(ConfigError) as err:
        load(path, AgentConfig)
    assert str(err.value) == (
        f"{path}: restart_backoff_cap_s (5) is below restart_backoff_s (10): the cap is the longest "
        "wait between restarts; raise it or lower restart_backoff_s"
    )
    path.write_text("node: gpu-01\nrestart_backoff_s: 0\n")
    with pytest.raises(ConfigError) as err:
        load(path, AgentConfig)
    assert str(err.value) == f"{path}: Expected `float` > 0.0 - at `$.restart_backoff_s`"


def test_server_yaml_errors_and_unknown_keys(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("catalog:\n  - name: tiny\n    engine: sim\n    model_path: sim://x\n    tpp: 2\n")
    with pytest.raises(ConfigError):
        load(path, ServerConfig)
    path.write_text("deployments:\n  - name: chat\n    profile: tiny\n    replicas: -1\n")
    with pytest.raises(ConfigError) as err:
        load(path, ServerConfig)
    assert str(err.value) == f"{path}: Expected `int` >= 0 - at `$.deployments[0].replicas`"
    path.write_text("pools: [\n")
    with pytest.raises(ConfigError) as err:
        load(path, ServerConfig)
    # The file, line and column (msgspec's own message names `"<byte string>"`).
    assert str(err.value) == (
        f"{path}:2:1: not valid YAML: expected the node content, but found '<stream end>'"
    )
    path.write_text("catalog:\n  - name: tiny\n    engine: sim\n  model_path: x\n")
    with pytest.raises(ConfigError) as err:
        load(path, ServerConfig)
    assert str(err.value) == (
        f"{path}:4:3: not valid YAML: expected <block end>, but found '?' "
        "(while parsing a block collection at line 2, column 3)"
    )


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path / "nope.yaml", AgentConfig)
    assert str(err.value) == f"{tmp_path / 'nope.yaml'}: cannot read: No such file or directory"


def test_defaults_work_on_one_machine() -> None:
    config = ServerConfig()
    assert config.node_timeout_s == 5.0
    assert config.heartbeat_interval_s == 1.0
    assert [e.name for e in config.engines] == ["llamacpp"]


def test_the_example_configs_decode() -> None:
    root = Path(__file__).parent.parent / "examples"
    server = load(root / "server.yaml", ServerConfig)
    assert [d.name for d in server.deployments] == ["chat"]
    assert load(root / "agent.yaml", AgentConfig).node == "node-1"
