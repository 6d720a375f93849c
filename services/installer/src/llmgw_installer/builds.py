"""Which llama.cpp release asset fits this node: a pure choice over the release's asset names.

Layouts llama.cpp has published:
- `llama-<tag>-bin-ubuntu-x64.tar.gz`, `llama-<tag>-bin-ubuntu-arm64.tar.gz` (CPU);
- `llama-<tag>-bin-ubuntu-cuda-<ver>-x64.tar.gz` plus `cudart-llama-bin-ubuntu-cuda-<ver>-x64.tar.gz`;
- older `llama-<tag>-bin-ubuntu-x64.zip`, binaries under `build/bin/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw_core.events import NodeFacts

_ASSET = re.compile(
    r"^llama-(?P<tag>[^-]+)-bin-ubuntu-(?:cuda-(?P<cuda>\d+(?:\.\d+)*)-)?(?P<arch>x64|arm64)\.(?P<ext>tar\.gz|zip)$"
)
_CUDART = re.compile(r"^cudart-.*cuda-(?P<cuda>\d+(?:\.\d+)*)-(?P<arch>x64|arm64)\.(?:tar\.gz|zip)$")

ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


@dataclass(frozen=True)
class Asset:
    name: str
    url: str = ""
    size: int = 0
    sha256: str = ""


@dataclass(frozen=True)
class Build:
    main: Asset
    runtime: Asset | None = None
    cuda: str = ""

    @property
    def layout_prefix(self) -> str:
        """Where the binaries sit inside the archive."""
        return "build/bin" if self.main.name.endswith(".zip") else ""


class NoBuildError(Exception):
    pass


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def choose_build(assets: list[Asset], tag: str, facts: NodeFacts) -> Build:
    """The build for this node: CUDA (newest the driver supports) when a driver is loaded, else CPU."""
    arch = ARCHES.get(facts.arch, facts.arch)
    has_driver = bool(facts.nvidia_driver) and bool(facts.gpus)
    driver_cuda = _version(facts.cuda_driver) if facts.cuda_driver else ()
    runtimes = {(m.group("cuda"), m.group("arch")): a for a in assets if (m := _CUDART.match(a.name))}
    rejected: list[str] = []
    cuda_builds: list[tuple[tuple[int, ...], Build]] = []
    cpu_builds: list[Build] = []
    for asset in sorted(assets, key=lambda a: a.name):
        m = _ASSET.match(asset.name)
        if _CUDART.match(asset.name):
            continue
        if m is None:
            rejected.append(f"{asset.name}: not a llama.cpp Linux build")
            continue
        if m.group("tag") != tag:
            rejected.append(f"{asset.name}: tag {m.group('tag')}, want {tag}")
            continue
        if m.group("arch") != arch:
            rejected.append(f"{asset.name}: for {m.group('arch')}, node is {arch}")
            continue
        cuda = m.group("cuda")
        if cuda is None:
            cpu_builds.append(Build(main=asset))
            continue
        if not has_driver:
            rejected.append(f"{asset.name}: CUDA build, node has no NVIDIA driver loaded")
            continue
        if driver_cuda and _version(cuda) > driver_cuda:
            rejected.append(f"{asset.name}: needs CUDA {cuda}, driver supports {facts.cuda_driver}")
            continue
        runtime = runtimes.get((cuda, arch))
        if runtime is None:
            rejected.append(f"{asset.name}: no cudart archive for CUDA {cuda} in the release")
            continue
        cuda_builds.append((_version(cuda), Build(main=asset, runtime=runtime, cuda=cuda)))
    if has_driver and cuda_builds:
        return max(cuda_builds, key=lambda b: b[0])[1]
    if cpu_builds:
        # The tar.gz layout before the old zip one.
        return sorted(cpu_builds, key=lambda b: (b.main.name.endswith(".zip"), b.main.name))[0]
    listing = "; ".join(rejected) or "the release has no assets"
    raise NoBuildError(
        f"no llama.cpp {tag} build fits this node ({arch}, "
        f"{'NVIDIA driver ' + facts.nvidia_driver if has_driver else 'no NVIDIA driver'}): {listing}"
    )
