"""The installer never dies of its input: damaged archives, bombs, a release API that fails,
checks that hang. Each costs one attempt, is said in the node's words, and is tried again."""

from __future__ import annotations

import gzip
import io
import logging
import os
import re
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.events import InstallProgress, NodeStatus, decoder
from llmgw_core.installed import installed
from llmgw_installer.checks import missing_libraries
from llmgw_installer.errors import CheckError
from tests.installer_support import (
    ASSET,
    LLAMA,
    TAG,
    agent,
    build_server,
    converge,
    engine,
    install_events,
    installer,
    pack,
    release_server,
    want,
)
from tests.test_archive import Zeros, broken_deflate, text_payload
from tests.test_sim_engine import free_port
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

ZIP_ASSET = f"llama-{TAG}-bin-ubuntu-x64.zip"


def alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie waiting for PID 1 to reap it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def tar_gz_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o755
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def good_and_damaged(kind: str, server: Path) -> tuple[str, bytes, bytes, str]:
    """(asset name, a good archive, the same damaged, the failure the node must report)."""
    elf = server.read_bytes()
    lib = text_payload(7, 100_000)
    if kind == "zip-bad-crc":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            info = zipfile.ZipInfo("build/bin/llama-server")
            info.external_attr = 0o100755 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, elf)
        good = buf.getvalue()
        bad = bytearray(good)
        central = bad.index(b"PK\x01\x02")
        bad[central + 16] ^= 0xFF
        return (
            ZIP_ASSET,
            good,
            bytes(bad),
            f"{ZIP_ASSET}: cannot read member 'build/bin/llama-server': Bad CRC-32 for file "
            "'build/bin/llama-server'; the archive is corrupt or truncated, refused",
        )
    tar = tar_gz_bytes({f"llama-{TAG}/llama-server": elf, f"llama-{TAG}/libggml.so": lib})
    good = gzip.compress(tar, mtime=0)
    if kind == "broken-deflate":
        return (
            ASSET,
            good,
            broken_deflate(tar, len(tar) - 50_000),
            f"{ASSET}: cannot read member 'llama-{TAG}/libggml.so': Error -3 while decompressing "
            "data: invalid block type; the archive is corrupt or truncated, refused",
        )
    assert kind == "truncated"
    return (
        ASSET,
        good,
        good[: len(good) - 2000],
        f"{ASSET}: cannot read member 'llama-{TAG}/libggml.so': Compressed file ended before the "
        "end-of-stream marker was reached; the archive is corrupt or truncated, refused",
    )


@pytest.mark.parametrize("kind", ["zip-bad-crc", "broken-deflate", "truncated"])
async def test_a_damaged_archive_costs_one_attempt_and_is_retried_with_backoff(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Regression: a corrupt archive whose published sha256 matched raised BadZipFile or
    zlib.error out of the installer; the service exited and the KV said `unpacking` forever."""
    name, good, bad, detail = good_and_damaged(kind, build_server(tmp_path / "b"))
    config = agent(tmp_path, nats_url, prefix, "", recheck_interval_s=600)
    async with release_server() as rel, install_events(bus) as events:
        config = msgspec.structs.replace(config, github_api=rel.api)
        rel.add(name, bad)  # the release publishes the damaged file's own sha256
        await want(bus, LLAMA)
        inst = installer(config, bus, install_backoff_s=0.3, install_backoff_cap_s=5.0)
        async with anyio.create_task_group() as tg:
            await tg.start(inst.run)
            failed = await eventually(lambda: [e for e in events if e.outcome == "failed"], timeout=15)
            assert failed[0].message == f"install failed: {detail}"
            stored = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
            assert stored is not None
            assert stored[0].install == f"install failed: {detail}"
            assert engine(stored[0]) == {
                "state": "failed",
                "version": TAG,
                "engine_version": "",
                "path": "",
                "detail": detail,
            }
            assert installed(config.state_dir) == {}
            # The service goes on: with no wake-up and a 10-minute recheck, the backoff
            # alone brings the next attempt, which fails the same way...
            await eventually(lambda: len([e for e in events if e.outcome == "failed"]) >= 2, timeout=15)
            await eventually(lambda: inst.failing_passes >= 2)
            passes = inst.failing_passes
            assert 0.3 <= inst.next_pass_in() <= min(5.0, 0.3 * 2**passes)
            assert inst.next_pass_in() == inst.pass_wait_s, "drawn once per pass, not at each look"
            # ...until the release is fixed, and then it installs.
            rel.add(name, good)
            await eventually(lambda: "llamacpp" in installed(config.state_dir), timeout=20)
            status = await eventually(lambda: _installed_status(bus), timeout=10)
            assert status.install == ""
            await eventually(lambda: inst.failing_passes == 0)
            assert inst.next_pass_in() == 600
            assert inst.faults == 0, "a damaged archive is the input's fault, not the installer's"
            tg.cancel_scope.cancel()
    # The failing passes were one outage: said when it started, with why, and when it ended.
    outage = [
        r.getMessage()
        for r in caplog.records
        if r.name == "llmgw.installer"
        and r.levelno >= logging.WARNING
        and "this node's engines" in r.getMessage()
    ]
    assert len(outage) == 2, outage
    assert outage[0] == (
        "node-a: installing this node's engines failed, retrying with backoff: "
        f"engine llamacpp is failed: {detail}"
    )
    assert re.fullmatch(
        r"node-a: installing this node's engines works again after \d+\.\d s and \d+ failed attempts",
        outage[1],
    ), outage
    assert not any((tmp_path / "state" / "engines" / ".staging").iterdir())


async def _installed_status(bus: Bus) -> NodeStatus | None:
    found = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
    return found[0] if found and engine(found[0])["state"] == "installed" else None


async def test_a_bomb_with_an_executable_llama_server_is_refused_before_it_is_unpacked(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a 300 MB member of zeros (300 kB packed) was unpacked in full, then installed."""
    size = 30 << 20
    archive = tmp_path / ASSET
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(build_server(tmp_path / "b"), arcname=f"llama-{TAG}/llama-server")
        ti = tarfile.TarInfo(f"llama-{TAG}/zeros.bin")
        ti.size = size
        tf.addfile(ti, Zeros(size))
    packed = archive.stat().st_size
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["detail"] == (
        f"{ASSET}: member 'llama-{TAG}/zeros.bin' claims {size} bytes, {size / packed:.0f}× the "
        f"archive's {packed} bytes, over the 100× limit; refused"
    )
    assert installed(tmp_path / "state") == {}
    assert not any((tmp_path / "state" / "engines" / ".staging").iterdir())


async def test_the_unpack_limits_come_from_agent_yaml(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    server = build_server(tmp_path / "b")
    archive = pack(tmp_path / ASSET, {"llama-server": server})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api, unpack_max_bytes=1000), bus)
    assert engine(status)["detail"] == (
        f"{ASSET}: member 'llama-server' takes the total to {server.stat().st_size} bytes, "
        "over the 1000-byte limit; refused"
    )


# --- the release API --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "detail", "lookups"),
    [
        ("500", "release API {url} answered 500 (gave up after 3 attempts)", 3),
        ("stall", "release API {url} did not answer in time (ReadTimeout) (gave up after 3 attempts)", 3),
        ("garbage", "{url} answered with a release that does not decode: ", 1),
    ],
)
async def test_release_api_failures_are_retried_like_downloads_then_reported(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, mode: str, detail: str, lookups: int
) -> None:
    async with release_server() as rel, install_events(bus) as events:
        rel.release_behaviour = mode
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
        await eventually(lambda: events and events[-1].outcome == "failed")
    url = f"{rel.api}/repos/ggml-org/llama.cpp/releases/tags/{TAG}"
    assert engine(status)["state"] == "failed"
    assert engine(status)["detail"].startswith(detail.format(url=url))
    assert events[-1].message == f"install failed: {engine(status)['detail']}"
    assert [p for p in rel.requests if p.startswith("/repos/")] == [
        f"/repos/ggml-org/llama.cpp/releases/tags/{TAG}"
    ] * lookups
    retries = [e.message for e in events if e.message.startswith("installing: retrying the release lookup")]
    assert len(retries) == lookups - 1
    if retries:
        assert retries[0].startswith("installing: retrying the release lookup after attempt 1: ")


async def test_a_release_api_that_refuses_connections_is_retried_then_reported(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    api = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with install_events(bus) as events:
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, api), bus)
        await eventually(lambda: events and events[-1].outcome == "failed")
    detail = engine(status)["detail"]
    assert detail.startswith(f"cannot reach release API {api}/repos/ggml-org/llama.cpp/releases/tags/{TAG}: ")
    assert detail.endswith(" (gave up after 3 attempts)")
    retries = [e for e in events if e.message.startswith("installing: retrying the release lookup after")]
    assert len(retries) == 2


async def test_a_release_api_answering_500_once_is_retried_and_installs(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: a 500 from the release API waited for the 10-minute recheck."""
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel, install_events(bus) as events:
        rel.add_file(archive)
        rel.release_behaviour = "500-once"
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "installed"
    url = f"{rel.api}/repos/ggml-org/llama.cpp/releases/tags/{TAG}"
    assert f"installing: retrying the release lookup after attempt 1: release API {url} answered 500" in [
        e.message for e in events
    ]


# --- checks that hang -------------------------------------------------------------------


async def test_a_version_check_that_forks_and_hangs_is_killed_with_its_process_group(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: the timeout killed `llama-server --version` but not the helper it forked,
    which lived on under PID 1."""
    pid_file = tmp_path / "helper.pid"
    archive = pack(
        tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b", "fork-hang", pid_file=pid_file)}
    )
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["detail"] == "llama-server --version did not finish within 2s"
    helper = int(pid_file.read_text())
    await eventually(lambda: not alive(helper), timeout=5)
    assert installed(tmp_path / "state") == {}


async def test_an_ldd_that_forks_and_hangs_is_killed_with_its_process_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pid_file = tmp_path / "helper.pid"
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "ldd").write_text(f'#!/bin/sh\nsleep 3600 &\necho $! > "{pid_file}"\nsleep 3600\n')
    (fake / "ldd").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    server = build_server(tmp_path / "b")
    with pytest.raises(CheckError) as err:
        await anyio.to_thread.run_sync(missing_libraries, server, 1.0)
    assert str(err.value) == "ldd llama-server did not finish within 1s"
    helper = int(pid_file.read_text())
    await eventually(lambda: not alive(helper), timeout=5)


# --- steps are reported as they start ---------------------------------------------------


async def test_checking_is_published_before_ldd_runs_and_version_after(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: `checking` and `version` were both published before ldd ran."""
    checking = threading.Event()
    steps: list[str] = []
    seen_by_ldd: list[list[str]] = []

    async def on_msg(msg: Msg) -> None:
        event = decoder(InstallProgress).decode(msg.data)
        steps.append(event.step)
        if event.step == "checking":
            checking.set()

    def waiting_ldd(binary: Path, timeout: float) -> list[str]:
        # Runs in a worker thread: the event loop delivers events meanwhile.
        assert checking.wait(10), "ldd ran before `checking` was published"
        seen_by_ldd.append(list(steps))
        return missing_libraries(binary, timeout)

    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    sub = await bus.nc.subscribe(bus.names.node_install("node-a"), cb=on_msg)
    try:
        async with release_server() as rel:
            rel.add_file(archive)
            await want(bus, LLAMA)
            status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus, ldd=waiting_ldd)
        await eventually(lambda: steps and steps[-1] == "installed")
    finally:
        await sub.unsubscribe()
    assert engine(status)["state"] == "installed"
    assert seen_by_ldd[0][-1] == "checking"
    assert "version" not in seen_by_ldd[0], "version was announced before ldd had run"
    distinct = [s for i, s in enumerate(steps) if i == 0 or steps[i - 1] != s]
    assert distinct == [
        "resolving",
        "downloading",
        "verifying",
        "unpacking",
        "checking",
        "version",
        "installed",
    ]


# --- faults of the installer itself -----------------------------------------------------


async def test_a_fault_in_the_installer_costs_one_attempt_not_the_service(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    broken = [True]

    def ldd(binary: Path, timeout: float) -> list[str]:
        if broken[0]:
            raise RuntimeError("ldd seam blew up")
        return missing_libraries(binary, timeout)

    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    config = agent(tmp_path, nats_url, prefix, "", recheck_interval_s=600)
    async with release_server() as rel, install_events(bus) as events:
        config = msgspec.structs.replace(config, github_api=rel.api)
        rel.add_file(archive)
        await want(bus, LLAMA)
        inst = installer(config, bus, ldd=ldd, install_backoff_s=0.3)
        async with anyio.create_task_group() as tg:
            await tg.start(inst.run)
            failed = await eventually(lambda: [e for e in events if e.outcome == "failed"], timeout=15)
            assert failed[0].message == "install failed: internal error: RuntimeError: ldd seam blew up"
            assert inst.faults >= 1
            broken[0] = False
            await eventually(lambda: "llamacpp" in installed(config.state_dir), timeout=15)
            tg.cancel_scope.cancel()


# --- `llmgw-installer --once` exit codes, through the real entry point ------------------

ENTRY = Path(sys.executable).parent / "llmgw-installer"


async def run_once(config_path: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    assert ENTRY.exists(), f"{ENTRY}: the console script is not installed (uv sync)"
    done = await anyio.run_process(
        [str(ENTRY), "--config", str(config_path), "--once"],
        check=False,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def write_agent(tmp_path: Path, config: object) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_bytes(msgspec.yaml.encode(config))
    return path


async def test_once_exits_0_when_installed(bus: Bus, nats_url: str, prefix: str, tmp_path: Path) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        code, out, err = await run_once(write_agent(tmp_path, agent(tmp_path, nats_url, prefix, rel.api)))
    assert code == 0, err
    assert engine(msgspec.json.decode(out, type=NodeStatus))["state"] == "installed"


async def test_once_exits_1_on_a_damaged_archive_and_the_node_says_why(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    """Regression: `--once` printed a traceback and left the KV at `installing: unpacking …`."""
    name, _, bad, detail = good_and_damaged("zip-bad-crc", build_server(tmp_path / "b"))
    async with release_server() as rel:
        rel.add(name, bad)
        await want(bus, LLAMA)
        code, out, err = await run_once(write_agent(tmp_path, agent(tmp_path, nats_url, prefix, rel.api)))
    assert code == 1, err
    assert "Traceback" not in err
    assert engine(msgspec.json.decode(out, type=NodeStatus))["detail"] == detail
    stored = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
    assert stored is not None
    assert stored[0].install == f"install failed: {detail}"


async def test_once_exits_2_on_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node: node-a\nrecheck_interval: 5\n")
    code, out, err = await run_once(path)
    assert code == 2
    assert out == ""
    assert err == f"llmgw-installer: {path}: Object contains unknown field `recheck_interval`\n"


async def test_once_exits_3_on_an_internal_error(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    # A bug, planted at start-up: the installer's build choice raises what nothing expects.
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(
        "import llmgw_installer.pipeline as p\n"
        "def choose_build(*args, **kwargs):\n"
        "    raise ZeroDivisionError('planted fault')\n"
        "p.choose_build = choose_build\n"
    )
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        code, out, err = await run_once(
            write_agent(tmp_path, agent(tmp_path, nats_url, prefix, rel.api)), env={"PYTHONPATH": str(plant)}
        )
    assert code == 3, err
    detail = "internal error: ZeroDivisionError: planted fault"
    assert engine(msgspec.json.decode(out, type=NodeStatus))["detail"] == detail
    assert err.endswith(f"llmgw-installer: install failed: {detail}\n")
    stored = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
    assert stored is not None
    assert stored[0].install == f"install failed: {detail}"
