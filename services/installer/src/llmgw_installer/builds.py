"""Which llama.cpp release asset fits this node: a pure choice over the release's asset names.

Layouts llama.cpp has published:
- `llama-<tag>-bin-ubuntu-x64.tar.gz`, `llama-<tag>-bin-ubuntu-arm64.tar.gz` (CPU);
- `llama-<tag>-bin-ubuntu-cuda-<ver>-x64.tar.gz` plus `cudart-llama-bin-ubuntu-cuda-<ver>-x64.tar.gz`;
- older `llama-<tag>-bin-ubuntu-x64.zip`, binaries under `build/bin/`;
- other backends' builds, `llama-<tag>-bin-ubuntu-vulkan-x64.tar.gz` and the like,
  which llmgw names when it passes them over but does not install.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw_core.events import NodeFacts

from .errors import NoBuildError

_LINUX = re.compile(r"^llama-(?P<tag>[^-/]+)-bin-ubuntu-(?P<variant>[\w.+-]+)\.(?P<ext>tar\.gz|zip)$")
_CUDA_BACKEND = re.compile(r"^cuda-(?P<cuda>\d+(?:\.\d+)*)$")
_CUDART = re.compile(
    r"^cudart-(?P<rest>[\w.+-]*?)-?cuda-(?P<cuda>\d+(?:\.\d+)*)-(?P<arch>\w+)\.(?:tar\.gz|zip)$"
)

ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}

# Backends llama.cpp publishes Linux builds for that llmgw does not install: the
# CPU build runs everywhere and the CUDA build is the one NVIDIA nodes need.
BACKEND_NAMES = {
    "vulkan": "Vulkan",
    "rocm": "ROCm",
    "hip": "HIP",
    "sycl": "SYCL",
    "openvino": "OpenVINO",
    "opencl": "OpenCL",
    "musa": "MUSA",
    "cann": "CANN",
}


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


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def _split_variant(variant: str) -> tuple[str, str]:
    """`cuda-12.4-x64` -> (`cuda-12.4`, `x64`); `x64` -> (``, `x64`)."""
    backend, _, arch = variant.rpartition("-")
    return backend, arch


def _backend_name(backend: str) -> str:
    first = backend.split("-", 1)[0]
    return BACKEND_NAMES.get(first, first)


def choose_build(assets: list[Asset], tag: str, facts: NodeFacts) -> Build:
    """The build for this node: CUDA (newest the driver supports) when a driver is loaded, else CPU.

    When nothing fits, the error lists every asset of the release with the
    reason it was passed over, CUDA runtimes and other backends' builds included.
    """
    arch = ARCHES.get(facts.arch, facts.arch)
    has_driver = bool(facts.nvidia_driver) and bool(facts.gpus)
    driver_cuda = _version(facts.cuda_driver) if facts.cuda_driver else ()
    runtimes = {
        (m.group("cuda"), m.group("arch")): a
        for a in assets
        if (m := _CUDART.match(a.name)) and "ubuntu" in m.group("rest")
    }
    rejected: list[tuple[str, str]] = []
    cuda_builds: list[tuple[tuple[int, ...], Build]] = []
    cpu_builds: list[Build] = []
    cuda_versions: set[str] = set()
    for asset in sorted(assets, key=lambda a: a.name):
        if _CUDART.match(asset.name):
            continue  # judged below, once the CUDA builds are known
        m = _LINUX.match(asset.name)
        if m is None:
            rejected.append((asset.name, "not a llama.cpp Linux build"))
            continue
        backend, asset_arch = _split_variant(m.group("variant"))
        if m.group("tag") != tag:
            rejected.append((asset.name, f"tag {m.group('tag')}, want {tag}"))
            continue
        if asset_arch != arch:
            rejected.append((asset.name, f"for {asset_arch}, node is {arch}"))
            continue
        if not backend:
            cpu_builds.append(Build(main=asset))
            continue
        cuda_backend = _CUDA_BACKEND.match(backend)
        if cuda_backend is None:
            rejected.append(
                (
                    asset.name,
                    f"{_backend_name(backend)} build; llmgw installs the CPU build, "
                    "or the CUDA build where an NVIDIA driver is loaded",
                )
            )
            continue
        cuda = cuda_backend.group("cuda")
        cuda_versions.add(cuda)
        if not has_driver:
            rejected.append((asset.name, "CUDA build, node has no NVIDIA driver loaded"))
            continue
        if driver_cuda and _version(cuda) > driver_cuda:
            rejected.append((asset.name, f"needs CUDA {cuda}, driver supports {facts.cuda_driver}"))
            continue
        runtime = runtimes.get((cuda, arch))
        if runtime is None:
            rejected.append((asset.name, f"no cudart archive for CUDA {cuda} in the release"))
            continue
        cuda_builds.append((_version(cuda), Build(main=asset, runtime=runtime, cuda=cuda)))
    if has_driver and cuda_builds:
        return max(cuda_builds, key=lambda b: b[0])[1]
    if cpu_builds:
        # The tar.gz layout before the old zip one.
        return sorted(cpu_builds, key=lambda b: (b.main.name.endswith(".zip"), b.main.name))[0]
    for asset in assets:
        if m := _CUDART.match(asset.name):
            rejected.append((asset.name, _runtime_rejection(m, tag, arch, has_driver, facts, cuda_versions)))
    listing = "; ".join(f"{name}: {why}" for name, why in sorted(rejected)) or "the release has no assets"
    raise NoBuildError(
        f"no llama.cpp {tag} build fits this node ({arch}, "
        f"{'NVIDIA driver ' + facts.nvidia_driver if has_driver else 'no NVIDIA driver'}): {listing}"
    )


def _runtime_rejection(
    m: re.Match[str], tag: str, arch: str, has_driver: bool, facts: NodeFacts, cuda_versions: set[str]
) -> str:
    """Why a CUDA runtime archive (cudart) was not installed: it only ever goes beside its CUDA build."""
    cuda = m.group("cuda")
    if "ubuntu" not in m.group("rest"):
        return "not a llama.cpp Linux build"
    if m.group("arch") != arch:
        return f"for {m.group('arch')}, node is {arch}"
    if not has_driver:
        return "CUDA runtime, used only with a CUDA build; node has no NVIDIA driver loaded"
    if facts.cuda_driver and _version(cuda) > _version(facts.cuda_driver):
        return f"CUDA {cuda} runtime, driver supports {facts.cuda_driver}"
    if cuda not in cuda_versions:
        return f"CUDA {cuda} runtime, and the release has no CUDA {cuda} build of {tag} for {arch}"
    return f"CUDA {cuda} runtime, used only with the CUDA {cuda} build, which was passed over"
