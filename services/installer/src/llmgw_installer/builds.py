"""Which llama.cpp release asset fits this node: a pure choice over the release's asset names.

Layouts llama.cpp has published:
- `llama-<tag>-bin-ubuntu-x64.tar.gz`, `llama-<tag>-bin-ubuntu-arm64.tar.gz` (CPU), every
  member under a top-level `llama-<tag>/`;
- `llama-<tag>-bin-ubuntu-cuda-<ver>-<arch>.tar.gz` plus its CUDA runtime,
  `cudart-llama-<tag>-bin-ubuntu-cuda-<ver>-<arch>.tar.gz` (members under a top-level
  directory of that name; b11434 ships CUDA 12.8 and 13.4 for x64, 13.4 for arm64);
  releases before the tag went into the runtime's name called it
  `cudart-llama-bin-ubuntu-cuda-<ver>-x64.tar.gz`;
- older `llama-<tag>-bin-ubuntu-x64.zip`, binaries under `build/bin/`;
- other backends' builds, `llama-<tag>-bin-ubuntu-vulkan-x64.tar.gz` and the like,
  which llmgw names when it passes them over but does not install.

A node with an NVIDIA driver whose CUDA version no CUDA build of the release
runs gets the CPU build, and the choice says so (`Build.cpu_only`): the node
reports it, and placement gives it no GPU profile of the engine. Installing
nothing instead would also take the node's CPU profiles away; installing the CPU
build quietly is how GPU work ends up on a CPU several times slower with nothing
looking wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw_core.events import NodeFacts

from .errors import NoBuildError

_LINUX = re.compile(r"^llama-(?P<tag>[^-/]+)-bin-ubuntu-(?P<variant>[\w.+-]+)\.(?P<ext>tar\.gz|zip)$")
_CUDA_BACKEND = re.compile(r"^cuda-(?P<cuda>\d+(?:\.\d+)*)$")
# `cudart-llama-b11434-bin-ubuntu-cuda-12.8-x64.tar.gz`; before b6xxx without the tag.
_CUDART = re.compile(
    r"^cudart-llama-(?:(?P<tag>[^-/]+)-)?bin-(?P<os>[a-z]+)-cuda-(?P<cuda>\d+(?:\.\d+)*)"
    r"-(?P<arch>\w+)\.(?:tar\.gz|zip)$"
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
    # Set when this is the CPU build on a node with NVIDIA GPUs: why no CUDA build fits.
    cpu_only: str = ""

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
        for a in sorted(assets, key=lambda a: a.name)
        if (m := _CUDART.match(a.name)) and m.group("os") == "ubuntu" and m.group("tag") in (None, tag)
    }
    rejected: list[tuple[str, str]] = []
    cuda_builds: list[tuple[tuple[int, ...], Build]] = []
    cpu_builds: list[Build] = []
    cuda_versions: set[str] = set()
    # Why each CUDA build for this node's architecture was passed over.
    cuda_rejected: list[tuple[str, str]] = []
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
            cuda_rejected.append((asset.name, f"needs CUDA {cuda}, driver supports {facts.cuda_driver}"))
            continue
        runtime = runtimes.get((cuda, arch))
        if runtime is None:
            cuda_rejected.append((asset.name, f"no cudart archive for CUDA {cuda} in the release"))
            continue
        cuda_builds.append((_version(cuda), Build(main=asset, runtime=runtime, cuda=cuda)))
    rejected += cuda_rejected
    if has_driver and cuda_builds:
        return max(cuda_builds, key=lambda b: b[0])[1]
    if cpu_builds:
        # The tar.gz layout before the old zip one.
        cpu = sorted(cpu_builds, key=lambda b: (b.main.name.endswith(".zip"), b.main.name))[0]
        if has_driver and not facts.simulated:
            return Build(main=cpu.main, cpu_only=_no_cuda_build(tag, arch, facts, cuda_rejected))
        return cpu
    for asset in assets:
        if m := _CUDART.match(asset.name):
            rejected.append((asset.name, _runtime_rejection(m, tag, arch, has_driver, facts, cuda_versions)))
    listing = "; ".join(f"{name}: {why}" for name, why in sorted(rejected)) or "the release has no assets"
    raise NoBuildError(
        f"no llama.cpp {tag} build fits this node ({arch}, "
        f"{'NVIDIA driver ' + facts.nvidia_driver if has_driver else 'no NVIDIA driver'}): {listing}"
    )


def _no_cuda_build(tag: str, arch: str, facts: NodeFacts, rejected: list[tuple[str, str]]) -> str:
    """Why a node with NVIDIA GPUs gets no CUDA build of `tag`, in words an operator acts on."""
    if not rejected:
        return f"{tag} has no CUDA build for {arch}"
    offered = sorted(
        {m.group("cuda") for name, _ in rejected if (m := _CUDA_IN_NAME.search(name))}, key=_version
    )
    if all(why.startswith("needs CUDA ") for _, why in rejected):
        return (
            f"driver supports CUDA {facts.cuda_driver}; {tag} has CUDA builds {', '.join(offered)} only "
            f"(a driver for CUDA {offered[0]} or newer runs the CUDA build)"
        )
    return f"no CUDA build of {tag} fits: " + "; ".join(f"{name}: {why}" for name, why in rejected)


_CUDA_IN_NAME = re.compile(r"-cuda-(?P<cuda>\d+(?:\.\d+)*)-")


def _runtime_rejection(
    m: re.Match[str], tag: str, arch: str, has_driver: bool, facts: NodeFacts, cuda_versions: set[str]
) -> str:
    """Why a CUDA runtime archive (cudart) was not installed: it only ever goes beside its CUDA build."""
    cuda = m.group("cuda")
    if m.group("os") != "ubuntu":
        return "not a llama.cpp Linux build"
    if m.group("tag") not in (None, tag):
        return f"tag {m.group('tag')}, want {tag}"
    if m.group("arch") != arch:
        return f"for {m.group('arch')}, node is {arch}"
    if not has_driver:
        return "CUDA runtime, used only with a CUDA build; node has no NVIDIA driver loaded"
    if facts.cuda_driver and _version(cuda) > _version(facts.cuda_driver):
        return f"CUDA {cuda} runtime, driver supports {facts.cuda_driver}"
    if cuda not in cuda_versions:
        return f"CUDA {cuda} runtime, and the release has no CUDA {cuda} build of {tag} for {arch}"
    return f"CUDA {cuda} runtime, used only with the CUDA {cuda} build, which was passed over"


def cuda_of(asset_name: str) -> str:
    """The CUDA version a build's asset name says it was built for; `` for any other build."""
    m = _CUDA_IN_NAME.search(asset_name)
    return m.group("cuda") if m else ""


def choose_again(asset_name: str, chosen_under: str, facts: NodeFacts) -> str:
    """Why an installed build, chosen when the driver supported CUDA `chosen_under`, should be
    chosen again now (the driver was installed, upgraded or downgraded since), or ``.

    A CPU build chosen for want of a fitting CUDA build would otherwise stay after the
    driver is upgraded, and the node would go on saying words that are no longer true.
    """
    if facts.simulated or not (facts.nvidia_driver and facts.gpus):
        return ""
    cuda = cuda_of(asset_name)
    if not cuda and facts.cuda_driver != chosen_under:
        was = f"CUDA {chosen_under}" if chosen_under else "no NVIDIA driver"
        now_cuda = facts.cuda_driver or "unknown"
        return f"the driver supports CUDA {now_cuda} now ({was} when the CPU build was chosen)"
    if cuda and facts.cuda_driver and _version(cuda) > _version(facts.cuda_driver):
        return f"the CUDA {cuda} build needs a newer driver than this one (CUDA {facts.cuda_driver})"
    return ""
