"""Hosts of their own on this machine: one network namespace each, all on one bridge.

API (stable; tests/multihost/fleet.py and the partition tests build on it):

    with hosts(root, ("a", "b", "c")) as net:      # or the `make_hosts` fixture
        b = net["b"]
        b.addr, b.iface, b.hostname, b.state       # 10.1xx.N.2, "ens5", "llmgw-b", root/b
        net.root_addr                              # the bridge's address: clients in the root namespace
        proc = b.spawn("launcher", argv, env)      # inside b's namespace, under b's hostname
        b.log("launcher")                          # what it wrote (b.state / "launcher.log")
        b.run(["ip", "-o", "addr"], env=env)       # a short command on b, waited for
        b.cut(net["c"])                            # b drops everything to and from c
        b.cut(net["c"], inbound=False)             # one-sided: b's packets to c are dropped
        b.cut()                                    # b drops everything but its loopback
        b.heal()                                   # every rule of b's gone
        b.kill("launcher"); b.stop()               # SIGKILL one process group; all of b's

A `Host` is a namespace with one veth on the bridge, renamed to an interface name of its own
(`mgmt0` on the first, `ens5`, `bond0`, … on the others: nodes must find their interface by
name, not assume `eth0`), a default route through the bridge, and a hostname that every
process spawned on it sees (`unshare --uts`, then `hostname`). The root namespace holds the
bridge's address, so clients (the test itself, `ctl`) run there and reach every host.

Names. Every namespace, veth and the bridge carries this harness's token (`lh<worker><hex>`):
other test runs (xdist workers, other checkouts) make clusters on one machine at once, so nothing made by
another is ever touched. Bridge and veth names stay within the kernel's 15 characters. Each
`Hosts` takes a /24 of its own, 10.(100+worker).N.0/24, N chosen under a lock file among the
subnets no address of the root namespace holds yet.

Partitions. `cut` adds DROP rules to the INPUT and OUTPUT chains inside the host's namespace
(its own netfilter tables, so nothing outside it changes); a peer is a `Host` or an address.

Teardown (`close`, always run by `hosts()` and the fixtures, even when the test fails): the
recorded process groups are killed, then whatever still runs in the namespace (`ip netns
pids`: engines that left their group), then the namespaces (which takes their veths) and the
bridge are deleted. A run killed before its teardown leaves them; the next run of the same
test (the fixtures pass its node id as `owner`) removes them, and only them: those recorded
for that test by a process that is gone.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Interface names of the hosts, in order: the first is `mgmt0`, no two alike.
IFACE_NAMES = ("mgmt0", "ens5", "bond0", "enp3s0", "eno1", "ens6", "bond1", "enp4s0", "eno2", "ens7")
LOCK_FILE = Path("/run/lock/llmgw-multihost.lock")
# One file per live token: the pid that made it and the test it is for (`open_hosts(owner=)`).
OWNERS = Path("/run/lock/llmgw-multihost")
IFNAMSIZ = 15


class NetError(RuntimeError):
    """A namespace, link or rule could not be made: the command, and what it said."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise NetError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def net_admin_problem() -> str:
    """Why this process cannot make network namespaces ("" when it can)."""
    if os.geteuid() != 0:
        return "multihost tests need root (CAP_NET_ADMIN) to make network namespaces"
    for tool in ("ip", "iptables", "unshare", "hostname"):
        if not any(Path(d, tool).exists() for d in [*os.environ.get("PATH", "").split(":"), "/usr/sbin"]):
            return f"multihost tests need `{tool}` on PATH"
    probe = f"lhprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed (no CAP_NET_ADMIN?): {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    uts = subprocess.run(["unshare", "--uts", "true"], capture_output=True, text=True, check=False)
    if uts.returncode != 0:
        return f"`unshare --uts` failed (no CAP_SYS_ADMIN?): {uts.stderr.strip()}"
    return ""


def worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return int(worker) % 100 if worker.isdigit() else 0


@dataclass
class Host:
    name: str
    ns: str
    addr: str
    iface: str
    hostname: str
    state: Path
    prefix_len: int = 24
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` as run inside this host: its namespace, a UTS namespace with its hostname."""
        return [
            "ip", "netns", "exec", self.ns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname,
            *argv,
        ]  # fmt: skip

    def spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start `argv` on this host as `name`, in a process group of its own (its pid), its
        output appended to `self.state / f"{name}.log"`; `env` replaces the environment."""
        self.state.mkdir(parents=True, exist_ok=True)
        with (self.state / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen(
                self.wrap(argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def run(
        self, argv: Sequence[str], timeout: float = 30, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """A short command on this host (its namespace and hostname), waited for; `env`
        replaces the environment."""
        return subprocess.run(
            self.wrap(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=dict(env) if env is not None else None,
        )

    def log(self, name: str) -> str:
        path = self.state / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def kill(self, name: str) -> None:
        """SIGKILL the process group of `name` and reap it."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def _iptables(self, *args: str) -> None:
        done = self.run(["iptables", "-w", "5", *args])
        if done.returncode != 0:
            raise NetError(f"{self.name}: iptables {' '.join(args)}: {done.stderr.strip()}")

    def cut(self, *peers: Host | str, inbound: bool = True, outbound: bool = True) -> None:
        """Drop this host's traffic with `peers` (hosts or addresses; none: every peer but its
        own loopback): what arrives from them (`inbound`) and what it sends them (`outbound`)."""
        addrs = [p.addr if isinstance(p, Host) else str(ipaddress.ip_address(p)) for p in peers]
        if not addrs:
            if inbound:
                self._iptables("-A", "INPUT", "!", "-i", "lo", "-j", "DROP")
            if outbound:
                self._iptables("-A", "OUTPUT", "!", "-o", "lo", "-j", "DROP")
        for addr in addrs:
            if inbound:
                self._iptables("-A", "INPUT", "-s", addr, "-j", "DROP")
            if outbound:
                self._iptables("-A", "OUTPUT", "-d", addr, "-j", "DROP")

    def heal(self) -> None:
        """Remove every rule `cut` added (the namespace's INPUT and OUTPUT chains are flushed)."""
        self._iptables("-F", "INPUT")
        self._iptables("-F", "OUTPUT")

    def pids(self) -> list[int]:
        """Every process running in this host's namespace (its agents' engines too)."""
        listed = _ip("netns", "pids", self.ns, check=False)
        return [int(w) for w in listed.stdout.split() if w.isdigit()]

    def stop(self) -> None:
        """Kill every process of this host: the recorded groups, then whatever else runs in it."""
        for name in list(self.procs):
            self.kill(name)
        for _ in range(50):
            left = self.pids()
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)


@dataclass
class Hosts:
    root: Path
    token: str
    subnet: ipaddress.IPv4Network
    bridge: str
    hosts: dict[str, Host] = field(default_factory=dict)

    @property
    def root_addr(self) -> str:
        """The bridge's address in the root namespace, where clients run."""
        return str(self.subnet.network_address + 254)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def _veth(self, i: int, side: str) -> str:
        name = f"{self.token}{side}{i}"
        assert len(name) <= IFNAMSIZ, name
        return name

    def add(self, name: str, iface: str = "") -> Host:
        """A host more: its namespace, its veth on the bridge (named `iface` inside), its address."""
        i = len(self.hosts) + 1
        host = Host(
            name=name,
            ns=f"{self.token}-{name}",
            addr=str(self.subnet.network_address + i),
            iface=iface or IFACE_NAMES[(i - 1) % len(IFACE_NAMES)],
            hostname=f"llmgw-{name}",
            state=self.root / name,
        )
        assert len(host.iface) <= IFNAMSIZ, host.iface
        self.hosts[name] = host  # recorded first: close() removes what was half made
        outside, inside = self._veth(i, "v"), self._veth(i, "p")
        _ip("netns", "add", host.ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", outside, "master", self.bridge, "up")
        _ip("link", "set", inside, "netns", host.ns)
        _ip("-n", host.ns, "link", "set", inside, "name", host.iface)
        _ip("-n", host.ns, "addr", "add", f"{host.addr}/{self.subnet.prefixlen}", "dev", host.iface)
        _ip("-n", host.ns, "link", "set", host.iface, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        _ip("-n", host.ns, "route", "add", "default", "via", self.root_addr)
        host.state.mkdir(parents=True, exist_ok=True)
        return host

    def close(self) -> None:
        """Kill every process of every host, delete the namespaces and the bridge: only this token's."""
        for host in self.hosts.values():
            with contextlib.suppress(Exception):
                host.stop()
        leftovers(self.token)


def _taken_subnets() -> set[ipaddress.IPv4Network]:
    listed = _ip("-4", "-o", "addr", "show")
    taken = set()
    for line in listed.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            taken.add(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    return taken


def leftovers(token: str) -> None:
    """Delete the namespaces, veths and bridge named with `token` (and only those)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(f"{token}-"):
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        link = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        if link.startswith(token) and link != f"{token}br":
            _ip("link", "del", link, check=False)
    _ip("link", "del", f"{token}br", check=False)
    (OWNERS / token).unlink(missing_ok=True)


def argv_of(pid: int) -> list[str]:
    """The command line of a process a test recorded (by its pid, never found by name)."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def environ_of(pid: int) -> dict[str, str]:
    """The environment a recorded process started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _clean_own_leftovers(owner: str) -> None:
    """Remove what an earlier run of the same test (`owner`) left when it was killed before its
    teardown: only tokens OWNERS records for `owner` whose process is gone (under the lock)."""
    for entry in OWNERS.glob("lh*"):
        try:
            pid_text, recorded = entry.read_text().split("\n", 1)
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if recorded == owner and not _alive(pid):
            leftovers(entry.name)
            entry.unlink(missing_ok=True)


def open_hosts(
    root: Path, names: Sequence[str], ifaces: Mapping[str, str] | None = None, owner: str = ""
) -> Hosts:
    """Make a bridge and one host per name (close() it: `hosts()` does). `owner` (the test's
    node id) is recorded with the token, so that a later run of that test removes what this
    one leaves if it is killed before its teardown."""
    token = f"lh{worker_index()}{secrets.token_hex(2)}"
    root.mkdir(parents=True, exist_ok=True)
    OWNERS.mkdir(parents=True, exist_ok=True)
    # The subnet is chosen and the bridge given its address under one lock: two tests starting
    # at once on this machine must not take the same /24 (their routes would clash).
    with LOCK_FILE.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if owner:
            _clean_own_leftovers(owner)
        (OWNERS / token).write_text(f"{os.getpid()}\n{owner}")
        taken = _taken_subnets()
        second = 100 + worker_index()
        free = [
            net
            for n in range(1, 254)
            if (net := ipaddress.IPv4Network(f"10.{second}.{n}.0/24")) not in taken
            and not any(net.overlaps(t) for t in taken)
        ]
        if not free:
            raise NetError(f"no free /24 left in 10.{second}.0.0/16 for a multihost test")
        net = Hosts(root=root, token=token, subnet=free[0], bridge=f"{token}br")
        try:
            _ip("link", "add", net.bridge, "type", "bridge")
            _ip("addr", "add", f"{net.root_addr}/24", "dev", net.bridge)
            _ip("link", "set", net.bridge, "up")
        except BaseException:
            leftovers(token)
            raise
    try:
        for name in names:
            net.add(name, (ifaces or {}).get(name, ""))
    except BaseException:
        net.close()
        raise
    return net


@contextlib.contextmanager
def hosts(
    root: Path, names: Sequence[str], ifaces: Mapping[str, str] | None = None, owner: str = ""
) -> Iterator[Hosts]:
    """Hosts named `names` (state under `root`), torn down at the end whatever happened."""
    net = open_hosts(root, names, ifaces, owner)
    try:
        yield net
    finally:
        net.close()
