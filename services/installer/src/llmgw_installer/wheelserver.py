"""The node's wheel server: the engine wheels it holds, served to the cluster's other nodes.

    GET /wheels/<lock digest>/manifest     the lock's manifest (file names, sha256, sizes)
    GET /wheels/<lock digest>/<sha256>     one wheel, by the sha256 the lock names

Only complete wheel directories (their manifest written) are served, and only the files their
own manifest names: a request's path is two hex digests, never a file name, so it cannot name
anything outside `<engines>/.wheels`. No token: a wheel is a public file of the package index,
and every reader checks every byte against its lock's sha256. At most `MAX_CONNECTIONS` are
served at once (the next is answered 503); each read and write waits at most `TIMEOUT_S`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import anyio
import anyio.abc

from .wheels import MANIFEST

log = logging.getLogger("llmgw.installer.wheels")

MAX_CONNECTIONS = 32
TIMEOUT_S = 30.0
_PATH = re.compile(r"^/wheels/([0-9a-f]{64})/(manifest|[0-9a-f]{64})$")


def served_file(wheel_root: Path, path: str) -> Path | None:
    """The file a request path names under `wheel_root`, or None (pure but for reading the
    lock's own manifest)."""
    hit = _PATH.fullmatch(path)
    if hit is None:
        return None
    lock_dir = wheel_root / hit.group(1)
    listing = lock_dir / MANIFEST
    if hit.group(2) == "manifest":
        return listing if listing.is_file() else None
    try:
        rows = json.loads(listing.read_bytes()).get("wheels", [])
    except (OSError, ValueError, AttributeError):
        return None
    want = hit.group(2)
    name = next((r.get("file") for r in rows if isinstance(r, dict) and r.get("sha256") == want), None)
    if not isinstance(name, str) or "/" in name or name.startswith("."):
        return None
    found = lock_dir / name
    return found if found.parent == lock_dir and found.is_file() else None


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s: " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        if not self.server.slots.acquire(blocking=False):
            self._empty(503)
            return
        try:
            found = served_file(self.server.wheel_root, self.path)
            if found is None:
                self._empty(404)
                return
            with found.open("rb") as f:
                size = found.stat().st_size
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(size))
                self.end_headers()
                self.wfile.flush()
                # The kernel copies the file to the socket (sendfile): no byte through Python.
                self.connection.sendfile(f)
        except OSError as exc:
            log.info("a wheel was not served to %s: %s", self.address_string(), exc)
            self.close_connection = True
        finally:
            self.server.slots.release()

    def _empty(self, code: int) -> None:
        self.send_response(code)
        self.send_header("Content-Length", "0")
        self.end_headers()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], wheel_root: Path) -> None:
        self.wheel_root = wheel_root
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(addr, _Handler)


async def serve(
    wheel_root: Path,
    host: str,
    port: int = 0,
    *,
    task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `wheel_root` on `host:port` (0: any free port) until cancelled; started with the port."""
    server = _Server((host, port), wheel_root)
    thread = threading.Thread(target=server.serve_forever, name="llmgw-wheels", daemon=True)
    thread.start()
    try:
        task_status.started(server.server_address[1])
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(server.shutdown)
            server.server_close()
