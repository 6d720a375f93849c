"""Who holds an engine's port: the listening sockets of /proc/net/tcp{,6} and the processes
whose descriptors are those sockets.

An answer on the engine's port is not the engine's answer. A process that
took the port first (a stale engine of another launcher, a developer's test
server) answers `/health` like an engine would, and the launcher would call
the shard ready and the gateway would send users to it while the real
engine dies with "Address already in use". So before a shard starts, its
port must be free, and before it is ready, every socket listening on it must
be one of the engine's own processes (the processes it started and their
descendants: vLLM's API server forks, a wrapper script execs).

The functions read procfs and block: the launcher calls them from a worker
thread. Where there is no procfs (not Linux), nothing can be told and
nothing is refused. `PortPool` is the node's range of engine ports: which
of them this launcher handed out, and a free one on request.
"""

from __future__ import annotations

import ipaddress
import os
import random
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN = "0A"
# A command line quoted in a reason is cut here: some carry a whole config.
CMDLINE_LIMIT = 200


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: its address, port, socket inode and owning uid."""

    addr: str
    port: int
    inode: int
    uid: int


def listeners(port: int, proc: Path = PROC) -> list[Listener] | None:
    """The sockets listening on `port` (any address, IPv4 and IPv6); None where procfs has no
    /proc/net/tcp (nothing can be told)."""
    found: list[Listener] = []
    readable = False
    for name in ("tcp", "tcp6"):
        try:
            text = (proc / "net" / name).read_text()
        except OSError:
            continue
        readable = True
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            hex_addr, _, hex_port = fields[1].partition(":")
            if int(hex_port, 16) != port:
                continue
            found.append(Listener(_address(hex_addr), port, int(fields[9]), int(fields[7])))
    return found if readable else None


def _address(hex_addr: str) -> str:
    """An address as /proc/net/tcp{,6} prints it (each 32-bit word in host byte order)."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(words))
    v6 = ipaddress.IPv6Address(words)
    return str(v6.ipv4_mapped or v6)


def reaches(listener: Listener, host: str) -> bool:
    """Whether a connection to `host` on the listener's port may land on it: the same address,
    or a wildcard; and every listener of the port, for a wildcard or a name (which may be any
    address)."""
    if listener.addr in ("0.0.0.0", "::") or host in ("", "0.0.0.0", "::"):
        return True
    try:
        return ipaddress.ip_address(host) == ipaddress.ip_address(listener.addr)
    except ValueError:
        return True


def socket_inodes(pid: int, proc: Path = PROC) -> set[int]:
    """The socket inodes among the open descriptors of `pid` (empty if it is gone or not ours to read)."""
    found: set[int] = set()
    fd_dir = proc / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def _parents(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry.name)] = int(fields[1])
    return parents


def descendants(roots: Iterable[int], proc: Path = PROC) -> set[int]:
    """`roots` and every process descended from them."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents(proc).items():
        children.setdefault(ppid, []).append(pid)
    tree: set[int] = set()
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo.extend(children.get(pid, ()))
    return tree


def owner(inode: int, proc: Path = PROC) -> int | None:
    """A process that has the socket `inode` open, None if none this process can see."""
    for entry in proc.iterdir():
        if entry.name.isdigit() and inode in socket_inodes(int(entry.name), proc):
            return int(entry.name)
    return None


def cmdline(pid: int, proc: Path = PROC) -> str:
    """The command line of `pid` as it was started ("python3 squat.py"), cut to CMDLINE_LIMIT."""
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace") or "?"
    return text if len(text) <= CMDLINE_LIMIT else text[: CMDLINE_LIMIT - 1] + "…"


def _held_by(listener: Listener, proc: Path) -> str:
    pid = owner(listener.inode, proc)
    if pid is None:
        return (
            f"port {listener.port} is held by a process of uid {listener.uid} that the launcher "
            f"cannot inspect (listening on {listener.addr}); stop it or give the launcher another port_range"
        )
    return f"port {listener.port} is held by pid {pid} ({cmdline(pid, proc)})"


def held(port: int, host: str, proc: Path = PROC) -> str | None:
    """Before an engine starts: None if nothing listens where it would, else who holds the port."""
    found = listeners(port, proc)
    for listener in found or ():
        if reaches(listener, host):
            return _held_by(listener, proc)
    return None


def foreign(port: int, host: str, roots: Iterable[int], proc: Path = PROC) -> str | None:
    """Before a shard is called ready: None if every socket listening on `port` where `host`
    reaches it belongs to the processes `roots` or their descendants, else who else holds it.

    The roots' own descriptors are looked at first; the whole process table is read only when
    a socket is not theirs (a forked server, or a squatter)."""
    found = listeners(port, proc)
    if not found:
        # No procfs, or nothing listens where the health answer came from (another network
        # namespace): nothing this check can tell.
        return None
    relevant = [x for x in found if reaches(x, host)]
    roots = list(roots)
    mine: set[int] = set()
    for pid in roots:
        mine |= socket_inodes(pid, proc)
    strangers = [x for x in relevant if x.inode not in mine]
    if strangers:
        for pid in descendants(roots, proc) - set(roots):
            mine |= socket_inodes(pid, proc)
        strangers = [x for x in strangers if x.inode not in mine]
    return _held_by(strangers[0], proc) if strangers else None


class PortPool:
    """The engine ports of `port_range` (inclusive) on `host`: those this launcher handed out
    (or adopted with a shard), and a free one on request."""

    def __init__(self, port_range: tuple[int, int], host: str, node: str) -> None:
        self.low, self.high = port_range
        self.host = host
        self.node = node
        self.in_use: set[int] = set()
        self._cursor: int | None = None  # where the next search for a free port starts

    def allocate(self) -> int:
        """A port of the range that nothing listens on now. The search goes round the range
        from where the last one ended (first from a random place): a port just released is
        not handed out again at once, and launchers sharing one host (a test cluster, a
        simulated fleet) seldom race another process for the same port between this check
        and the engine's own bind."""
        low, high = self.low, self.high
        size = high - low + 1
        if self._cursor is None:
            self._cursor = random.randrange(size)
        for i in range(size):
            port = low + (self._cursor + i) % size
            if port in self.in_use:
                continue
            with socket.socket() as s:
                # As every engine's server binds: a port whose last connections are in
                # TIME_WAIT is free to listen on, and without SO_REUSEADDR churn (engines
                # stopped and started again) made whole ranges look taken.
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((self.host, port))
                except OSError:
                    continue
            self.in_use.add(port)
            self._cursor = (port - low + 1) % size
            return port
        raise RuntimeError(f"no free port in {low}-{high} on {self.node}")

    def hold(self, port: int) -> None:
        """Count `port` in use (an adopted shard's): it is not handed out again."""
        self.in_use.add(port)

    def release(self, port: int) -> None:
        self.in_use.discard(port)


def ephemeral_overlap(port_range: tuple[int, int], source: Path = EPHEMERAL_PORTS) -> str | None:
    """Why engine ports from `port_range` may be found taken: the kernel hands the same ports to
    outgoing connections (a health probe's, a client's) as their local ends. None if they are apart."""
    try:
        low, high = map(int, source.read_text().split())
    except (OSError, ValueError):
        return None
    first, last = port_range
    if last < low or first > high:
        return None
    return (
        f"port_range {first}-{last} overlaps the ports the kernel gives outgoing connections "
        f"({low}-{high}, net.ipv4.ip_local_port_range): an engine can find its port held by one "
        "and fail to start; set a port_range outside it"
    )
