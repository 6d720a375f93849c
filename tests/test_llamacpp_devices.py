"""llama.cpp's own device order against the one the llamacpp adapter's `-ts` counts in.

Real `ggml-rpc-server`s on loopback, started from the adapter's worker commands, and the
real `llama-server` given the adapter's `--rpc`: what llama.cpp prints is what `-ts`
must name, one entry per device, or the devices left out get no layers.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from llmgw_core.engines import Command, LlamaCpp, LlamaCppConfig, Member, Profile, ShardSpec
from llmgw_core.engines.llamacpp import device_order
from tests.test_launcher_llamacpp import llama_bin, tiny_model
from tests.test_sim_engine import free_port
from tests.waiting import eventually

pytestmark = [pytest.mark.anyio, pytest.mark.llama]

__all__ = ["llama_bin", "tiny_model"]

# `--list-devices`: "  RPC0: 127.0.0.1:50112 (24105 MiB, 24105 MiB free)"
LISTED = re.compile(r"^\s+(\w+): (\S+) \(\d+ MiB, \d+ MiB free\)$", re.M)
# Model load: "llama_prepare_model_devices: using device RPC0 (127.0.0.1:50112) (unknown id) - …"
USING = re.compile(r"using device (\w+) \(([^)]*)\)")
# "load_tensors: RPC0[127.0.0.1:50112] model buffer size =     0.31 MiB"
MODEL_BUFFER = re.compile(r"load_tensors: RPC\d+\[([^\]]+)\] model buffer size =\s+([\d.]+) MiB")


def shard_of(profile: Profile, members: tuple[Member, ...], rank: int, port: int = 0) -> ShardSpec:
    return ShardSpec(
        replica="l",
        shard=f"l-{rank}",
        node=members[rank].node,
        profile=profile,
        rank=rank,
        host="127.0.0.1",
        port=port,
        members=members,
        fabric="loopback",
    )


def cpu_profile(model: Path, workers: int) -> Profile:
    return msgspec.convert(
        {
            "name": "tiny-llama",
            "engine": "llamacpp",
            "model_path": str(model),
            "pp": workers + 1,
            "nodes": workers + 1,
            "gpus_per_node": 1,
            "args": ["-c", "512", "-t", "1", "-lv", "4"],
        },
        Profile,
    )


def healthy(proc: subprocess.Popen[bytes], port: int) -> bool:
    assert proc.poll() is None, f"llama-server exited with code {proc.returncode}"
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    return False


def accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


@contextlib.contextmanager
def started(cmd: Command, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """One adapter command as the launcher runs it (argv and environment as built), in its own group."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd.argv, env=cmd.env_dict(), stdout=out, stderr=out, start_new_session=True)
    try:
        yield proc
    finally:
        # SIGTERM first: llama-server then writes out what its log still holds.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@contextlib.contextmanager
def rpc_servers(
    adapter: LlamaCpp, profile: Profile, members: tuple[Member, ...], logs: Path
) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for rank in range(1, len(members)):
            [cmd] = adapter.commands(shard_of(profile, members, rank), dict(os.environ))
            # The worker's RPC server listens on its own address, as placement gave it.
            assert cmd.args == ("--host", "127.0.0.1", "--port", str(members[rank].port))
            stack.enter_context(started(cmd, logs / f"rpc-{rank}.log"))
        yield


def loopback_members() -> tuple[Member, ...]:
    # Workers listed with the higher port first: the order is --rpc's, not the ports'.
    low, high = sorted((free_port(), free_port()))
    return (
        Member(node="node-a", addr="127.0.0.1", port=0),
        Member(node="node-b", addr="127.0.0.1", port=high),
        Member(node="node-c", addr="127.0.0.1", port=low),
    )


async def test_llama_server_lists_rpc_devices_in_the_order_the_adapter_counts(
    tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    adapter = LlamaCpp(LlamaCppConfig(bin_dir=llama_bin, rpc_server="ggml-rpc-server"))
    members = loopback_members()
    profile = cpu_profile(tiny_model, workers=2)
    leader = shard_of(profile, members, 0, port=free_port())
    [cmd] = adapter.commands(leader, dict(os.environ))
    rpc = cmd.args[cmd.args.index("--rpc") + 1]
    with rpc_servers(adapter, profile, members, tmp_path):
        for m in members[1:]:
            await eventually(lambda m=m: accepts(m.port), timeout=30)
        # llama.cpp acts on --list-devices as it parses it: --rpc must come before.
        listed = subprocess.run(
            [cmd.path, "--rpc", rpc, "--list-devices"],
            env=cmd.env_dict(),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert listed.returncode == 0, listed.stdout + listed.stderr
    devices = LISTED.findall(listed.stdout + listed.stderr)
    assert devices == [
        ("RPC0", f"127.0.0.1:{members[1].port}"),
        ("RPC1", f"127.0.0.1:{members[2].port}"),
    ], listed.stdout + listed.stderr
    assert tuple(endpoint for _, endpoint in devices) == device_order(leader)
    assert cmd.args[cmd.args.index("-ts") + 1] == "1,1"
    assert cmd.args[cmd.args.index("-sm") + 1] == "layer"


async def test_every_device_the_adapter_names_gets_layers_and_an_omitted_one_none(
    tmp_path: Path, llama_bin: str, tiny_model: Path
) -> None:
    adapter = LlamaCpp(LlamaCppConfig(bin_dir=llama_bin, rpc_server="ggml-rpc-server"))
    members = loopback_members()
    profile = cpu_profile(tiny_model, workers=2)
    [cmd] = adapter.commands(shard_of(profile, members, 0, port=free_port()), dict(os.environ))
    ts = cmd.args.index("-ts") + 1
    # What the adapter builds, and the same with `-ts` naming only the first device
    # (llama.cpp zero-fills the rest): the second gets no layers at all.
    short = msgspec.structs.replace(cmd, args=(*cmd.args[:ts], "1", *cmd.args[ts + 1 :]))
    loaded: dict[str, str] = {}
    with rpc_servers(adapter, profile, members, tmp_path):
        for m in members[1:]:
            await eventually(lambda m=m: accepts(m.port), timeout=30)
        for name, leader in (("adapter", cmd), ("short", short)):
            port = int(leader.args[leader.args.index("--port") + 1])
            log = tmp_path / f"leader-{name}.log"
            with started(leader, log) as proc:
                # Healthy once the model is loaded (it answers 503 while loading).
                await eventually(lambda proc=proc, port=port: healthy(proc, port), timeout=90)
            loaded[name] = log.read_text()
    workers = [f"127.0.0.1:{m.port}" for m in members[1:]]
    text = loaded["adapter"]
    assert USING.findall(text) == [("RPC0", workers[0]), ("RPC1", workers[1])], text
    assert tuple(endpoint for _, endpoint in USING.findall(text)) == device_order(
        shard_of(profile, members, 0)
    )
    buffers = {endpoint: float(mib) for endpoint, mib in MODEL_BUFFER.findall(text)}
    assert set(buffers) == set(workers), text
    assert all(mib > 0 for mib in buffers.values()), text
    omitted = {endpoint for endpoint, _ in MODEL_BUFFER.findall(loaded["short"])}
    assert omitted == {workers[0]}, loaded["short"]
