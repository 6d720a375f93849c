"""The pytest fixtures of the multihost harness (loaded by tests/conftest.py as a plugin).

    net_admin                      skips the test, saying why, where this process cannot make
                                   network namespaces (not root, no `ip netns`); with CI=true
                                   it fails instead: CI must run them.
    make_hosts(*names, ifaces={})  a `Hosts` (tests/multihost/hosts.py) under tmp_path/hosts;
                                   every one made is torn down at the end, pass or fail.
    make_fleet(net, **options)     a `Fleet` (tests/multihost/fleet.py) on those hosts,
                                   stopped at the end before its hosts are.

Tests that take them are marked `multihost` (`pytestmark = pytest.mark.multihost`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.multihost.fleet import Fleet
from tests.multihost.hosts import Hosts, net_admin_problem, open_hosts


def require(problem: str, environ: Mapping[str, str]) -> None:
    """Nothing where `problem` is ""; else skip the test saying it, or fail it with CI=true."""
    if problem:
        if environ.get("CI") == "true":
            pytest.fail(f"{problem}; CI=true runs every multihost test")
        pytest.skip(problem)


@pytest.fixture
def net_admin() -> None:
    require(net_admin_problem(), os.environ)


@pytest.fixture
def make_hosts(
    net_admin: None, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Hosts]]:
    made: list[Hosts] = []

    def make(*names: str, ifaces: dict[str, str] | None = None) -> Hosts:
        owner = f"{request.node.nodeid}#{len(made)}"
        net = open_hosts(tmp_path / f"hosts{len(made) or ''}", names, ifaces, owner)
        made.append(net)
        return net

    try:
        yield make
    finally:
        for net in reversed(made):
            net.close()


@pytest.fixture
def make_fleet(net_admin: None, prefix: str) -> Iterator[Callable[..., Fleet]]:
    made: list[Fleet] = []

    def make(net: Hosts, **options: Any) -> Fleet:
        fleet = Fleet(net, prefix=prefix, **options)
        made.append(fleet)
        return fleet

    try:
        yield make
    finally:
        for fleet in reversed(made):
            fleet.close()
