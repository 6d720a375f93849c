"""The address a node advertises when agent.yaml names none: its management interface's, else
its default route's, never loopback while it has another (probe.pick_mgmt_addr).

Regression: an unset `mgmt_addr` was 127.0.0.1 (AgentConfig's default, the probe's
`gethostbyname("localhost")`): on a fleet every engine URL, member address and weights offer
a node advertised sent the other hosts to themselves."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw_core.config import AgentConfig
from llmgw_core.events import NetInterface
from llmgw_core.probe import (
    IP_ADDR,
    CommandResult,
    Probe,
    default_route_interface,
    pick_mgmt_addr,
    with_mgmt_addr,
)

FIXTURES = Path(__file__).parent / "fixtures"
IP_JSON = (FIXTURES / "ip-addr-gpu-node.json").read_text()
HEADER = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
ROUTES = HEADER + (
    "ibp26s0\t00000000\t0132A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"
    "eno1\t00000000\t0102010A\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
    "eno1\t0002010A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
)
LO = NetInterface(name="lo", addresses=("127.0.0.1/8", "::1/128"))
ETH = NetInterface(name="ens5", addresses=("fe80::1/64", "10.0.0.5/24"))
BOND = NetInterface(name="bond0", addresses=("169.254.3.4/16", "172.16.0.9/16"))
DOWN = NetInterface(name="eno2", addresses=("10.9.9.9/24",), up=False)


def _probe(tmp_path: Path, routes: str, **kw: str) -> Probe:
    (tmp_path / "proc/net").mkdir(parents=True)
    (tmp_path / "proc/net/route").write_text(routes)

    def run(argv: list[str]) -> CommandResult:
        return CommandResult(0, IP_JSON) if argv == IP_ADDR else CommandResult(127, "")

    return Probe("gpu-01", root=tmp_path, run=run, **kw)


def test_the_default_route_with_the_lowest_metric_names_the_interface() -> None:
    assert default_route_interface(ROUTES) == "eno1"
    # Not up (flags without RTF_UP), or not a default route: no interface.
    assert (
        default_route_interface(HEADER + "eno1\t00000000\t0102010A\t0002\t0\t0\t0\t00000000\t0\t0\t0\n") == ""
    )
    assert (
        default_route_interface(HEADER + "eno1\t0002010A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n") == ""
    )
    assert default_route_interface("") == ""
    # A line that is no route is skipped, the rest still read.
    hostile = HEADER + "x" * 40 + "\t00000000\t0\t1\t0\t0\t0\t00000000\n" + "eno1\t00000000\tz\tzz\n" + ROUTES
    assert default_route_interface(hostile) == "eno1"


def test_the_operators_interface_then_the_default_routes_then_any_but_loopback_then_loopback() -> None:
    interfaces = (LO, DOWN, BOND, ETH)
    assert pick_mgmt_addr(interfaces, "bond0", "ens5") == "172.16.0.9"  # link-local skipped
    assert pick_mgmt_addr(interfaces, "", "ens5") == "10.0.0.5"
    # An interface named that holds no IPv4 address: the next rule decides.
    assert pick_mgmt_addr(interfaces, "ib0", "") == "172.16.0.9"
    # No route: the first interface up that is neither loopback nor link-local.
    assert pick_mgmt_addr((LO, DOWN, ETH), "", "") == "10.0.0.5"
    assert pick_mgmt_addr((LO, DOWN), "", "") == "127.0.0.1"
    assert pick_mgmt_addr((), "", "") == "127.0.0.1"


def test_a_node_without_a_mgmt_addr_reports_its_default_routes_address_and_interface(tmp_path: Path) -> None:
    facts = _probe(tmp_path, ROUTES).facts()
    assert (facts.mgmt_addr, facts.mgmt_iface) == ("10.1.2.11", "eno1")


def test_a_node_naming_only_its_interface_reports_that_interfaces_address(tmp_path: Path) -> None:
    facts = _probe(tmp_path, ROUTES, mgmt_iface="ibp26s0").facts()
    assert (facts.mgmt_addr, facts.mgmt_iface) == ("192.168.50.11", "ibp26s0")


def test_agent_yaml_leaves_mgmt_addr_out_by_default_and_an_address_given_is_kept() -> None:
    config = msgspec.convert({"node": "n1"}, AgentConfig)
    assert config.mgmt_addr == ""
    given_one = msgspec.convert({"node": "n1", "mgmt_addr": "10.1.2.3"}, AgentConfig)
    assert with_mgmt_addr(given_one) is given_one
    assert with_mgmt_addr(config).mgmt_addr  # whatever this machine has: never left empty


_lines = st.lists(
    st.one_of(
        st.text(max_size=80),
        st.tuples(
            st.text(st.characters(blacklist_categories=("Z", "C")), max_size=20),
            st.sampled_from(["00000000", "0102010A", "zz", ""]),
            st.text(max_size=12),
            st.text(max_size=12),
        ).map(lambda t: f"{t[0]}\t{t[1]}\t0\t{t[2]}\t0\t0\t{t[3]}\t00000000\t0\t0\t0"),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=200)
@given(_lines)
def test_any_route_table_gives_an_interface_name_or_nothing_and_never_raises(lines: list[str]) -> None:
    found = default_route_interface(HEADER + "\n".join(lines))
    assert isinstance(found, str)
    assert len(found) <= 15
    assert not any(c.isspace() for c in found)


_interfaces = st.lists(
    st.builds(
        NetInterface,
        name=st.sampled_from(["lo", "ens5", "bond0", "eno1", ""]),
        addresses=st.lists(
            st.one_of(
                st.text(max_size=40),
                st.ip_addresses(v=4).map(lambda a: f"{a}/24"),
                st.ip_addresses(v=6).map(lambda a: f"{a}/64"),
            ),
            max_size=5,
        ).map(tuple),
        up=st.booleans(),
    ),
    max_size=8,
).map(tuple)


@settings(max_examples=300, deadline=200)
@given(_interfaces, st.sampled_from(["", "ens5", "lo", "nope"]), st.sampled_from(["", "bond0", "eno1"]))
def test_any_interfaces_give_an_ipv4_address_and_never_raise(
    interfaces: tuple[NetInterface, ...], mgmt_iface: str, route_iface: str
) -> None:
    addr = pick_mgmt_addr(interfaces, mgmt_iface, route_iface)
    assert ipaddress.ip_address(addr).version == 4
