"""A vLLM-over-Ray replica split over two hosts (tests/multihost), through the real llmgw path:
placement puts a two-node profile on nodes n1 and n2, each on a host of its own; the leader's
launcher starts the Ray head on its host's address, the other's launcher a real Ray worker
that joins it from its own host.

vLLM itself does not run here: a tiny random Llama takes ~60 s to load on one node of this
two-core machine, and two nodes' worth of vLLM over Ray do not fit its memory and time. The
`vllm` the launchers are given records the command line and environment it was started with
and serves as the sim engine in its place. Ray is real: `ray status` on the head's host counts
two live nodes, the GCS lists the worker at the other host's address, and every process's
command line and environment carry its own host's address and interface.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from llmgw_core.events import ReplicaRecord, ShardStatus
from tests.multihost.fleet import Fleet
from tests.multihost.hosts import Hosts, argv_of, environ_of
from tests.test_ray_real import alive_nodes, ray_bin_dir
from tests.waiting import eventually

pytestmark = [
    pytest.mark.multihost,
    pytest.mark.real_ray,
    pytest.mark.anyio,
    pytest.mark.timeout(600),
    # Two real Ray nodes beside three NATS servers, placement and two agents: 216 s on two
    # cores shared with other test runs (load average ~10); a Ray head alone took 23 s on them.
    pytest.mark.slow,
]

# Stands in for `vllm serve`: what it was started with goes to served.json beside it, then
# the sim engine serves in its place on the same address, port and model name.
FAKE_VLLM = """#!{python}
import json, os, sys
args = sys.argv[1:]
record = os.path.join(os.path.dirname(os.path.abspath(__file__)), "served.json")
with open(record, "w") as f:
    json.dump({{"argv": args, "env": dict(os.environ)}}, f)
opt = lambda name: args[args.index(name) + 1]
os.execv(sys.executable, [sys.executable, "-m", "llmgw_core.sim", "--host", opt("--host"),
         "--port", opt("--port"), "--model", opt("--served-model-name")])
"""

# A Ray node's agents (Python processes) are given two minutes to register with its raylet: on
# two busy cores a raylet aborted waiting for its dashboard agent's ports, and the launcher
# started the node again (each attempt a minute or more).
RAY_ENV = {"RAY_agent_register_timeout_ms": "120000"}

# The GCS's own list of nodes, read on the head's host: each node's address and whether it lives.
GCS_NODES = (
    "import sys; from ray._raylet import GcsClient; "
    "nodes = GcsClient(address=sys.argv[1]).get_all_node_info(timeout=20).values(); "
    "print(sorted(n.node_manager_address for n in nodes if n.state == 0))"
)


@pytest.fixture
def short_root() -> Iterator[Path]:
    """A state root short enough for Ray's socket paths (107 bytes), removed after the hosts
    (requested first, so torn down last: nothing of Ray runs in it any more)."""
    root = Path(tempfile.mkdtemp(prefix="llmgw-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def engine_dir(root: Path) -> Path:
    """The environment the launchers' vllm points at: the real `ray`, the recording `vllm`, and
    a `python` whose `vllm` package is a stub saying its version (the installer's check imports
    it; the real one takes a minute and a gigabyte to import here)."""
    bin_dir, stub = root / "env" / "bin", root / "env" / "stub" / "vllm"
    bin_dir.mkdir(parents=True)
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('__version__ = "0.10.2"\n')
    (bin_dir / "ray").symlink_to(Path(ray_bin_dir()) / "ray")
    scripts = {
        "vllm": FAKE_VLLM.format(python=sys.executable),
        "python": f'#!/bin/sh\nPYTHONPATH="{stub.parent}" exec "{sys.executable}" "$@"\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


async def test_a_vllm_replica_over_ray_has_its_head_on_one_host_and_its_worker_join_from_another(
    short_root: Path, make_hosts: Callable[..., Hosts], make_fleet: Callable[..., Fleet]
) -> None:
    bin_dir = engine_dir(short_root)
    net = make_hosts("a", "b", "c")
    fleet = make_fleet(net)
    fleet.start_nats(("a", "b", "c"))
    profile = {
        "name": "tiny-ray",
        "engine": "vllm",
        # A hub id (relative): no file the nodes must hold.
        "model_path": "llmgw-test/tiny-random-llama",
        "gpu_class": "H100-80G",
        "tp": 2,
        "nodes": 2,
        "gpus_per_node": 1,
        "health_timeout_s": 120.0,
    }
    fleet.start_placement(
        "c",
        "p1",
        [profile],
        [{"name": "chat", "profile": "tiny-ray", "replicas": 1}],
        extra={"fabrics": {"lan": {"nodes": ["n*"]}}},
    )
    engines = {"vllm": {"path": str(bin_dir), "multinode": "ray"}}
    where = {"n1": net["a"], "n2": net["b"]}
    for node, host in where.items():
        # Ray's sessions go under <state_dir>/ray/<port>: short, or Ray's sockets do not fit.
        extra = {"engines": engines, "state_dir": str(short_root / node)}
        fleet.start_node(host.name, node, extra=extra, env=RAY_ENV)

    async with fleet.bus() as bus:

        async def ready() -> tuple[ReplicaRecord, dict[str, ShardStatus]]:
            found = await bus.entries(bus.names.replicas_bucket, ReplicaRecord)
            records = [c.value for c in found.values() if c.value is not None]
            assert [r.state for r in records] == ["ready"], [(r.state, r.reason) for r in records]
            shards = await bus.entries(bus.names.shard_status_bucket, ShardStatus)
            statuses = {c.value.node: c.value for c in shards.values() if c.value is not None}
            assert [s.state for s in statuses.values()] == ["ready", "ready"], statuses
            return records[0], statuses

        record, _ = await eventually(ready, timeout=150, interval=0.5)
        leader, worker = record.members
        head_host, worker_host = where[leader.node], where[worker.node]
        assert head_host is not worker_host
        assert {(m.node, m.addr) for m in record.members} == {(n, h.addr) for n, h in where.items()}
        head_addr = f"{head_host.addr}:{leader.port}"
        assert record.url.startswith(f"http://{head_host.addr}:"), record

        # The Ray join, for real: the head's own cluster holds two live nodes, one at each
        # host's address (the worker's is its own host's, never the head's or loopback).
        ray = str(Path(ray_bin_dir()) / "ray")

        def joined() -> list[str]:
            nodes = head_host.run([sys.executable, "-c", GCS_NODES, head_addr], timeout=60)
            assert nodes.returncode == 0, nodes.stderr[-3000:]
            addrs = list(json.loads(nodes.stdout.strip().replace("'", '"')))
            assert len(addrs) == 2, addrs
            return addrs

        def counted() -> str:
            status = head_host.run([ray, "status", f"--address={head_addr}"], timeout=120)
            said = status.stdout + status.stderr
            assert "Active:" in said, said
            assert alive_nodes(said) == 2, said
            return said

        addrs = await eventually(lambda: anyio.to_thread.run_sync(joined), timeout=300, interval=1.0)
        assert addrs == sorted([head_host.addr, worker_host.addr]), addrs
        # What an operator runs on the head's host: the autoscaler's report, two live nodes.
        await eventually(lambda: anyio.to_thread.run_sync(counted), timeout=120, interval=1.0)
        # The processes that joined (a Ray node that gave up on a slow head was started again).
        _, statuses = await eventually(ready, timeout=60, interval=0.5)

    # The commands the launchers started, and each one's environment: its own host's address
    # and interface for Ray, vLLM and NCCL/Gloo's bootstrap; the worker meets the head at the
    # head's host address.
    head_pid, _ = statuses[leader.node].pids
    [join_pid] = statuses[worker.node].pids
    head, join = argv_of(head_pid), argv_of(join_pid)
    assert "--head" in head, head
    assert f"--port={leader.port}" in head, head
    assert f"--node-ip-address={head_host.addr}" in head, head
    assert f"--temp-dir={short_root / leader.node / 'ray' / str(leader.port)}" in head, head
    assert f"--address={head_addr}" in join, join
    assert f"--node-ip-address={worker_host.addr}" in join, join
    assert f"--temp-dir={short_root / worker.node / 'ray' / str(leader.port)}" in join, join
    served: dict[str, Any] = json.loads((bin_dir / "served.json").read_text())
    argv, env = served["argv"], served["env"]
    assert (argv[0], argv[1]) == ("serve", profile["model_path"]), argv
    assert _after(argv, "--distributed-executor-backend") == "ray", argv
    assert _after(argv, "--tensor-parallel-size") == "2", argv
    assert _after(argv, "--host") == head_host.addr, argv
    assert env["RAY_ADDRESS"] == head_addr, env
    started = ((environ_of(head_pid), head_host), (env, head_host), (environ_of(join_pid), worker_host))
    for pid_env, host in started:
        assert (pid_env["NCCL_SOCKET_IFNAME"], pid_env["GLOO_SOCKET_IFNAME"]) == (host.iface, host.iface)
        assert pid_env["VLLM_HOST_IP"] == host.addr
