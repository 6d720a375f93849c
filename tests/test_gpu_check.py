"""bench/gpu_check.py, as far as it runs without a GPU: a clear refusal where there is no
nvidia-smi, and the fixtures it saves, in the form tests/fixtures keeps, from what nvidia-smi
printed (a stand-in nvidia-smi here that prints the recorded outputs)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import msgspec

from llmgw_core.events import NodeFacts

ROOT = Path(__file__).parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
SCRIPT = ROOT / "bench" / "gpu_check.py"


def gpu_check(out: Path, path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": str(path)}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=120
    )


def test_without_nvidia_smi_it_says_so_and_records_nothing(tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    done = gpu_check(tmp_path / "out", empty)
    assert done.returncode == 2
    assert done.stderr == (
        "gpu_check: nvidia-smi not found on PATH: this check needs an NVIDIA machine with its "
        "driver installed (nvidia-smi comes with the driver); nothing was recorded\n"
    )
    assert not (tmp_path / "out").exists()


def test_what_nvidia_smi_printed_is_saved_as_fixtures(tmp_path: Path) -> None:
    """nvidia-smi answers (from the 8x H100 fixtures); this machine has no CUDA driver, so the
    pinned children cannot see a GPU and the check fails saying so, after saving what it saw."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f'case "$1" in --query-gpu=*) cat {FIXTURES / "nvidia-smi-8xh100.csv"} ;;'
        ' -L) echo "GPU 0: NVIDIA H100 80GB HBM3" ;;'
        f" *) cat {FIXTURES / 'nvidia-smi-banner.txt'} ;; esac\n"
    )
    smi.chmod(0o755)
    out = tmp_path / "out"
    done = gpu_check(out, Path(f"{bin_dir}{os.pathsep}{os.environ['PATH']}"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu-check-8xh100.md",
        "node-facts-8xh100.json",
        "nvidia-smi-8xh100.csv",
        "nvidia-smi-L-8xh100.txt",
        "nvidia-smi-banner-8xh100.txt",
        "pinning-8xh100.json",
    ]
    assert (out / "nvidia-smi-8xh100.csv").read_text() == (FIXTURES / "nvidia-smi-8xh100.csv").read_text()
    assert (out / "nvidia-smi-banner-8xh100.txt").read_text() == (
        FIXTURES / "nvidia-smi-banner.txt"
    ).read_text()
    facts = msgspec.json.decode((out / "node-facts-8xh100.json").read_bytes(), type=NodeFacts)
    assert [g.index for g in facts.gpus] == list(range(8))
    assert facts.gpus[0].name == "NVIDIA H100 80GB HBM3"
    assert "probe: " in done.stdout
    assert "8 GPUs" in done.stdout
    # No GPU here: the pinned child sees none, by libcuda (which does not load) or, where the
    # real-engines group put torch beside it, by torch (which counts no device).
    assert "PROBLEM: the child pinned to '0' failed: cannot load libcuda.so.1" in done.stdout or re.search(
        r"^PROBLEM: CUDA_VISIBLE_DEVICES='0': wanted \['GPU-[0-9a-f-]+'\], the child saw \[\]$",
        done.stdout,
        re.MULTILINE,
    ), done.stdout
    assert f"saved 6 files to {out}" in done.stdout
