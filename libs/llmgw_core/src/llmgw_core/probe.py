"""What a node is: OS, CPU, memory, NVIDIA driver and GPUs, InfiniBand HCAs, interfaces, weights.

Every source is injectable: `root` is where /etc, /proc and /sys are read
from, and `run` executes commands (nvidia-smi, ip), so tests feed recorded
files and outputs. Nothing here raises for missing hardware: a node without
GPUs is a CPU node.

Interfaces and their addresses come from `ip -j addr show`; where iproute2 is
missing (slim container images) from /sys, /proc/net/if_inet6 and, for IPv4 on
the real machine, the kernel's SIOCGIFADDR. The management interface is the one
that holds the management address: engines pin NCCL's and Gloo's bootstrap to it.
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
        mgmt_addr = self.mgmt_addr or socket.gethostbyname("localhost")
        interfaces = self.interfaces()
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
