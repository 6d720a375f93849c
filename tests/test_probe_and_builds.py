"""The node probe over recorded files, and build selection from a release's asset list."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llmgw_core.engines import GPUInfo
from llmgw_core.events import NetInterface, NodeFacts
from llmgw_core.probe import CommandResult, Probe, parse_nvidia_smi_gpus, run_command
from llmgw_installer.builds import Asset, NoBuildError, choose_build
from llmgw_installer.checks import parse_version

FIXTURES = Path(__file__).parent / "fixtures"

TAG = "b10991"
ASSETS = [
    Asset(name=n, sha256="0" * 64)
    for n in (
        f"llama-{TAG}-bin-ubuntu-x64.tar.gz",
        f"llama-{TAG}-bin-ubuntu-arm64.tar.gz",
        f"llama-{TAG}-bin-ubuntu-x64.zip",
        f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz",
        f"llama-{TAG}-bin-ubuntu-cuda-13.0-x64.tar.gz",
        "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz",
        "cudart-llama-bin-ubuntu-cuda-13.0-x64.tar.gz",
        f"llama-{TAG}-bin-win-cuda-12.4-x64.zip",
        f"llama-{TAG}-bin-macos-arm64.zip",
    )
]


def write_root(
    root: Path, *, flags: str = "fpu avx avx2 fma f16c avx512f", hcas: tuple[str, ...] = ()
) -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "etc/os-release").write_text('ID=ubuntu\nVERSION_ID="22.04"\nPRETTY_NAME="Ubuntu 22.04.4 LTS"\n')
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text("5.15.0-105-generic\n")
    cpu = "".join(
        f"processor\t: {i}\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: {flags}\n\n"
        for i in range(4)
    )
    (root / "proc/cpuinfo").write_text(cpu)
    (root / "proc/meminfo").write_text("MemTotal:       2113612348 kB\nMemFree:        100 kB\n")
    for hca in hcas:
        (root / "sys/class/infiniband" / hca).mkdir(parents=True)
    for iface, state in (("eth0", "up"), ("ib0", "up"), ("lo", "unknown")):
        d = root / "sys/class/net" / iface
        d.mkdir(parents=True)
        (d / "address").write_text("02:00:00:00:00:01\n")
        (d / "operstate").write_text(state + "\n")
    return root


def smi(gpus_csv: str | None, ip_json: str | None = None) -> object:
    """A command runner that answers like nvidia-smi (and `ip`, when given its output)."""

    def run(argv: list[str]) -> CommandResult:
        if argv[0] == "ip":
            if ip_json is None:
                return CommandResult(127, "", "ip: not found")
            return CommandResult(0, ip_json)
        if gpus_csv is None:
            return CommandResult(127, "", "nvidia-smi: not found")
        if argv[1:2] == ["--query-gpu=index,name,uuid,compute_cap,memory.total"]:
            return CommandResult(0, gpus_csv)
        return CommandResult(0, (FIXTURES / "nvidia-smi-banner.txt").read_text())

    return run


def test_an_eight_gpu_node_probes_fully_and_picks_the_newest_cuda_build_its_driver_runs(
    tmp_path: Path,
) -> None:
    root = write_root(tmp_path, hcas=("mlx5_0", "mlx5_1"))
    facts = Probe("gpu-01", root=root, run=smi((FIXTURES / "nvidia-smi-8xh100.csv").read_text())).facts()  # type: ignore[arg-type]
    assert (facts.os_id, facts.os_version, facts.kernel) == ("ubuntu", "22.04", "5.15.0-105-generic")
    assert facts.cpu_model == "Intel(R) Xeon(R) Platinum 8480+"
    assert facts.cpu_flags == ("avx", "avx2", "avx512f", "f16c", "fma")
    assert (facts.cores, facts.memory_mb) == (4, 2064074)
    assert (facts.nvidia_driver, facts.cuda_driver) == ("570.86.15", "12.8")
    assert len(facts.gpus) == 8
    assert facts.gpus[7] == GPUInfo(
        index=7,
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-7c3a9e2d-6b1f-4d58-a4c7-1e9b3d6f5a88",
        compute_capability="9.0",
        memory_mb=81559,
    )
    assert facts.hcas == ("mlx5_0", "mlx5_1")
    assert [i.name for i in facts.interfaces] == ["eth0", "ib0", "lo"]
    build = choose_build(ASSETS, TAG, facts)
    # CUDA 13.0 needs a newer driver than this one (12.8): 12.4 it is, with its runtime.
    assert build.main.name == f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz"
    assert build.runtime is not None
    assert build.runtime.name == "cudart-llama-bin-ubuntu-cuda-12.4-x64.tar.gz"


def test_a_node_without_gpus_is_cpu_only_and_picks_the_cpu_build(tmp_path: Path) -> None:
    facts = Probe("cpu-01", root=write_root(tmp_path, flags="fpu avx"), run=smi(None)).facts()  # type: ignore[arg-type]
    assert facts.gpus == ()
    assert facts.nvidia_driver == ""
    assert facts.has_avx2 is False
    assert choose_build(ASSETS, TAG, facts).main.name == f"llama-{TAG}-bin-ubuntu-x64.tar.gz"


@pytest.mark.parametrize(
    ("assets", "arch", "expected"),
    [
        ([f"llama-{TAG}-bin-ubuntu-x64.zip"], "x86_64", f"llama-{TAG}-bin-ubuntu-x64.zip"),
        (
            [f"llama-{TAG}-bin-ubuntu-arm64.tar.gz", f"llama-{TAG}-bin-ubuntu-x64.tar.gz"],
            "aarch64",
            f"llama-{TAG}-bin-ubuntu-arm64.tar.gz",
        ),
    ],
)
def test_build_selection_table(assets: list[str], arch: str, expected: str) -> None:
    facts = NodeFacts(node="n", arch=arch)
    build = choose_build([Asset(name=a) for a in assets], TAG, facts)
    assert build.main.name == expected
    assert build.layout_prefix == ("build/bin" if expected.endswith(".zip") else "")


def test_nothing_fits_lists_every_asset_and_why() -> None:
    facts = NodeFacts(node="n", arch="aarch64")
    with pytest.raises(NoBuildError) as err:
        choose_build(
            [
                Asset(name=n)
                for n in (
                    f"llama-{TAG}-bin-ubuntu-x64.tar.gz",
                    "llama-b1-bin-ubuntu-arm64.tar.gz",
                    f"llama-{TAG}-bin-ubuntu-cuda-12.4-arm64.tar.gz",
                    f"llama-{TAG}-bin-macos-arm64.zip",
                )
            ],
            TAG,
            facts,
        )
    assert str(err.value) == (
        f"no llama.cpp {TAG} build fits this node (arm64, no NVIDIA driver): "
        "llama-b1-bin-ubuntu-arm64.tar.gz: tag b1, want b10991; "
        f"llama-{TAG}-bin-macos-arm64.zip: not a llama.cpp Linux build; "
        f"llama-{TAG}-bin-ubuntu-cuda-12.4-arm64.tar.gz: CUDA build, node has no NVIDIA driver loaded; "
        f"llama-{TAG}-bin-ubuntu-x64.tar.gz: for x64, node is arm64"
    )


def test_cuda_build_without_its_runtime_is_rejected() -> None:
    facts = NodeFacts(
        node="n",
        arch="x86_64",
        nvidia_driver="570.86.15",
        cuda_driver="12.8",
        gpus=(GPUInfo(index=0, name="NVIDIA H100 80GB HBM3"),),
    )
    with pytest.raises(NoBuildError) as err:
        choose_build([Asset(name=f"llama-{TAG}-bin-ubuntu-cuda-12.4-x64.tar.gz")], TAG, facts)
    assert "no cudart archive for CUDA 12.4 in the release" in str(err.value)


def test_nvidia_smi_rows_and_versions() -> None:
    rows = parse_nvidia_smi_gpus(
        "0, NVIDIA A100-SXM4-80GB, GPU-1, 8.0, 81920\n1, Tesla T4, GPU-2, [N/A], [N/A]\n"
    )
    assert rows[1] == GPUInfo(index=1, name="Tesla T4", uuid="GPU-2", compute_capability="[N/A]", memory_mb=0)
    assert parse_version("version: 6789 (abc123)\nbuilt with cc") is not None
    v = parse_version("version: 6789 (abc123)")
    assert v is not None
    assert (v.text, v.build, v.commit) == ("b6789", "6789", "abc123")
    v = parse_version("version: 0.5.0-dev (build 17, commit deadbee)")
    assert v is not None
    assert (v.text, v.build, v.commit) == ("0.5.0-dev", "17", "deadbee")
    assert parse_version("nonsense") is None


def test_weights_fingerprint_is_cheap_and_changes_with_the_files(tmp_path: Path) -> None:
    from llmgw_core.probe import weights_fingerprint

    model = tmp_path / "llama-70b"
    model.mkdir()
    (model / "model-00001.safetensors").write_bytes(b"x" * 100)
    first = weights_fingerprint(model)
    assert len(first) == 16
    assert weights_fingerprint(model) == first
    (model / "model-00002.safetensors").write_bytes(b"y")
    assert weights_fingerprint(model) != first
    assert weights_fingerprint(tmp_path / "absent") == ""
    facts = Probe(
        "n",
        root=write_root(tmp_path / "root"),
        run=smi(None),  # type: ignore[arg-type]
        model_paths=(str(model), str(tmp_path / "absent")),
    ).facts()
    assert facts.weights == {str(model): weights_fingerprint(model), str(tmp_path / "absent"): ""}


# --- interfaces and the management interface ----------------------------------

IP_JSON = (FIXTURES / "ip-addr-gpu-node.json").read_text()


@pytest.mark.parametrize(
    ("mgmt_addr", "iface"),
    [
        ("10.1.2.11", "eno1"),
        ("fd00:10:1:2::11", "eno1"),
        ("192.168.50.11", "ibp26s0"),
        ("127.0.0.1", "lo"),
        # An address no interface holds (NAT, a typo): nothing is pinned.
        ("10.9.9.9", ""),
    ],
)
def test_the_management_interface_is_the_one_holding_the_management_address(
    tmp_path: Path, mgmt_addr: str, iface: str
) -> None:
    probe = Probe("gpu-01", root=write_root(tmp_path), run=smi(None, IP_JSON), mgmt_addr=mgmt_addr)  # type: ignore[arg-type]
    facts = probe.facts()
    assert (facts.mgmt_addr, facts.mgmt_iface) == (mgmt_addr, iface)
    assert facts.interfaces == (
        NetInterface(name="docker0", addresses=("172.17.0.1/16",), mac="02:42:8f:11:22:33", up=False),
        NetInterface(
            name="eno1",
            addresses=("10.1.2.11/24", "fd00:10:1:2::11/64", "fe80::3eec:efff:fe12:3456/64"),
            mac="3c:ec:ef:12:34:56",
        ),
        NetInterface(
            name="ibp220s0",
            mac="00:00:10:87:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:1a:2b:3d",
            up=False,
        ),
        NetInterface(
            name="ibp26s0",
            addresses=("192.168.50.11/24",),
            mac="00:00:10:49:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:1a:2b:3c",
        ),
        NetInterface(name="lo", addresses=("127.0.0.1/8", "::1/128"), mac="00:00:00:00:00:00"),
    )


def test_the_operator_names_the_management_interface_over_what_the_probe_finds(tmp_path: Path) -> None:
    probe = Probe(
        "gpu-01",
        root=write_root(tmp_path),
        run=smi(None, IP_JSON),  # type: ignore[arg-type]
        mgmt_addr="10.1.2.11",
        mgmt_iface="bond0",
    )
    assert probe.facts().mgmt_iface == "bond0"


def test_without_iproute2_interfaces_come_from_sys_and_proc(tmp_path: Path) -> None:
    root = write_root(tmp_path)
    (root / "proc/net").mkdir(parents=True)
    (root / "proc/net/if_inet6").write_text((FIXTURES / "if_inet6-gpu-node.txt").read_text())
    for name in ("eth0", "ib0"):
        (root / "sys/class/net" / name).rename(
            root / "sys/class/net" / {"eth0": "eno1", "ib0": "ibp26s0"}[name]
        )
    facts = Probe("gpu-01", root=root, run=smi(None), mgmt_addr="fd00:10:1:2::11").facts()  # type: ignore[arg-type]
    assert facts.mgmt_iface == "eno1"
    assert [(i.name, i.addresses) for i in facts.interfaces] == [
        ("eno1", ("fd00:10:1:2::11/64", "fe80::3eec:efff:fe12:3456/64")),
        ("ibp26s0", ()),
        ("lo", ("::1/128",)),
    ]


def not_found(argv: list[str]) -> CommandResult:
    return CommandResult(127, "", f"{argv[0]}: not found")


@pytest.mark.parametrize(
    "runner",
    [
        pytest.param(
            run_command,
            marks=pytest.mark.skipif(shutil.which("ip") is None, reason="iproute2 (`ip`) is not installed"),
            id="ip",
        ),
        pytest.param(not_found, id="without-iproute2"),
    ],
)
def test_this_machines_loopback_holds_127_0_0_1(runner: object) -> None:
    facts = Probe("local-1", run=runner, mgmt_addr="127.0.0.1").facts()  # type: ignore[arg-type]
    assert facts.mgmt_iface == "lo"
    [lo] = [i for i in facts.interfaces if i.name == "lo"]
    assert "127.0.0.1/8" in lo.addresses
    assert lo.up
