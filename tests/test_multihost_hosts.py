"""The multihost harness itself (tests/multihost/hosts.py): hosts with their own address,
interface and hostname, reachable from the root namespace and each other; partitions that
are total, towards some peers, or one-sided; and nothing of a test's left once it ends."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.multihost.fixtures import require
from tests.multihost.hosts import OWNERS, Host, Hosts, net_admin_problem, open_hosts

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(120)]

PORT = 7000
# Listens on the host's address: a TCP port that accepts, and UDP datagrams written to its log.
LISTENER = """
import socket, sys, threading
addr = sys.argv[1]
udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
udp.bind((addr, 7000))
tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind((addr, 7000))
tcp.listen()
print("listening", flush=True)
def accept():
    while True:
        tcp.accept()[0].close()
threading.Thread(target=accept, daemon=True).start()
while True:
    data, peer = udp.recvfrom(1024)
    print("got", data.decode(), "from", peer[0], flush=True)
"""
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 7000), timeout=1).close()"
SEND = (
    "import socket, sys; "
    "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(sys.argv[2].encode(), (sys.argv[1], 7000))"
)


def _listen(host: Host) -> None:
    host.spawn("listener", [sys.executable, "-c", LISTENER, host.addr])
    deadline = time.monotonic() + 30
    while "listening" not in host.log("listener"):
        assert time.monotonic() < deadline, host.log("listener")
        time.sleep(0.05)


def _reaches(src: Host | None, dst: Host) -> bool:
    """Whether a TCP connection from `src` (None: the root namespace) to `dst` is accepted."""
    argv = [sys.executable, "-c", CONNECT, dst.addr]
    done = src.run(argv) if src is not None else subprocess.run(argv, capture_output=True, check=False)
    return done.returncode == 0


def _datagram_arrives(src: Host, dst: Host, word: str) -> bool:
    """Send `word` from `src` to `dst` by UDP; whether `dst` got it within a second."""
    src.run([sys.executable, "-c", SEND, dst.addr, word])
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if f"got {word} from {src.addr}" in dst.log("listener"):
            return True
        time.sleep(0.05)
    return False


def test_each_host_has_its_own_address_interface_and_hostname_and_all_reach_each_other(
    make_hosts: Callable[..., Hosts],
) -> None:
    net = make_hosts("a", "b", "c")
    a, b, c = net["a"], net["b"], net["c"]
    assert [h.iface for h in net] == ["mgmt0", "ens5", "bond0"]
    assert len({h.addr for h in net}) == 3
    assert all(h.addr.startswith(str(net.subnet.network_address).rsplit(".", 1)[0]) for h in net)
    for host in net:
        named = host.run(["hostname"])
        assert named.stdout.strip() == f"llmgw-{host.name}"
        listed = host.run(["ip", "-o", "-4", "addr", "show", "dev", host.iface])
        assert f"inet {host.addr}/24" in listed.stdout, listed.stdout
        _listen(host)
    assert _reaches(None, a)
    assert _reaches(b, a)
    assert _reaches(c, b)
    assert _reaches(a, c)


def test_cut_drops_traffic_with_the_peers_named_one_sided_or_total_and_heal_restores_it(
    make_hosts: Callable[..., Hosts],
) -> None:
    net = make_hosts("a", "b", "c")
    a, b, c = net["a"], net["b"], net["c"]
    for host in net:
        _listen(host)

    a.cut(b)  # both ways, b only
    assert not _reaches(a, b)
    assert not _reaches(b, a)
    assert _reaches(a, c)
    assert _reaches(c, a)
    a.heal()
    assert _reaches(b, a)

    a.cut(b, inbound=False)  # what a sends b is lost; what b sends a arrives
    assert not _datagram_arrives(a, b, "one")
    assert _datagram_arrives(b, a, "two")
    a.heal()
    assert _datagram_arrives(a, b, "three")

    a.cut()  # everything but a's loopback
    assert not _reaches(None, a)
    assert not _reaches(c, a)
    assert not _reaches(a, b)
    assert _reaches(a, a)  # its own traffic goes over its loopback
    a.heal()
    assert _reaches(None, a)
    assert _reaches(c, a)


def test_closing_kills_the_hosts_processes_and_removes_their_namespaces_and_links(
    make_hosts: Callable[..., Hosts],
) -> None:
    net = make_hosts("a", "b")
    proc = net["a"].spawn("sleeper", ["sleep", "600"])
    # A process that left its group (as an engine does) is found in the namespace all the same.
    net["b"].spawn("wrapper", ["sh", "-c", "setsid sleep 600 & wait"])
    deadline = time.monotonic() + 10
    while len(net["b"].pids()) < 2:
        assert time.monotonic() < deadline, net["b"].pids()
        time.sleep(0.05)
    strays = net["b"].pids()
    net.close()
    assert proc.poll() is not None
    for pid in strays:
        assert not _alive(pid), pid
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert net.token not in namespaces
    assert net.token not in links


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def test_without_net_admin_the_tests_are_skipped_saying_why_and_with_ci_true_they_fail(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    problem = net_admin_problem()
    assert problem == "multihost tests need root (CAP_NET_ADMIN) to make network namespaces"
    with pytest.raises(pytest.skip.Exception, match="need root"):
        require(problem, {})
    with pytest.raises(pytest.fail.Exception, match=r"need root .*; CI=true runs every multihost test"):
        require(problem, {"CI": "true"})
    require("", {"CI": "true"})  # where it can, nothing happens


def test_a_run_killed_before_its_teardown_is_cleaned_by_the_next_run_of_the_same_test_only(
    net_admin: None, tmp_path: Path
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid no process has: the run that made these was killed
    killed = open_hosts(tmp_path / "killed", ["a"], owner="test-x")
    other = open_hosts(tmp_path / "other", ["a"], owner="test-y")
    live = open_hosts(tmp_path / "live", ["a"], owner="test-x")
    again: Hosts | None = None
    try:
        (OWNERS / killed.token).write_text(f"{gone.pid}\ntest-x")
        (OWNERS / other.token).write_text(f"{gone.pid}\ntest-y")
        again = open_hosts(tmp_path / "again", ["a"], owner="test-x")
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
        namespaces = listed.stdout
        assert killed.token not in namespaces
        assert not (OWNERS / killed.token).exists()
        # Another test's leftovers, and a run of this test still alive, are not touched.
        assert other.token in namespaces
        assert live.token in namespaces
    finally:
        for net in (killed, other, live, again):
            if net is not None:
                net.close()
