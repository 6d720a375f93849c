"""compose.yaml and the examples, as the containers would run them (without Docker): the
one-shot auth service's command writes the identities, nats-server loads compose's own
configuration with them, and each example config names a seed file that command wrote."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from llmgw.auth import AuthDir
from llmgw.cli import main
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig, load
from llmgw_core.errors import BusError
from llmgw_core.natsd import find_nats_server
from llmgw_placement.config import ServerConfig

ROOT = Path(__file__).parent.parent

pytestmark = pytest.mark.anyio


def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return loaded


def mounts(service: dict[str, Any], volume: str) -> list[str]:
    return [v.split(":")[1] for v in service.get("volumes", []) if v.split(":")[0] == volume]


def in_container(path: str, root: Path) -> Path:
    """A container's path under `root`, where this test lays out the volumes."""
    return root / path.lstrip("/")


@pytest.fixture
def layout(tmp_path: Path) -> Path:
    """The auth service's command, run here, its volume mounted where compose mounts it."""
    auth_service = compose()["services"]["auth"]
    argv = auth_service["command"]
    assert argv[:3] == ["llmgw", "auth", "init"]
    [auth_dir] = mounts(auth_service, "llmgw-auth")
    assert argv[argv.index("--dir") + 1] == auth_dir
    local = [
        a.replace(auth_dir, str(in_container(auth_dir, tmp_path)), 1) if a == auth_dir else a for a in argv
    ]
    assert main(local[1:]) == 0
    # The same volume, where nats-server sees it.
    [nats_auth] = mounts(compose()["services"]["nats"], "llmgw-auth")
    in_container(nats_auth, tmp_path).parent.mkdir(parents=True, exist_ok=True)
    in_container(nats_auth, tmp_path).symlink_to(in_container(auth_dir, tmp_path))
    return tmp_path


@pytest.fixture
def nats(layout: Path) -> Iterator[int]:
    """nats-server on compose's own configuration (the store and address moved for this machine)."""
    [(source, target)] = [
        (v.split(":")[0], v.split(":")[1])
        for v in compose()["services"]["nats"]["volumes"]
        if v.split(":")[0].endswith(".conf")
    ]
    conf = in_container(target, layout)
    conf.write_text((ROOT / source).read_text().replace("/data", str(layout / "data")))
    checked = subprocess.run([find_nats_server(), "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", "-1", "-m", "-1"],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            m = re.search(r"Listening for client connections on 127.0.0.1:(\d+)", line)
            if m:
                port = int(m.group(1))
            if "Server is ready" in line:
                break
        yield port
    finally:
        proc.terminate()
        proc.communicate(timeout=10)


def test_every_llmgw_service_connects_as_an_identity_the_auth_service_writes(layout: Path) -> None:
    services = compose()["services"]
    [auth_dir] = mounts(services["auth"], "llmgw-auth")
    server = load(ROOT / "examples" / "server.yaml", ServerConfig)
    agent = load(ROOT / "examples" / "agent.yaml", AgentConfig)
    for name, seed in [
        ("placement", server.nats.nkey_seed_file),
        ("installer", agent.nats.nkey_seed_file),
        ("launcher", agent.nats.nkey_seed_file),
    ]:
        assert mounts(services[name], "llmgw-auth") == [auth_dir], name
        assert services[name]["depends_on"]["auth"] == {"condition": "service_completed_successfully"}
        assert in_container(seed, layout).is_file(), (name, seed)
    assert seed == f"{auth_dir}/node-{agent.node}.nk"
    for token in (server.http.token_file, server.http.read_token_file):
        assert in_container(token, layout).is_file()
    # Running the auth service again (every `docker compose up`) keeps the keys.
    keys = AuthDir(in_container(auth_dir, layout)).identities()
    argv = services["auth"]["command"]
    assert main([a.replace(auth_dir, str(in_container(auth_dir, layout))) for a in argv[1:]]) == 0
    assert AuthDir(in_container(auth_dir, layout)).identities() == keys


async def test_compose_nats_takes_the_examples_identities_and_nobody_else(layout: Path, nats: int) -> None:
    server = load(ROOT / "examples" / "server.yaml", ServerConfig)
    url = f"nats://127.0.0.1:{nats}"
    seed = str(in_container(server.nats.nkey_seed_file, layout))
    async with await Bus.connect(BusOptions(url=url, nkey_seed_file=seed), service="placement") as placement:
        await placement.ensure()
    with pytest.raises(BusError, match="Authorization Violation"):
        await Bus.connect(BusOptions(url=url, insecure=True), service="placement")
