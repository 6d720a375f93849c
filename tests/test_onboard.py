"""`llmgw node onboard` against a real sshd on loopback, and the pure rules it follows."""

from __future__ import annotations

import contextlib
import getpass
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from llmgw.cli import main
from llmgw.onboard import (
    ENGINE_USER,
    Host,
    OnboardError,
    check_host,
    engine_user_command,
    missing_wheels,
    node_id,
    parse_host,
    parse_pins,
    platform_tags,
    unit_files,
    wheel_fits,
)
from llmgw_core.bus import Bus, BusOptions
from llmgw_core.config import AgentConfig, load

ROOT = Path(__file__).resolve().parents[1]
LOCK = tomllib.loads((ROOT / "uv.lock").read_text())

X86 = Host(name="gpu-01", arch="x86_64", python="/usr/bin/python3", version=(3, 11), glibc=(2, 36))


# --- which hosts fit (pure) --------------------------------------------------------


@pytest.mark.parametrize(
    ("wheel", "host", "fits"),
    [
        (
            "msgspec-0.22.0-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
            X86,
            True,
        ),
        (
            "msgspec-0.22.0-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",
            X86,
            False,
        ),
        ("msgspec-0.22.0-cp311-cp311-manylinux2014_aarch64.manylinux_2_17_aarch64.whl", X86, False),
        ("protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl", X86, True),
        ("anyio-4.16.0-py3-none-any.whl", X86, True),
        # Built for a newer glibc than the host has.
        ("x-1.0-cp311-cp311-manylinux_2_39_x86_64.whl", X86, False),
        ("x-1.0-cp311-cp311-musllinux_1_2_x86_64.whl", X86, False),
    ],
)
def test_a_wheel_fits_a_host_by_its_tags(wheel: str, host: Host, fits: bool) -> None:
    assert wheel_fits(wheel, host) is fits


def test_platform_tags_of_a_glibc_2_17_arm_host() -> None:
    host = Host(name="arm-01", arch="aarch64", python="python3", version=(3, 12), glibc=(2, 17))
    assert platform_tags(host)[0] == "manylinux_2_17_aarch64"
    assert platform_tags(host)[-2:] == ["manylinux_2_5_aarch64", "manylinux2014_aarch64"]


UV = os.environ.get("UV") or shutil.which("uv") or str(ROOT / ".tools/bin/uv")


def node_pins() -> dict[str, str]:
    """The node's third-party pins, as `uv export` gives them (read from the lock here)."""
    out = subprocess.run(
        [
            UV,
            "export",
            "--frozen",
            "--no-dev",
            "--no-emit-workspace",
            "--no-header",
            "--package",
            "llmgw-installer",
            "--package",
            "llmgw-launcher",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_pins(out.stdout)


@pytest.mark.skipif(not os.access(UV, os.X_OK), reason="uv is not installed (./dev installs it)")
def test_x86_64_and_aarch64_hosts_have_every_wheel_and_a_riscv_host_is_refused_by_name() -> None:
    pins = node_pins()
    assert "msgspec" in pins
    check_host(X86, LOCK, pins)
    check_host(
        Host(name="arm-01", arch="aarch64", python="python3", version=(3, 12), glibc=(2, 31)), LOCK, pins
    )
    riscv = Host(name="rv-01", arch="riscv64", python="/usr/bin/python3", version=(3, 11), glibc=(2, 36))
    missing = missing_wheels(LOCK, pins, riscv)
    assert missing, "some dependency has no riscv64 wheel"
    with pytest.raises(OnboardError) as err:
        check_host(riscv, LOCK, pins)
    assert str(err.value) == (
        f"rv-01 is riscv64 (Python 3.11, glibc 2.36): no riscv64 wheel of {', '.join(missing)}; "
        "llmgw installs a node from wheels only (no compiler, no package index there), "
        "so it cannot run on riscv64"
    )


@pytest.mark.parametrize(
    ("host", "message"),
    [
        (
            Host(name="old-01", arch="x86_64", python="/usr/bin/python3", version=(3, 9), glibc=(2, 31)),
            "old-01: /usr/bin/python3 is Python 3.9; llmgw needs 3.11 or later "
            "(--python names another interpreter)",
        ),
        (
            Host(name="alp-01", arch="x86_64", python="/usr/bin/python3", version=(3, 12), glibc=None),
            "alp-01: no glibc found (x86_64); llmgw installs a node from manylinux wheels, which need "
            "glibc (musl-based systems such as Alpine are not supported)",
        ),
    ],
)
def test_hosts_refused_before_anything_is_built(host: Host, message: str) -> None:
    with pytest.raises(OnboardError) as err:
        check_host(host, LOCK, {})
    assert str(err.value) == message


def test_what_the_host_says_about_itself() -> None:
    host = parse_host(
        "10.0.0.7",
        '{"machine": "arm64", "python": [3, 12], "implementation": "cpython", '
        '"executable": "/usr/bin/python3", "libc": ["glibc", "2.39"], "uid": 0, '
        '"hostname": "gpu-07.dc1.example.com"}',
    )
    assert host == Host(
        name="10.0.0.7",
        arch="aarch64",
        python="/usr/bin/python3",
        version=(3, 12),
        glibc=(2, 39),
        uid=0,
        hostname="gpu-07.dc1.example.com",
    )
    assert node_id(host.hostname) == "gpu-07"
    assert node_id("10.0.0.7") == "10-0-0-7"


# --- against a real sshd -----------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sshd_binary() -> str:
    """Debian's sshd; installed here only if missing and this test runs as root."""
    for candidate in (shutil.which("sshd"), "/usr/sbin/sshd"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("openssh-server is not installed, and installing it needs root and apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "openssh-server"],
    ):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            pytest.skip(f"could not install openssh-server: {' '.join(argv)}: {done.stderr.strip()[-300:]}")
    return "/usr/sbin/sshd"


@contextlib.contextmanager
def sshd(tmp: Path) -> Iterator[tuple[int, Path, Path]]:
    """A real sshd on a loopback port, trusting one key this test makes: (port, key, known_hosts)."""
    import asyncssh

    binary = sshd_binary()
    if os.geteuid() == 0:
        # What Debian's ssh service makes at boot: sshd's privilege-separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    tmp.mkdir()
    host_key = asyncssh.generate_private_key("ssh-ed25519")
    host_key.write_private_key(str(tmp / "host_key"))
    (tmp / "host_key").chmod(0o600)
    client_key = asyncssh.generate_private_key("ssh-ed25519")
    client_key.write_private_key(str(tmp / "id_ed25519"))
    (tmp / "id_ed25519").chmod(0o600)
    (tmp / "authorized_keys").write_bytes(client_key.export_public_key())
    port = free_port()
    (tmp / "known_hosts").write_bytes(f"[127.0.0.1]:{port} ".encode() + host_key.export_public_key())
    (tmp / "sshd_config").write_text(
        f"Port {port}\n"
        "ListenAddress 127.0.0.1\n"
        f"HostKey {tmp}/host_key\n"
        f"PidFile {tmp}/sshd.pid\n"
        f"AuthorizedKeysFile {tmp}/authorized_keys\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "PermitRootLogin prohibit-password\n"
        "Subsystem sftp internal-sftp\n"
    )
    with (tmp / "sshd.log").open("wb") as log:
        proc = subprocess.Popen([binary, "-D", "-e", "-f", str(tmp / "sshd_config")], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, (tmp / "sshd.log").read_text()
            assert time.monotonic() < deadline, "sshd never listened"
            time.sleep(0.1)
        yield port, tmp / "id_ed25519", tmp / "known_hosts"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_agents(install_dir: Path) -> None:
    """The agents onboarding started, by the pids it recorded."""
    pids = []
    for pid_file in sorted((install_dir / "run").glob("*.pid")):
        pid = int(pid_file.read_text().strip())
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            pids.append(pid)
    deadline = time.monotonic() + 15
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_onboard_installs_over_ssh_writes_units_starts_the_agents_and_prints_the_first_probe(
    tmp_path: Path, nats_url: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The cluster's streams and buckets, made as its placement would: a node's agents only
    # check that they exist.
    async def ensure() -> None:
        async with await Bus.connect(BusOptions(url=nats_url, prefix=prefix), service="test") as bus:
            await bus.ensure()

    anyio.run(ensure)
    install_dir = tmp_path / "opt-llmgw"
    unit_dir = tmp_path / "systemd"
    with sshd(tmp_path / "ssh") as (port, key, known_hosts):
        try:
            rc = main(
                [
                    "node",
                    "onboard",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--user",
                    getpass.getuser(),
                    "--identity",
                    str(key),
                    "--known-hosts",
                    str(known_hosts),
                    "--node",
                    "onboarded-1",
                    "--install-dir",
                    str(install_dir),
                    "--unit-dir",
                    str(unit_dir),
                    "--start",
                    "direct",
                    "--python",
                    "/usr/bin/python3",
                    "--nats-url",
                    nats_url,
                    "--prefix",
                    prefix,
                    "--timeout",
                    "120",
                ]
            )
            out = capsys.readouterr().out
            assert rc == 0, out
            # The node's first probe, as the bus has it, printed for the operator.
            assert f"onboarded-1: debian 12, kernel {platform.release()}, {platform.machine()}" in out
            assert "  management 127.0.0.1 on lo" in out
            assert "  engines    sim (configured)" in out

            # Installed from the wheelhouse only, every requirement pinned by hash.
            requirements = (install_dir / "wheelhouse/requirements.txt").read_text()
            pins = [line for line in requirements.splitlines() if "==" in line]
            assert {p.split("==")[0] for p in pins} >= {
                "llmgw-core",
                "llmgw-installer",
                "llmgw-launcher",
                "msgspec",
            }
            assert all("--hash=sha256:" in p or p.endswith("\\") for p in pins)
            assert (install_dir / "venv/bin/python").exists()

            config = load(install_dir / "agent.yaml", AgentConfig)
            assert (config.node, config.nats.url, config.nats.prefix) == ("onboarded-1", nats_url, prefix)
            assert (config.state_dir, config.mgmt_addr) == (f"{install_dir}/state", "127.0.0.1")

            units = {p.name: p.read_text() for p in unit_dir.iterdir()}
            assert units == unit_files(str(install_dir))
            python, config_path = install_dir / "venv/bin/python", install_dir / "agent.yaml"
            assert (
                f"ExecStart={python} -m llmgw_launcher --config {config_path}\n"
                in units["llmgw-launcher.service"]
            )
            assert "KillMode=process\n" in units["llmgw-launcher.service"]
            assert "KillMode" not in units["llmgw-installer.service"]

            # Both agents run, from the new environment.
            for service in ("installer", "launcher"):
                pid = int((install_dir / f"run/{service}.pid").read_text())
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert cmdline[:3] == [
                    str(install_dir / "venv/bin/python").encode(),
                    b"-m",
                    f"llmgw_{service}".encode(),
                ]
        finally:
            stop_agents(install_dir)


def test_the_units_start_the_agents_from_the_install_dir() -> None:
    units = unit_files("/opt/llmgw")
    assert units["llmgw-installer.service"] == (
        "[Unit]\n"
        "Description=llmgw installer: probes this node and installs its engines\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "ExecStart=/opt/llmgw/venv/bin/python -m llmgw_installer --config /opt/llmgw/agent.yaml\n"
        "WorkingDirectory=/opt/llmgw\n"
        "Restart=always\n"
        "RestartSec=2\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )


def test_the_launcher_and_its_engines_run_as_the_engine_user_and_the_installer_as_root() -> None:
    units = unit_files("/opt/llmgw")
    assert units["llmgw-launcher.service"] == (
        "[Unit]\n"
        "Description=llmgw launcher: runs the shards placed on this node\n"
        "Wants=network-online.target\n"
        "After=network-online.target\n"
        "\n"
        "[Service]\n"
        "ExecStart=/opt/llmgw/venv/bin/python -m llmgw_launcher --config /opt/llmgw/agent.yaml\n"
        "WorkingDirectory=/opt/llmgw\n"
        "Restart=always\n"
        "RestartSec=2\n"
        "User=llmgw\n"
        "Group=llmgw\n"
        "KillMode=process\n"
        "\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n"
    )
    # The installer installs OS packages (apt-get, dnf): root, and it starts no engine.
    assert "User=" not in units["llmgw-installer.service"]


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="needs systemd-analyze (systemd)")
def test_systemd_reads_the_units_without_a_complaint(tmp_path: Path) -> None:
    install_dir = tmp_path / "opt-llmgw"
    (install_dir / "venv/bin").mkdir(parents=True)
    (install_dir / "venv/bin/python").symlink_to(sys.executable)
    for name, text in unit_files(str(install_dir)).items():
        (tmp_path / name).write_text(text)
    done = subprocess.run(
        ["systemd-analyze", "verify", *(str(tmp_path / n) for n in unit_files(str(install_dir)))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (0, "")


NEEDS_ROOT_AND_NAMESPACES = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("useradd"),
    reason="runs useradd in a private mount namespace: needs root, unshare and useradd",
)


@NEEDS_ROOT_AND_NAMESPACES
def test_onboarding_makes_the_engine_user_with_gpu_groups_and_its_state() -> None:
    # The command onboarding runs on the host, run for real against a copy of this
    # machine's /etc mounted over /etc in a mount namespace of its own: the host's
    # users are not touched. Twice, as a second onboarding of the same host does.
    # Outside pytest's 0700 base directory, so that the engine user can reach its state.
    with tempfile.TemporaryDirectory(prefix="llmgw-onboard-") as tmp:
        Path(tmp).chmod(0o711)
        make_engine_user(Path(tmp))


def make_engine_user(tmp_path: Path) -> None:
    install_dir = tmp_path / "opt-llmgw"
    for sub in ("state/engines", "logs", "run", "nats"):
        (install_dir / sub).mkdir(parents=True)
    (install_dir / "nats/node.creds").write_text("creds")
    (install_dir / "nats/node.creds").chmod(0o600)
    subprocess.run(["cp", "-a", "/etc", str(tmp_path / "etc")], check=True)
    setup = engine_user_command(str(install_dir))
    state = install_dir / "state"
    script = (
        f"mount --bind {tmp_path / 'etc'} /etc && ({setup}) && ({setup}) && "
        f"getent passwd {ENGINE_USER} && id -nG {ENGINE_USER} && "
        f"stat -c '%U:%G %n' {state} {install_dir / 'logs'} {install_dir / 'run'} "
        f"{install_dir / 'nats/node.creds'} && "
        # What the launcher's unit does with User=/Group=: a process as the user, in its groups.
        f"setpriv --reuid {ENGINE_USER} --regid {ENGINE_USER} --init-groups "
        f"sh -c 'id -u; touch {state}/shards-probe && cat {install_dir}/nats/node.creds && echo'; "
        f"setpriv --reuid {ENGINE_USER} --regid {ENGINE_USER} --init-groups touch /etc/llmgw-probe 2>&1; true"
    )
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    passwd = lines[0].split(":")
    assert passwd[0] == ENGINE_USER
    assert int(passwd[2]) != 0
    assert passwd[5] == str(state)
    assert passwd[6].endswith(("nologin", "false"))
    groups = set(lines[1].split())
    has_video = subprocess.run(["getent", "group", "video"], capture_output=True).returncode == 0
    assert groups == {ENGINE_USER, *(["video"] if has_video else [])}
    assert lines[2:6] == [
        f"{ENGINE_USER}:{ENGINE_USER} {p}"
        for p in (state, install_dir / "logs", install_dir / "run", install_dir / "nats/node.creds")
    ]
    assert lines[6] == passwd[2]  # not root
    assert lines[7] == "creds"
    assert (state / "shards-probe").exists()
    assert "Permission denied" in lines[8]
    # The host's own users were not touched.
    assert subprocess.run(["getent", "passwd", ENGINE_USER], capture_output=True).returncode != 0
