"""`llmgw node onboard HOST`: install llmgw on a machine over SSH, start its agents, show its first probe.

The node needs only SSH and Python 3.11 or later with `venv`; it never reaches
a package index and nothing is compiled on it:

1. Look at the host (architecture, Python, glibc) and refuse it, naming its
   architecture, when a dependency has no wheel for it.
2. Build a wheelhouse here: llmgw's own wheels (`uv build`), their dependencies
   exactly as `uv.lock` pins them (`uv export`), downloaded for the host's
   platform (`pip download`) and checked against the lock's hashes.
3. Copy it over SFTP and `pip install --no-index --require-hashes` it into a
   fresh virtual environment on the host.
4. Write `agent.yaml` and the systemd units of the installer and the launcher,
   and start them (through systemd, or directly where there is none).
5. Wait for the node's first probe on the bus and print it.

Errors (what failed, on which host, what to do)::

    LlmgwError
    └── OnboardError
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import asyncssh
import msgspec

from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig
from llmgw_core.errors import BusError, LlmgwError
from llmgw_core.events import NodeStatus
from llmgw_core.subjects import DEFAULT_PREFIX

# What a node runs: the installer and the launcher (and the library they share).
NODE_PACKAGES = ("llmgw-core", "llmgw-installer", "llmgw-launcher")
MIN_PYTHON = (3, 11)
ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}
# Legacy manylinux names and the glibc each stands for (PEP 600).
LEGACY_MANYLINUX = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}
UNITS = ("llmgw-installer", "llmgw-launcher")
# The unprivileged user the launcher, and so every engine it starts, runs as.
ENGINE_USER = "llmgw"
# Groups that own GPU device nodes on some distributions (/dev/dri, /dev/kfd; NVIDIA's
# /dev/nvidia* are world-accessible): the engine user joins those the host has.
GPU_GROUPS = ("video", "render")

# Run with the host's own interpreter: what the wheels must fit.
HOST_SCRIPT = (
    "import json, os, platform, socket, sys; "
    "print(json.dumps({'machine': platform.machine(), 'python': list(sys.version_info[:2]), "
    "'implementation': sys.implementation.name, 'executable': sys.executable, "
    "'libc': list(platform.libc_ver()), 'uid': os.getuid(), 'hostname': socket.gethostname()}))"
)


class OnboardError(LlmgwError):
    """Onboarding a host failed; the message says where and what to do."""


@dataclass(frozen=True)
class Host:
    """The machine being onboarded, as its own Python reports it."""

    name: str
    arch: str
    python: str
    version: tuple[int, int]
    glibc: tuple[int, int] | None
    uid: int = 0
    hostname: str = ""
    implementation: str = "cpython"

    @property
    def describe(self) -> str:
        libc = f"glibc {self.glibc[0]}.{self.glibc[1]}" if self.glibc else "no glibc"
        return f"{self.arch}, Python {self.version[0]}.{self.version[1]} ({self.python}), {libc}"


def parse_host(name: str, text: str) -> Host:
    try:
        raw = json.loads(text)
        machine = str(raw["machine"])
        major, minor = (int(v) for v in raw["python"])
        libc_name, libc_version = (str(v) for v in raw["libc"])
    except (ValueError, KeyError, TypeError) as exc:
        raise OnboardError(
            f"{name}: could not read what the host is from its Python: {text.strip()!r}"
        ) from exc
    glibc = None
    match = re.fullmatch(r"(\d+)\.(\d+).*", libc_version)
    if libc_name == "glibc" and match:
        glibc = (int(match.group(1)), int(match.group(2)))
    return Host(
        name=name,
        arch=ARCH_ALIASES.get(machine.lower(), machine.lower()),
        python=str(raw.get("executable", "")),
        version=(major, minor),
        glibc=glibc,
        uid=int(raw.get("uid", -1)),
        hostname=str(raw.get("hostname", "")),
        implementation=str(raw.get("implementation", "cpython")),
    )


# --- which wheels fit a host (pure) ----------------------------------------------


def platform_tags(host: Host) -> list[str]:
    """The Linux platform tags the host's pip accepts, newest glibc first."""
    if host.glibc is None:
        return []
    major, minor = host.glibc
    tags = [f"manylinux_{major}_{m}_{host.arch}" for m in range(minor, 4, -1)]
    for legacy, (lmajor, lminor) in LEGACY_MANYLINUX.items():
        if (major, minor) >= (lmajor, lminor) and (
            legacy == "manylinux2014" or host.arch in ("x86_64", "i686")
        ):
            tags.append(f"{legacy}_{host.arch}")
    return tags


def wheel_fits(filename: str, host: Host) -> bool:
    """Whether pip on `host` would install the wheel `filename` (PEP 425 tags in the name)."""
    parts = filename.removesuffix(".whl").split("-")
    if len(parts) < 5:
        return False
    pys, abis, plats = (set(p.split(".")) for p in parts[-3:])
    platforms = set(platform_tags(host))
    if not ("any" in plats or plats & platforms):
        return False
    major, minor = host.version
    cp = f"cp{major}{minor}"
    for py in pys:
        for abi in abis:
            if abi == "none" and py in ("py3", f"py{major}{minor}", cp):
                return True
            if abi == cp and py == cp:
                return True
            if abi == "abi3" and py.startswith("cp3") and py[3:].isdigit() and int(py[3:]) <= minor:
                return True
    return False


def parse_pins(requirements: str) -> dict[str, str]:
    """`name==version` of every requirement in `uv export` output."""
    pins: dict[str, str] = {}
    for line in requirements.splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line)
        if match:
            pins[_normalise(match.group(1))] = match.group(2)
    return pins


def sdist_only(lock: Mapping[str, Any], pins: Mapping[str, str]) -> list[str]:
    """Pinned packages published as a source archive alone (nkeys): their wheel is built here,
    from the archive the lock's hash names, and must come out pure Python."""
    out = []
    for package in lock.get("package", []):
        name = _normalise(str(package.get("name", "")))
        if (
            pins.get(name) == str(package.get("version", ""))
            and package.get("sdist")
            and not package.get("wheels")
        ):
            out.append(name)
    return sorted(out)


def missing_wheels(lock: Mapping[str, Any], pins: Mapping[str, str], host: Host) -> list[str]:
    """`name version` of every pinned package with no wheel in `uv.lock` that fits `host`
    (packages built here from their source archive are not missing)."""
    wheels: dict[tuple[str, str], list[str]] = {}
    for package in lock.get("package", []):
        key = (_normalise(str(package.get("name", ""))), str(package.get("version", "")))
        wheels[key] = [str(w.get("url", "")).rsplit("/", 1)[-1] for w in package.get("wheels", [])]
    built_here = set(sdist_only(lock, pins))
    return [
        f"{name} {version}"
        for name, version in sorted(pins.items())
        if name not in built_here
        if not any(wheel_fits(w, host) for w in wheels.get((name, version), []))
    ]


def split_requirements(requirements: str, names: set[str]) -> tuple[str, str]:
    """`uv export` output split in two: the entries not in `names`, and those in it. An entry
    is its `name==version` line and the indented `--hash` lines that continue it."""
    kept: list[str] = []
    taken: list[str] = []
    into = kept
    for line in requirements.splitlines(keepends=True):
        if line[:1] not in (" ", "\t", "#", "\n", ""):
            match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
            into = taken if match and _normalise(match.group(1)) in names else kept
        into.append(line)
    return "".join(kept), "".join(taken)


def check_host(host: Host, lock: Mapping[str, Any], pins: Mapping[str, str]) -> None:
    """Refuse a host llmgw cannot be installed on, saying why; before anything is built or copied."""
    if host.implementation != "cpython":
        raise OnboardError(
            f"{host.name}: {host.python} is {host.implementation}; llmgw needs CPython "
            f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later (--python names another interpreter)"
        )
    if host.version < MIN_PYTHON:
        raise OnboardError(
            f"{host.name}: {host.python} is Python {host.version[0]}.{host.version[1]}; llmgw needs "
            f"{MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later (--python names another interpreter)"
        )
    if host.glibc is None:
        raise OnboardError(
            f"{host.name}: no glibc found ({host.arch}); llmgw installs a node from manylinux wheels, "
            "which need glibc (musl-based systems such as Alpine are not supported)"
        )
    missing = missing_wheels(lock, pins, host)
    if missing:
        raise OnboardError(
            f"{host.name} is {host.arch} (Python {host.version[0]}.{host.version[1]}, "
            f"glibc {host.glibc[0]}.{host.glibc[1]}): no {host.arch} wheel of {', '.join(missing)}; "
            "llmgw installs a node from wheels only (no compiler, no package index there), "
            f"so it cannot run on {host.arch}"
        )


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# --- what goes on the node (pure) ----------------------------------------------------


@dataclass(frozen=True)
class Options:
    host: str
    user: str | None = None
    port: int = 22
    identity: str | None = None
    known_hosts: str | None = None
    node: str = ""
    install_dir: str = "/opt/llmgw"
    unit_dir: str = "/etc/systemd/system"
    start: Literal["systemd", "direct"] = "systemd"
    python: str = "python3"
    nats_url: str = ""
    prefix: str = DEFAULT_PREFIX
    node_creds: str | None = None
    mgmt_addr: str = ""
    model_paths: tuple[str, ...] = ()
    timeout_s: float = 300.0
    project_root: Path | None = None
    uv: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)

    def bus_options(self) -> BusOptions:
        return BusOptions(url=self.nats_url, prefix=self.prefix)


def node_id(name: str) -> str:
    """A node id from a host name: its first label, with anything but [A-Za-z0-9_-] made a dash."""
    first = name.split(".", 1)[0] if not re.fullmatch(r"[\d.]+|.*:.*", name) else name
    return re.sub(r"[^A-Za-z0-9_-]+", "-", first).strip("-") or "node"


def agent_config(options: Options, node: str, mgmt_addr: str) -> AgentConfig:
    d = options.install_dir
    nats = {"url": options.bus_options().resolved_url(), "prefix": options.prefix}
    if options.node_creds:
        nats["creds_file"] = f"{d}/nats/node.creds"
    try:
        return msgspec.convert(
            {
                "node": node,
                "state_dir": f"{d}/state",
                "nats": nats,
                "mgmt_addr": mgmt_addr,
                "model_paths": list(options.model_paths),
            },
            AgentConfig,
        )
    except msgspec.ValidationError as exc:
        raise OnboardError(
            f"{options.host}: agent.yaml would be invalid: {exc} (--node sets the node id)"
        ) from exc


def unit_files(install_dir: str) -> dict[str, str]:
    """The systemd units of the node's two agents, by file name.

    The launcher runs as ENGINE_USER, and so do the engines it starts: an engine
    serves requests from the network and loads weights from anywhere, and must
    not hold root. The installer stays root: it installs the OS packages a build
    needs (apt-get, dnf) and runs no engine, only `ldd` and `--version`.
    """
    python = f"{install_dir}/venv/bin/python"
    config = f"{install_dir}/agent.yaml"
    units: dict[str, str] = {}
    for service, what, extra in (
        ("installer", "probes this node and installs its engines", ""),
        (
            "launcher",
            "runs the shards placed on this node",
            f"User={ENGINE_USER}\n"
            f"Group={ENGINE_USER}\n"
            # Stopping or restarting the launcher must leave its engines running:
            # the next launcher adopts them. systemd's default (control-group)
            # would kill every engine with it.
            "KillMode=process\n",
        ),
    ):
        units[f"llmgw-{service}.service"] = (
            "[Unit]\n"
            f"Description=llmgw {service}: {what}\n"
            "Wants=network-online.target\n"
            "After=network-online.target\n"
            "\n"
            "[Service]\n"
            f"ExecStart={python} -m llmgw_{service} --config {config}\n"
            f"WorkingDirectory={install_dir}\n"
            "Restart=always\n"
            "RestartSec=2\n"
            f"{extra}"
            "\n"
            "[Install]\n"
            "WantedBy=multi-user.target\n"
        )
    return units


def engine_user_command(install_dir: str) -> str:
    """Make ENGINE_USER (once), put it in the host's GPU groups, and give it the state it writes.

    The launcher writes its shard records, engine logs and working directories under
    `state/`, and reads the node's NATS credentials; the installer (root) writes the
    engines it installs there too, readable by everyone.
    """
    d, u = install_dir, ENGINE_USER
    groups = " ".join(GPU_GROUPS)
    return (
        f"if ! getent passwd {u} >/dev/null; then "
        f"useradd --system --user-group --home-dir {_q(d + '/state')} --no-create-home "
        f'--shell "$(command -v nologin || echo /bin/false)" {u}; fi && '
        f'for g in {groups}; do if getent group "$g" >/dev/null; then usermod -a -G "$g" {u}; fi; done && '
        f"chown -R {u}:{u} {_q(d + '/state')} {_q(d + '/logs')} {_q(d + '/run')} && "
        f"if [ -e {_q(d + '/nats/node.creds')} ]; then chown {u}:{u} {_q(d + '/nats/node.creds')}; fi"
    )


def describe(status: NodeStatus) -> str:
    """The node's first probe, as the operator reads it."""
    f = status.facts
    gpus = (
        f"{len(f.gpus)}x {f.gpus[0].name} (driver {f.nvidia_driver}, CUDA {f.cuda_driver})"
        if f.gpus
        else "none"
    )
    lines = [
        f"{f.node}: {f.os_id} {f.os_version}, kernel {f.kernel}, {f.arch}".rstrip(", "),
        f"  cpu        {f.cpu_model or '?'} ({f.cores} cores; {' '.join(f.cpu_flags) or 'no AVX, no NEON'})",
        f"  memory     {f.memory_mb / 1024:.1f} GiB",
        f"  gpus       {gpus}",
        f"  hcas       {', '.join(f.hcas) or 'none'}",
        f"  management {f.mgmt_addr} on {f.mgmt_iface or 'no interface found'}",
        "  engines    "
        + (
            ", ".join(f"{e.name} ({e.state}{': ' + e.detail if e.detail else ''})" for e in status.engines)
            or "none"
        ),
    ]
    if status.install:
        lines.append(f"  install    {status.install}")
    lines += [f"  warning    {w}" for w in status.warnings]
    return "\n".join(lines)


# --- building the wheelhouse (here) ---------------------------------------------------


def project_root(start: Path | None = None) -> Path:
    """The llmgw checkout this command runs from: node wheels are built from its source and lock."""
    here = (start or Path(__file__)).resolve()
    for candidate in (here, *here.parents):
        if (candidate / "uv.lock").is_file() and (candidate / "libs" / "llmgw_core").is_dir():
            return candidate
    raise OnboardError(
        "llmgw node onboard builds the node's wheels from llmgw's source tree and uv.lock, "
        f"and found neither above {here}; run it from a checkout of llmgw"
    )


def find_uv(root: Path) -> str:
    """uv: the one running this command (`uv run` sets UV), on PATH, or the one ./dev installed."""
    found = os.environ.get("UV") or shutil.which("uv") or str(root / ".tools" / "bin" / "uv")
    if not os.access(found, os.X_OK):
        raise OnboardError("uv not found on PATH nor in .tools/bin; run ./dev once (it installs uv there)")
    return found


async def _local(argv: list[str], what: str, cwd: Path, env: Mapping[str, str]) -> str:
    try:
        done = await anyio.run_process(argv, cwd=cwd, env={**os.environ, **env}, check=False)
    except OSError as exc:
        raise OnboardError(f"{what}: cannot run {argv[0]}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join(done.stderr.decode(errors="replace").strip().splitlines()[-15:])
        raise OnboardError(f"{what} failed (exit {done.returncode}): {' '.join(argv)}\n{tail}")
    return done.stdout.decode()


async def export_requirements(root: Path, uv: str, env: Mapping[str, str]) -> str:
    """The node's third-party dependencies exactly as uv.lock pins them, every hash included."""
    argv = [uv, "export", "--frozen", "--format", "requirements.txt", "--no-dev", "--no-emit-workspace"]
    argv += ["--no-header", "--no-annotate"]
    for package in NODE_PACKAGES[1:]:
        argv += ["--package", package]
    return await _local(argv, "exporting the node's dependencies from uv.lock", root, env)


async def build_wheelhouse(
    root: Path, uv: str, host: Host, requirements: str, dest: Path, env: Mapping[str, str]
) -> list[Path]:
    """llmgw's wheels and every dependency's wheel for `host`, and a requirements.txt pinning each by hash."""
    import importlib.util

    # pip downloads the host's wheels (uv has no `download`); it is the `onboard` extra, not a
    # dependency of every install: one would replace the pip of the environment llmgw goes into.
    if importlib.util.find_spec("pip") is None:
        raise OnboardError(
            f"pip is not installed in {sys.prefix}, and onboarding downloads the node's wheels with it: "
            "install llmgw's `onboard` extra (`pip install 'llmgw[onboard]'`, `uv sync --extra onboard`)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    for package in NODE_PACKAGES:
        await _local(
            [uv, "build", "--package", package, "--wheel", "--out-dir", str(dest), "--quiet"],
            f"building {package}",
            root,
            env,
        )
    lock = tomllib.loads((root / "uv.lock").read_text())
    built_here = set(sdist_only(lock, parse_pins(requirements)))
    requirements, sources = split_requirements(requirements, built_here)
    if sources:
        # Built from the source archive whose hash the lock names; a wheel that is not pure
        # Python would not fit another machine, so it is refused rather than copied.
        (dest.parent / "sources.txt").write_text(sources)
        built = dest.parent / "built"
        await _local(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--disable-pip-version-check",
                "--no-deps",
                "--require-hashes",
                "--wheel-dir",
                str(built),
                "-r",
                str(dest.parent / "sources.txt"),
            ],
            f"building {', '.join(sorted(built_here))} from source",
            root,
            env,
        )
        for wheel in sorted(built.glob("*.whl")):
            if not wheel.name.endswith("-none-any.whl"):
                raise OnboardError(
                    f"{wheel.name}: built from source, but not pure Python; it cannot be copied"
                )
            wheel.rename(dest / wheel.name)
    deps = dest.parent / "dependencies.txt"
    deps.write_text(requirements)
    argv = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
    argv += ["--only-binary=:all:", "--require-hashes", "--dest", str(dest)]
    argv += ["--python-version", f"{host.version[0]}.{host.version[1]}", "--implementation", "cp"]
    for abi in (f"cp{host.version[0]}{host.version[1]}", "abi3", "none"):
        argv += ["--abi", abi]
    for tag in platform_tags(host):
        argv += ["--platform", tag]
    argv += ["-r", str(deps)]
    await _local(argv, f"downloading the dependencies' wheels for {host.arch}", root, env)
    own = []
    made_here = [w for w in dest.glob("*.whl") if _normalise(w.name.split("-")[0]) in built_here]
    for wheel in sorted([*dest.glob("llmgw_*.whl"), *made_here]):
        name, version = wheel.name.split("-")[:2]
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        own.append(f"{_normalise(name)}=={version} --hash=sha256:{digest}\n")
    (dest / "requirements.txt").write_text(requirements.rstrip("\n") + "\n" + "".join(own))
    return sorted(dest.iterdir())


# --- the host (over SSH) ------------------------------------------------------------------


async def connect(options: Options) -> asyncssh.SSHClientConnection:
    kwargs: dict[str, Any] = {"port": options.port}
    if options.user:
        kwargs["username"] = options.user
    if options.identity:
        kwargs["client_keys"] = [options.identity]
    if options.known_hosts:
        kwargs["known_hosts"] = options.known_hosts
    where = f"{options.user + '@' if options.user else ''}{options.host}:{options.port}"
    try:
        return await asyncssh.connect(options.host, **kwargs)
    except asyncssh.HostKeyNotVerifiable as exc:
        raise OnboardError(
            f"{where}: host key not trusted ({exc.reason}); add it to ~/.ssh/known_hosts "
            "(ssh to it once) or name a file with --known-hosts"
        ) from exc
    except asyncssh.PermissionDenied as exc:
        raise OnboardError(f"{where}: SSH login refused ({exc.reason}); check --user and --identity") from exc
    except (OSError, asyncssh.Error) as exc:
        raise OnboardError(f"{where}: cannot connect over SSH: {exc}") from exc


async def remote(conn: asyncssh.SSHClientConnection, host: str, command: str, what: str) -> str:
    try:
        done = await conn.run(command, check=False)
    except (OSError, asyncssh.Error) as exc:
        raise OnboardError(f"{host}: {what}: SSH failed: {exc}") from exc
    if done.exit_status != 0:
        err = str(done.stderr or "") + str(done.stdout or "")
        tail = "\n".join(err.strip().splitlines()[-15:])
        hint = ""
        if "ensurepip" in err or "No module named venv" in err:
            hint = "; install Python's venv module there (Debian, Ubuntu: apt-get install python3-venv)"
        elif "Permission denied" in err:
            hint = "; onboard as a user who may write there (--user root), or set --install-dir, --unit-dir"
        raise OnboardError(f"{host}: {what} failed (exit {done.exit_status}){hint}\n{tail}")
    return str(done.stdout or "")


def _q(value: str) -> str:
    return shlex.quote(value)


def stop_command(options: Options) -> str:
    """Stop agents an earlier onboarding started; their engines keep running for the next launcher."""
    d = options.install_dir
    if options.start == "systemd":
        units = " ".join(f"{u}.service" for u in UNITS)
        return f"systemctl stop {units} 2>/dev/null || true"
    return (
        " ; ".join(
            f"if [ -f {_q(f'{d}/run/{s}.pid')} ]; then pid=$(cat {_q(f'{d}/run/{s}.pid')}); "
            f'if grep -q llmgw_ /proc/"$pid"/cmdline 2>/dev/null; then kill -TERM "$pid"; fi; fi'
            for s in ("installer", "launcher")
        )
        + " ; true"
    )


def start_command(options: Options) -> str:
    d = options.install_dir
    if options.start == "systemd":
        units = " ".join(f"{u}.service" for u in UNITS)
        return f"systemctl daemon-reload && systemctl enable --now {units}"
    # No systemd: each agent in a session of its own (setsid), so that it outlives
    # this SSH session, with its pid recorded for the next onboarding to stop it.
    return " && ".join(
        f"(nohup setsid {_q(f'{d}/venv/bin/python')} -m llmgw_{s} --config {_q(f'{d}/agent.yaml')} "
        f">>{_q(f'{d}/logs/{s}.log')} 2>&1 </dev/null & echo $! >{_q(f'{d}/run/{s}.pid')})"
        for s in ("installer", "launcher")
    )


def logs_command(options: Options) -> str:
    if options.start == "systemd":
        return "journalctl -u llmgw-installer.service -n 20 --no-pager 2>&1 || true"
    return f"tail -n 20 {_q(options.install_dir + '/logs/installer.log')} 2>&1 || true"


async def wait_for_probe(options: Options, node: str, after: int, deadline: float) -> NodeStatus:
    """The node's status once newer than revision `after`: the first probe of the agents just started."""
    try:
        async with await Bus.connect(options.bus_options(), service="llmgw-onboard") as bus:
            while time.monotonic() < deadline:
                found = await bus.get(bus.names.nodes_bucket, node, NodeStatus)
                if found is not None and found[1] > after:
                    return found[0]
                await anyio.sleep(0.5)
    except BusError as exc:
        raise OnboardError(f"cannot watch for {node}'s first probe: {exc}") from exc
    raise TimeoutError


async def revision_of(options: Options, node: str) -> int:
    try:
        async with await Bus.connect(options.bus_options(), service="llmgw-onboard") as bus:
            found = await bus.get(bus.names.nodes_bucket, node, NodeStatus)
    except BusError as exc:
        raise OnboardError(
            f"cannot reach the bus at {options.bus_options().resolved_url()}: {exc} "
            "(--nats-url is the address the node will use too)"
        ) from exc
    return found[1] if found else 0


async def onboard(options: Options, say: Callable[[str], None] = print) -> NodeStatus:
    root = options.project_root or project_root()
    uv = options.uv or find_uv(root)
    env = {"UV_PYTHON_DOWNLOADS": "never", "UV_PYTHON_PREFERENCE": "only-system", **options.extra_env}
    d = options.install_dir
    deadline_s = options.timeout_s
    async with await connect(options) as conn:
        raw = await remote(
            conn, options.host, f"{_q(options.python)} -c {_q(HOST_SCRIPT)}", "looking at the host"
        )
        host = parse_host(options.host, raw)
        node = options.node or node_id(host.hostname or options.host)
        peer = conn.get_extra_info("peername")
        mgmt_addr = options.mgmt_addr or (str(peer[0]) if peer else options.host)
        say(f"{options.host}: {host.describe}; node {node}, management address {mgmt_addr}")
        requirements = await export_requirements(root, uv, env)
        lock = tomllib.loads((root / "uv.lock").read_text())
        check_host(host, lock, parse_pins(requirements))
        config = agent_config(options, node, mgmt_addr)
        if options.start == "systemd" and host.uid != 0:
            raise OnboardError(
                f"{options.host}: systemd units need root and the login is uid {host.uid}; "
                "onboard as root (--user root), or use --start direct"
            )
        previous = await revision_of(options, node)
        subdirs = ("wheelhouse", "state", "logs", "run", "nats")
        dirs = " ".join([*(_q(f"{d}/{sub}") for sub in subdirs), _q(options.unit_dir)])
        with tempfile.TemporaryDirectory(prefix="llmgw-wheelhouse-") as tmp:
            files = await build_wheelhouse(root, uv, host, requirements, Path(tmp) / "wheelhouse", env)
            size = sum(f.stat().st_size for f in files)
            say(f"{options.host}: copying {len(files) - 1} wheels ({size / 1e6:.1f} MB) to {d}/wheelhouse")
            await remote(
                conn,
                options.host,
                f"mkdir -p {_q(d)} && rm -rf {_q(d + '/wheelhouse')} && mkdir -p {dirs}",
                f"creating {d}",
            )
            await _put(conn, options.host, [str(f) for f in files], f"{d}/wheelhouse")
        await remote(conn, options.host, stop_command(options), "stopping the agents already there")
        say(f"{options.host}: installing into {d}/venv (pip --no-index --require-hashes)")
        await remote(
            conn,
            options.host,
            f"{_q(options.python)} -m venv --clear {_q(d + '/venv')} && "
            f"{_q(d + '/venv/bin/python')} -m pip install --quiet --disable-pip-version-check --no-index "
            f"--only-binary=:all: --require-hashes --find-links {_q(d + '/wheelhouse')} "
            f"-r {_q(d + '/wheelhouse/requirements.txt')}",
            "installing llmgw",
        )
        files_out = {f"{d}/agent.yaml": msgspec.yaml.encode(config)}
        files_out.update(
            {f"{options.unit_dir}/{name}": text.encode() for name, text in unit_files(d).items()}
        )
        await _write(conn, options.host, files_out)
        if options.node_creds:
            await _put(conn, options.host, [options.node_creds], f"{d}/nats/node.creds", mode=0o600)
        say(f"{options.host}: wrote {d}/agent.yaml and {', '.join(unit_files(d))} in {options.unit_dir}")
        if options.start == "systemd":
            await remote(conn, options.host, engine_user_command(d), f"making the engine user {ENGINE_USER}")
            say(f"{options.host}: the launcher and its engines run as {ENGINE_USER}, not root")
        await remote(conn, options.host, start_command(options), "starting the agents")
        url = options.bus_options().resolved_url()
        say(f"{options.host}: agents started; waiting for {node}'s first probe on {url}")
        try:
            status = await wait_for_probe(options, node, previous, time.monotonic() + deadline_s)
        except TimeoutError:
            logs = await remote(conn, options.host, logs_command(options), "reading the installer's log")
            raise OnboardError(
                f"{options.host}: no probe from {node} on the bus within {deadline_s:g}s; "
                f"the installer's last log lines:\n{logs.strip()}"
            ) from None
    say(describe(status))
    return status


async def _put(
    conn: asyncssh.SSHClientConnection, host: str, local: list[str], remote_path: str, mode: int | None = None
) -> None:
    try:
        async with conn.start_sftp_client() as sftp:
            await sftp.put(local, remote_path)
            if mode is not None:
                await sftp.chmod(remote_path, mode)
    except (OSError, asyncssh.Error) as exc:
        raise OnboardError(f"{host}: copying to {remote_path} failed: {exc}") from exc


async def _write(conn: asyncssh.SSHClientConnection, host: str, files: Mapping[str, bytes]) -> None:
    try:
        async with conn.start_sftp_client() as sftp:
            for path, data in files.items():
                async with sftp.open(path, "wb") as f:
                    await f.write(data)
    except (OSError, asyncssh.Error) as exc:
        raise OnboardError(f"{host}: writing {', '.join(files)} failed: {exc}") from exc


# --- the command ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    options = Options(
        host=args.host,
        user=args.user,
        port=args.port,
        identity=args.identity,
        known_hosts=args.known_hosts,
        node=args.node,
        install_dir=args.install_dir.rstrip("/") or "/",
        unit_dir=args.unit_dir,
        start=args.start,
        python=args.python,
        nats_url=args.nats_url,
        prefix=args.prefix,
        node_creds=args.node_creds,
        mgmt_addr=args.mgmt_addr,
        model_paths=tuple(args.model_path),
        timeout_s=args.timeout,
    )

    async def main() -> None:
        await onboard(options, say=lambda line: print(line, flush=True))

    anyio.run(main)
    return 0
