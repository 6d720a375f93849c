"""The GPU path checked on a real NVIDIA machine, and what it saw saved as test fixtures.

    python bench/gpu_check.py OUT_DIR

In under five minutes, with no network, on one NVIDIA machine:

1. runs the node probe (`llmgw_core.probe.Probe`) against the real `nvidia-smi`, and saves
   the raw outputs it reads (`nvidia-smi --query-gpu=… --format=csv,noheader,nounits` and the
   plain banner) with the NodeFacts it made of them;
2. starts child processes pinned to GPUs with the environment the launcher gives a shard
   (`CUDA_VISIBLE_DEVICES` from `generated_env`) and asks the CUDA driver (libcuda, through
   ctypes, or torch where libcuda cannot be loaded) which GPUs each child sees, by UUID: a
   child must see exactly its GPUs, in the order given, and a child pinned to none sees none.
   `nvidia-smi` itself ignores `CUDA_VISIBLE_DEVICES` (it talks to NVML), so it cannot show this;
3. writes the files in the form `tests/fixtures/` keeps them (`nvidia-smi-<n>x<gpu>.csv`,
   `nvidia-smi-banner-<n>x<gpu>.txt`, `node-facts-<n>x<gpu>.json`, `pinning-<n>x<gpu>.json`)
   and a note of what was recorded, and prints a summary.

The exit status is 0 when every pinned child saw exactly its GPUs, 1 when one did not, and 2
when the check cannot run here (no nvidia-smi, or nvidia-smi fails).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from llmgw_core.engines import Profile, ShardSpec, generated_env
from llmgw_core.probe import NVIDIA_SMI_DRIVER, NVIDIA_SMI_GPUS, Probe, parse_nvidia_smi_gpus

# Each command and child gets this long; the whole check stays under five minutes.
STEP_TIMEOUT_S = 60.0

# Run in a child pinned with CUDA_VISIBLE_DEVICES: the GPUs the CUDA driver shows it, as JSON.
CHILD = r"""
import ctypes, json, sys
init = None

def via_libcuda():
    global init
    cuda = ctypes.CDLL("libcuda.so.1")
    init = cuda.cuInit(0)  # 100, CUDA_ERROR_NO_DEVICE, when pinned to none
    if init != 0:
        count = 0
    else:
        n = ctypes.c_int()
        if cuda.cuDeviceGetCount(ctypes.byref(n)) != 0:
            raise RuntimeError("cuDeviceGetCount failed")
        count = n.value
    seen = []
    for i in range(count):
        dev = ctypes.c_int()
        cuda.cuDeviceGet(ctypes.byref(dev), i)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, dev)
        raw = ctypes.create_string_buffer(16)
        get_uuid = getattr(cuda, "cuDeviceGetUuid_v2", None) or cuda.cuDeviceGetUuid
        get_uuid(raw, dev)
        h = raw.raw.hex()
        uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        bus = ctypes.create_string_buffer(64)
        cuda.cuDeviceGetPCIBusId(bus, 64, dev)
        seen.append({"ordinal": i, "name": name.value.decode(), "uuid": uuid, "pci": bus.value.decode()})
    return "libcuda", seen

def via_torch():
    import torch
    seen = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        uuid = str(getattr(p, "uuid", ""))
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        seen.append({"ordinal": i, "name": p.name, "uuid": uuid, "pci": ""})
    return "torch", seen

try:
    how, seen = via_libcuda()
except OSError as exc:
    try:
        how, seen = via_torch()
    except ImportError:
        sys.exit(f"cannot load libcuda.so.1 ({exc}) and torch is not installed")
print(json.dumps({"via": how, "cuInit": init, "seen": seen}))
"""


class CheckError(Exception):
    """The check cannot run on this machine; the message says why and what to do."""


def run(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=STEP_TIMEOUT_S, env=env, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise CheckError(f"{' '.join(argv)} did not finish within {STEP_TIMEOUT_S:g} s") from exc


def require_nvidia_smi() -> None:
    if shutil.which("nvidia-smi") is None:
        raise CheckError(
            "nvidia-smi not found on PATH: this check needs an NVIDIA machine with its driver "
            "installed (nvidia-smi comes with the driver); nothing was recorded"
        )


def gpu_slug(names: list[str]) -> str:
    """`8xh100` for eight "NVIDIA H100 80GB HBM3"; `4xmixed` for different models."""
    models = set()
    for name in names:
        words = [
            w
            for w in re.split(r"[^A-Za-z0-9]+", name)
            if w and w.lower() not in ("nvidia", "tesla", "geforce", "rtx")
        ]
        models.add(words[0].lower() if words else "gpu")
    model = models.pop() if len(models) == 1 else "mixed"
    return f"{len(names)}x{model}"


def pin_sets(count: int) -> list[tuple[int, ...]]:
    """The GPU sets the children are pinned to: none, the first, the last, and the last two in
    reverse order (which shows that CUDA counts them in the order given)."""
    sets: list[tuple[int, ...]] = [(), (0,)]
    if count > 1:
        sets += [(count - 1,), (count - 1, count - 2)]
    return sets


def pinned_child(gpus: tuple[int, ...]) -> dict[str, Any]:
    """What a child started with the shard environment of `gpus` saw."""
    profile = Profile(name="gpu-check", engine="sim", model_path="none")
    spec = ShardSpec(
        replica="r0", shard="gpu-check", node=socket.gethostname() or "node", profile=profile, gpus=gpus
    )
    env = {**os.environ, **generated_env(spec)}
    done = run([sys.executable, "-c", CHILD], env=env)
    if done.returncode != 0:
        return {"gpus": list(gpus), "env": env["CUDA_VISIBLE_DEVICES"], "error": done.stderr.strip()[-2000:]}
    return {"gpus": list(gpus), "env": env["CUDA_VISIBLE_DEVICES"], **json.loads(done.stdout)}


def judge(child: dict[str, Any], uuids: dict[int, str]) -> str | None:
    """None if the child saw exactly its GPUs in the order pinned; else what it saw instead."""
    if "error" in child:
        return f"the child pinned to {child['env']!r} failed: {child['error']}"
    want = [uuids[i] for i in child["gpus"]]
    got = [s["uuid"] for s in child["seen"]]
    if got != want:
        return f"CUDA_VISIBLE_DEVICES={child['env']!r}: wanted {want}, the child saw {got}"
    return None


def check(out: Path) -> int:
    started = time.monotonic()
    require_nvidia_smi()
    listing = run(NVIDIA_SMI_GPUS)
    if listing.returncode != 0:
        raise CheckError(
            f"{' '.join(NVIDIA_SMI_GPUS)} exited with code {listing.returncode}: "
            f"{(listing.stderr or listing.stdout).strip()}; is the NVIDIA driver loaded?"
        )
    banner = run(NVIDIA_SMI_DRIVER)
    names_list = run(["nvidia-smi", "-L"])
    gpus = parse_nvidia_smi_gpus(listing.stdout)
    if not gpus:
        raise CheckError(f"nvidia-smi lists no GPUs:\n{listing.stdout}")
    facts = Probe(socket.gethostname() or "node").facts()
    slug = gpu_slug([g.name for g in gpus])
    uuids = {g.index: g.uuid for g in gpus}
    children = [pinned_child(s) for s in pin_sets(len(gpus))]
    problems = [p for c in children if (p := judge(c, uuids))]

    out.mkdir(parents=True, exist_ok=True)
    files = {
        f"nvidia-smi-{slug}.csv": listing.stdout,
        f"nvidia-smi-banner-{slug}.txt": banner.stdout,
        f"nvidia-smi-L-{slug}.txt": names_list.stdout,
        f"node-facts-{slug}.json": msgspec.json.format(msgspec.json.encode(facts).decode(), indent=2) + "\n",
        f"pinning-{slug}.json": json.dumps(children, indent=2) + "\n",
    }
    note = [
        f"# gpu_check on {facts.node}, {time.strftime('%Y-%m-%d', time.gmtime())}",
        "",
        f"{len(gpus)} x {gpus[0].name}, driver {facts.nvidia_driver}, CUDA {facts.cuda_driver}, "
        f"{platform.system()} {platform.release()} ({facts.os_id} {facts.os_version}).",
        "Recorded by `bench/gpu_check.py`: the outputs of "
        f"`{' '.join(NVIDIA_SMI_GPUS)}` (`nvidia-smi-{slug}.csv`), plain `nvidia-smi` "
        f"(`nvidia-smi-banner-{slug}.txt`) and `nvidia-smi -L`; the probe's NodeFacts "
        f"(`node-facts-{slug}.json`); what children pinned with CUDA_VISIBLE_DEVICES saw "
        f"(`pinning-{slug}.json`). UUIDs and addresses are the machine's own.",
        "",
        "Pinning: " + ("every child saw exactly its GPUs." if not problems else "; ".join(problems)),
    ]
    files[f"gpu-check-{slug}.md"] = "\n".join(note) + "\n"
    for name, text in files.items():
        (out / name).write_text(text)

    print(
        f"probe: {facts.node}: {len(facts.gpus)} GPUs, driver {facts.nvidia_driver}, CUDA {facts.cuda_driver}"
    )
    for g in facts.gpus:
        print(f"  {g.index}: {g.name} {g.uuid} cc {g.compute_capability}, {g.memory_mb} MiB")
    for c in children:
        seen = c.get("seen")
        what = ", ".join(s["uuid"] for s in seen) if seen is not None else f"error: {c.get('error')}"
        print(f"pinned CUDA_VISIBLE_DEVICES={c['env']!r} ({c.get('via', '?')}): sees [{what}]")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print(f"saved {len(files)} files to {out} in {time.monotonic() - started:.1f} s")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to save what was seen (as test fixtures)")
    args = parser.parse_args(argv)
    try:
        return check(args.out)
    except CheckError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
