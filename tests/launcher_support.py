"""Helpers for launcher tests: an in-process launcher and a record of shard events."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import msgspec
from nats.aio.msg import Msg

from llmgw_core.bus import Bus, prepare_node
from llmgw_core.config import AgentConfig, NatsConfig
from llmgw_core.engines import GPUInfo, Member, Profile, ShardSpec
from llmgw_core.events import ShardStatus, decoder
from llmgw_launcher import Launcher
from tests.auth_support import session_for

H100 = [GPUInfo(index=i, name="NVIDIA H100 80GB HBM3", compute_capability="9.0") for i in range(2)]


def agent_config(
    nats_url: str, prefix: str, state_dir: Path, node: str = "node-a", **kw: object
) -> AgentConfig:
    """On the session's server the launcher connects as its node's own identity."""
    nats = NatsConfig(url=nats_url, prefix=prefix)
    session = session_for(nats_url)
    if session is not None:
        if prefix not in session.dirs:
            session.identities(prefix, state_dir.parent / f"auth-{prefix}")
        seed = session.add_node(prefix, node).node_seed(node)
        nats = NatsConfig(url=session.url, prefix=prefix, nkey_seed_file=str(seed))
    fields: dict[str, object] = {
        "node": node,
        "state_dir": str(state_dir),
        "nats": msgspec.to_builtins(nats),
        "stop_grace_s": 3.0,
        "wait_timeout_s": 20.0,
        "restart_backoff_s": 0.3,
        "restart_backoff_cap_s": 2.0,
        "health_interval_s": 0.3,
        "heartbeat_interval_s": 0.5,
        # Every node of these tests is this machine: loopback, as their node statuses say
        # (unset, a node takes its default route's address).
        "mgmt_addr": "127.0.0.1",
    }
    fields.update(kw)
    return msgspec.convert(fields, AgentConfig)


def sim_profile(*args: str, **kw: object) -> Profile:
    fields: dict[str, object] = {
        "name": "tiny",
        "engine": "sim",
        "model_path": "sim://tiny",
        "args": list(args),
        "health_timeout_s": 20.0,
    }
    fields.update(kw)
    return msgspec.convert(fields, Profile)


def shard(node: str, name: str, profile: Profile, **kw: object) -> ShardSpec:
    return msgspec.convert(
        {
            "replica": "r0",
            "shard": name,
            "node": node,
            "profile": msgspec.to_builtins(profile),
            "profile_fp": profile.fingerprint(),
            "pool": "default",
            **kw,
        },
        ShardSpec,
    )


def two_rank_members(port: int) -> list[dict[str, object]]:
    return [
        msgspec.to_builtins(Member(node="node-a", addr="127.0.0.1", port=port)),
        msgspec.to_builtins(Member(node="node-b", addr="127.0.0.1", port=port + 1)),
    ]


@dataclass
class ShardEvents:
    """Every ShardStatus event on the prefix, in arrival order."""

    items: list[ShardStatus] = field(default_factory=list)

    def of(self, shard_name: str) -> list[ShardStatus]:
        return [s for s in self.items if s.shard == shard_name]

    def states(self, shard_name: str) -> list[str]:
        return [s.state for s in self.of(shard_name)]

    def last(self, shard_name: str) -> ShardStatus | None:
        found = self.of(shard_name)
        return found[-1] if found else None


@contextlib.asynccontextmanager
async def shard_events(bus: Bus) -> AsyncIterator[ShardEvents]:
    events = ShardEvents()

    async def on_msg(msg: Msg) -> None:
        events.items.append(decoder(ShardStatus).decode(msg.data))

    sub = await bus.nc.subscribe(f"{bus.names.prefix}.events.shard.>", cb=on_msg)
    try:
        yield events
    finally:
        await sub.unsubscribe()


@contextlib.asynccontextmanager
async def running_launcher(config: AgentConfig, gpus: list[GPUInfo] | None = None) -> AsyncIterator[Launcher]:
    """A launcher in this process; at exit its engines are stopped too (tests leave nothing behind)."""
    bus = await Bus.connect(config.nats, service=f"launcher-{config.node}")
    await prepare_node(bus)
    launcher = Launcher(config, bus, gpus=H100 if gpus is None else gpus)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(launcher.run)
            try:
                yield launcher
            finally:
                tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await launcher.stop_all()
            await bus.close()


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def processes_with(marker: str, under: Path | None = None) -> list[int]:
    """Pids of live processes whose command line contains `marker`.

    With `under`, only processes whose working directory is inside it: the
    engines of this test (a launcher runs each in `<state_dir>/run/<shard>`),
    not those of a test running beside it on a shared machine.
    """
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if under is not None and not (entry / "cwd").resolve().is_relative_to(under.resolve()):
                continue
        except OSError:
            continue
        if marker in cmdline and pid_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def start_launcher_process(config_path: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """`llmgw-launcher --config` as its own process, stderr appended to `log_path`."""
    with log_path.open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "llmgw_launcher", "--config", str(config_path)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
