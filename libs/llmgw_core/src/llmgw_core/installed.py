"""The installed-engine marker, shared by the installer (writes) and the launcher (reads).

An engine is installed only when `<state_dir>/engines/<name>/<version>/.llmgw-installed`
exists; the installer writes it inside the staging directory and renames the
whole directory into place, so the marker is there exactly when the install is.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

MARKER = ".llmgw-installed"


class InstalledEngine(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    tag: str
    version: str
    bin_dir: str
    asset: str = ""
    sha256: str = ""
    installed_at: float = 0.0
    # Why the build is the CPU one on a node with GPUs (see EngineState.cpu_only), and the
    # CUDA version the driver supported when the build was chosen: a driver upgraded since
    # has the build chosen again.
    cpu_only: str = ""
    cuda_driver: str = ""


def engines_root(state_dir: str | Path) -> Path:
    return Path(state_dir).resolve() / "engines"


def read_marker(install_dir: Path) -> InstalledEngine | None:
    try:
        return msgspec.json.decode((install_dir / MARKER).read_bytes(), type=InstalledEngine)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def installed(state_dir: str | Path) -> dict[str, InstalledEngine]:
    """The newest installed build of each engine under `state_dir`."""
    out: dict[str, InstalledEngine] = {}
    root = engines_root(state_dir)
    if not root.is_dir():
        return out
    for engine_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        found = [m for d in sorted(engine_dir.iterdir()) if (m := read_marker(d)) is not None]
        if found:
            out[engine_dir.name] = max(found, key=lambda m: m.installed_at)
    return out
