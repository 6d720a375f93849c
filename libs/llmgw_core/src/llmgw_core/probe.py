"""What a node is: OS, CPU, memory, NVIDIA driver and GPUs, InfiniBand HCAs, interfaces, weights.

Every source is injectable: `root` is where /etc, /proc and /sys are read
from, and `run` executes commands (nvidia-smi, ip), so tests feed recorded
files and outputs. Nothing here raises for missing hardware: a node without
GPUs is a CPU node.

Interfaces and their addresses come from `ip -j addr show`; where iproute2 is
missing (slim container images) from /sys, /proc/net/if_inet6 and, for IPv4 on
the real machine, the kernel's SIOCGIFADDR. The management interface is the one
that holds the management address: engines pin NCCL's and Gloo's bootstrap to it.
The management address is agent.yaml's `mgmt_addr`, or where unset the address of
`mgmt_iface`, else of the default route's interface (`pick_mgmt_addr`).
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import logging
import os
import platform
import socket
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .config import AgentConfig
from .events import GPUInfo, ModelShape, NetInterface, NodeFacts
from .fit import FitError, read_shape
from .staged import held, shapes

CommandRunner = Callable[[list[str]], "CommandResult"]

CPU_FLAGS_OF_INTEREST = (
    "avx", "avx2", "avx512f", "fma", "f16c", "amx_bf16", "amx_int8", "amx_tile",
    "neon", "asimd", "sve", "asimddp", "dotprod",
)  # fmt: skip

NVIDIA_SMI_GPUS = [
    "nvidia-smi",
    "--query-gpu=index,name,uuid,compute_cap,memory.total",
    "--format=csv,noheader,nounits",
]
NVIDIA_SMI_DRIVER = ["nvidia-smi"]
IP_ADDR = ["ip", "-j", "addr", "show"]

# From <linux/sockios.h>: the primary IPv4 address and netmask of an interface.
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str = ""


def run_command(argv: list[str], timeout: float = 15.0) -> CommandResult:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: not found")
    except subprocess.TimeoutExpired:
        return CommandResult(124, "", f"{argv[0]}: timed out after {timeout}s")
    return CommandResult(done.returncode, done.stdout, done.stderr)


def parse_nvidia_smi_gpus(text: str) -> list[GPUInfo]:
    """Rows of `index, name, uuid, compute_cap, memory.total` (csv, noheader, nounits)."""
    gpus: list[GPUInfo] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5 or not parts[0].isdigit():
            continue
        # A GPU name never has a comma today, but be safe: the name is everything
        # between the index and the last three fields.
        index, *name_parts, uuid, cap, mem = parts
        try:
            memory = int(float(mem))
        except ValueError:
            memory = 0
        gpus.append(
            GPUInfo(
                index=int(index),
                name=", ".join(name_parts),
                uuid=uuid,
                compute_capability=cap,
                memory_mb=memory,
            )
        )
    return gpus


def parse_nvidia_smi_header(text: str) -> tuple[str, str]:
    """Driver and CUDA versions from plain `nvidia-smi`'s banner."""
    driver = cuda = ""
    for line in text.splitlines():
        if "Driver Version:" in line:
            driver = line.split("Driver Version:", 1)[1].split()[0]
        if "CUDA Version:" in line:
            cuda = line.split("CUDA Version:", 1)[1].split()[0]
    return driver, cuda


def parse_os_release(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip().strip('"')
    return out


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...], int]:
    model = ""
    flags: set[str] = set()
    cores = 0
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "processor":
            cores += 1
    if "asimddp" in flags:
        flags.add("dotprod")
    if "asimd" in flags:
        flags.add("neon")
    return model, tuple(sorted(f for f in flags if f in CPU_FLAGS_OF_INTEREST)), cores


def parse_meminfo(text: str) -> int:
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 0


class _IpAddr(msgspec.Struct):
    family: str = ""
    local: str = ""
    prefixlen: int = 0


class _IpLink(msgspec.Struct):
    ifname: str
    address: str = ""
    operstate: str = ""
    addr_info: list[_IpAddr] = []


def parse_ip_addr(text: str) -> tuple[NetInterface, ...] | None:
    """`ip -j addr show`, as interfaces with their addresses (`10.0.0.1/24`); None if it is not that."""
    try:
        links = msgspec.json.decode(text, type=list[_IpLink])
    except msgspec.DecodeError:
        return None
    return tuple(
        NetInterface(
            name=link.ifname,
            addresses=tuple(
                f"{a.local}/{a.prefixlen}"
                for a in link.addr_info
                if a.family in ("inet", "inet6") and a.local
            ),
            mac=link.address,
            up=link.operstate.lower() in ("up", "unknown"),
        )
        for link in sorted(links, key=lambda link: link.ifname)
    )


def parse_if_inet6(text: str) -> dict[str, list[str]]:
    """/proc/net/if_inet6 (address, index, prefix length, scope, flags, name; hex) by interface."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 6 or len(parts[0]) != 32:
            continue
        try:
            addr = ipaddress.IPv6Address(int(parts[0], 16))
            prefix = int(parts[2], 16)
        except ValueError:
            continue
        out.setdefault(parts[5], []).append(f"{addr}/{prefix}")
    return out


def ipv4_of(name: str) -> str | None:
    """The primary IPv4 address of interface `name` on this machine, as `addr/prefix`."""
    request = struct.pack("256s", name.encode()[:15])
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            addr = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)[20:24]
            mask = fcntl.ioctl(sock.fileno(), SIOCGIFNETMASK, request)[20:24]
    except OSError:
        # EADDRNOTAVAIL: the interface has no IPv4 address.
        return None
    prefix = bin(int.from_bytes(mask, "big")).count("1")
    return f"{socket.inet_ntoa(addr)}/{prefix}"


def addresses_of(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """`host` as IP addresses: itself if it is one, else what it resolves to (nothing if it does not)."""
    try:
        return {ipaddress.ip_address(host)}
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return set()
    found: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for info in infos:
        try:
            found.add(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]))
        except ValueError:
            continue
    return found


def interface_holding(interfaces: tuple[NetInterface, ...], host: str) -> str:
    """The name of the interface that holds `host`'s address; "" when none does."""
    wanted = addresses_of(host) if host else set()
    for iface in interfaces:
        for text in iface.addresses:
            try:
                if ipaddress.ip_interface(text).ip in wanted:
                    return iface.name
            except ValueError:
                continue
    return ""


# /proc/net/route: a header, then a route a line (Iface Destination Gateway Flags RefCnt Use
# Metric Mask …, addresses in hex). A node's table is a few lines; past this much the rest is
# not read (a full routing table carries no default route a node would use anyway).
ROUTE_TABLE_MAX_BYTES = 1 << 20
RTF_UP = 0x1
IFNAME_MAX = 15  # the kernel's IFNAMSIZ less its NUL
LOOPBACK = "127.0.0.1"


def default_route_interface(text: str) -> str:
    """The interface of the IPv4 default route with the lowest metric in /proc/net/route's
    text ("" when it has none). Any line that is not a route is skipped."""
    best: tuple[int, str] | None = None
    for line in text[:ROUTE_TABLE_MAX_BYTES].splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000":
            continue
        name, flags, metric = fields[0], fields[3], fields[6]
        if not 0 < len(name) <= IFNAME_MAX or len(flags) > 8 or len(metric) > 10:
            continue
        try:
            up, cost = int(flags, 16) & RTF_UP, int(metric)
        except ValueError:
            continue
        if up and (best is None or cost < best[0]):
            best = (cost, name)
    return best[1] if best else ""


def ipv4_on(interfaces: tuple[NetInterface, ...], name: str) -> str:
    """The first IPv4 address (without its prefix) that interface `name` holds, one that is not
    link-local (169.254/16, reachable on that link alone) where it has one; "" if none."""
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    for iface in interfaces:
        if iface.name != name:
            continue
        for text in iface.addresses:
            try:
                found.append(ipaddress.ip_interface(text).ip)
            except ValueError:
                continue
    v4 = [a for a in found if a.version == 4]
    return str(next((a for a in v4 if not a.is_link_local), v4[0])) if v4 else ""


def pick_mgmt_addr(interfaces: tuple[NetInterface, ...], mgmt_iface: str, route_iface: str) -> str:
    """The address a node serves on and advertises where agent.yaml names none: that of its
    `mgmt_iface`; else that of the interface its default route leaves by (where other hosts
    reach it); else that of its first interface up that is neither loopback nor link-local;
    loopback only on a host with none of these (one machine alone). It used to be loopback
    always: on a fleet, every engine URL a node advertised pointed other hosts at themselves."""
    for name in (mgmt_iface, route_iface):
        if name and (addr := ipv4_on(interfaces, name)):
            return addr
    for iface in interfaces:
        addr = ipv4_on((iface,), iface.name) if iface.up else ""
        if addr and not (ipaddress.ip_address(addr).is_loopback or ipaddress.ip_address(addr).is_link_local):
            return addr
    return LOOPBACK


def advertised_address(mgmt_addr: str, mgmt_iface: str = "") -> str:
    """What a node's agents serve on and tell others: agent.yaml's `mgmt_addr`, or where it is
    unset the address `pick_mgmt_addr` finds on this host."""
    if mgmt_addr:
        return mgmt_addr
    probe = Probe("", mgmt_iface=mgmt_iface)
    return probe.management_address(probe.interfaces())


def with_mgmt_addr(config: AgentConfig) -> AgentConfig:
    """`config` with its `mgmt_addr` found (`advertised_address`) where agent.yaml left it out."""
    if config.mgmt_addr:
        return config
    return msgspec.structs.replace(config, mgmt_addr=advertised_address("", config.mgmt_iface))


def weights_fingerprint(path: Path) -> str:
    """Cheap: names, sizes and mtimes of the files under `path`, hashed. No file is read."""
    h = hashlib.sha256()
    if not path.exists():
        return ""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        st = f.stat()
        h.update(
            f"{f.relative_to(path) if f != path else f.name}\0{st.st_size}\0{int(st.st_mtime)}\n".encode()
        )
    return h.hexdigest()[:16]


# The shape of each configured model path, by its fingerprint: a path's headers are read once,
# and again only when its files change (the probe runs every recheck).
_path_shapes: dict[tuple[str, str], ModelShape | None] = {}


def path_shape(path: str, fingerprint: str) -> ModelShape | None:
    """The shape of the model at a configured `model_paths` entry, None where it has none
    (not there, not a model, a header that cannot be read: then placement does not fit it)."""
    key = (path, fingerprint)
    if key not in _path_shapes:
        try:
            _path_shapes[key] = read_shape(path) if fingerprint else None
        except FitError:
            _path_shapes[key] = None
        except Exception:  # a reader's surprise on odd bytes costs the fit check, never the probe
            logging.getLogger("llmgw.probe").exception("cannot read the shape of %s", path)
            _path_shapes[key] = None
    return _path_shapes[key]


@dataclass
class Probe:
    node: str
    root: Path = Path("/")
    run: CommandRunner = field(default=run_command)
    model_paths: tuple[str, ...] = ()
    # Where the node stages the weights profiles name (`<state_dir>/models`); reported with model_paths.
    models_dir: Path | None = None
    mgmt_addr: str = ""
    # The operator's choice (agent.yaml `mgmt_iface`); found from mgmt_addr when empty.
    mgmt_iface: str = ""

    def _read(self, rel: str) -> str:
        try:
            return (self.root / rel.lstrip("/")).read_text()
        except OSError:
            return ""

    def memory_mb(self) -> int:
        """The host's memory (MemTotal), in MB; 0 where /proc/meminfo cannot be read."""
        return parse_meminfo(self._read("proc/meminfo"))

    def gpus(self) -> tuple[tuple[GPUInfo, ...], str, str]:
        listing = self.run(NVIDIA_SMI_GPUS)
        if listing.returncode != 0:
            return (), "", ""
        driver, cuda = parse_nvidia_smi_header(self.run(NVIDIA_SMI_DRIVER).stdout)
        return tuple(parse_nvidia_smi_gpus(listing.stdout)), driver, cuda

    def hcas(self) -> tuple[str, ...]:
        ib = self.root / "sys/class/infiniband"
        try:
            return tuple(sorted(p.name for p in ib.iterdir()))
        except OSError:
            return ()

    def interfaces(self) -> tuple[NetInterface, ...]:
        listed = self.run(IP_ADDR)
        if listed.returncode == 0:
            parsed = parse_ip_addr(listed.stdout)
            if parsed is not None:
                return parsed
        return self._sysfs_interfaces()

    def _sysfs_interfaces(self) -> tuple[NetInterface, ...]:
        """Without iproute2: names, MACs and states from /sys, IPv6 from /proc, IPv4 from the kernel."""
        net = self.root / "sys/class/net"
        try:
            names = sorted(p.name for p in net.iterdir())
        except OSError:
            return ()
        ipv6 = parse_if_inet6(self._read("proc/net/if_inet6"))
        real = self.root == Path("/")
        out = []
        for name in names:
            mac = self._read(f"sys/class/net/{name}/address").strip()
            state = self._read(f"sys/class/net/{name}/operstate").strip()
            v4 = ipv4_of(name) if real else None
            addresses = ((v4,) if v4 else ()) + tuple(ipv6.get(name, ()))
            out.append(NetInterface(name=name, addresses=addresses, mac=mac, up=state in ("up", "unknown")))
        return tuple(out)

    def management_address(self, interfaces: tuple[NetInterface, ...]) -> str:
        """`mgmt_addr`, or where it is unset the one `pick_mgmt_addr` finds among `interfaces`."""
        if self.mgmt_addr:
            return self.mgmt_addr
        route = default_route_interface(self._read("proc/net/route"))
        return pick_mgmt_addr(interfaces, self.mgmt_iface, route)

    def facts(self) -> NodeFacts:
        osr = parse_os_release(self._read("etc/os-release"))
        model, flags, cores = parse_cpuinfo(self._read("proc/cpuinfo"))
        gpus, driver, cuda = self.gpus()
        kernel = self._read("proc/sys/kernel/osrelease").strip() or platform.release()
        weights = {p: weights_fingerprint(Path(p)) for p in self.model_paths}
        model_shapes = {p: s for p, fp in weights.items() if (s := path_shape(p, fp)) is not None}
        if self.models_dir is not None:
            weights.update(held(self.models_dir))
            model_shapes.update(shapes(self.models_dir))
        interfaces = self.interfaces()
        mgmt_addr = self.management_address(interfaces)
        return NodeFacts(
            node=self.node,
            os_id=osr.get("ID", ""),
            os_version=osr.get("VERSION_ID", ""),
            kernel=kernel,
            arch=platform.machine() if self.root == Path("/") else "x86_64",
            cpu_model=model,
            cpu_flags=flags,
            cores=cores or (os.cpu_count() or 0),
            memory_mb=self.memory_mb(),
            nvidia_driver=driver,
            cuda_driver=cuda,
            gpus=gpus,
            hcas=self.hcas(),
            interfaces=interfaces,
            mgmt_addr=mgmt_addr,
            weights=weights,
            mgmt_iface=self.mgmt_iface or interface_holding(interfaces, mgmt_addr),
            shapes=model_shapes,
        )
