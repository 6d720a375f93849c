"""`http: workers: N`: N gateway processes serving one port, kept running by a supervisor.

The supervisor binds nothing it serves: it holds the port (bound, not listening, with
SO_REUSEPORT; so `port: 0` is picked once, and nothing else takes it between worker
restarts), and starts each worker as `python -m llmgw_gateway --worker K --port P --id ID`.
A worker is a whole gateway: it binds the port with SO_REUSEPORT (the kernel spreads new
connections over the listening workers), connects to the bus on its own and reports its
demand as `<id>-w<K>`. Plain subprocesses rather than multiprocessing: a worker starts as any
gateway does, by the same entry point, config file and error output, and nothing is pickled
or inherited but the pipe on which it says it is serving.

A worker that exits while the supervisor is not stopping is started again after a pause that
doubles from RESTART_FIRST_S to RESTART_CAP_S, back to the first once a worker stayed up
STABLE_S. SIGTERM or SIGINT: every worker is sent SIGTERM and given STOP_S to stop (its own
grace for requests in flight, its last demand report and usage), then killed.
A worker whose supervisor died stops too (it watches its parent: `watch_parent`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field

import anyio
import anyio.abc

from llmgw_core.errors import ConfigError
from llmgw_core.failures import how_it_ended

from .web import bind

log = logging.getLogger("llmgw.gateway")

RESTART_FIRST_S = 0.5
RESTART_CAP_S = 10.0
# A worker up this long is well: its next exit is restarted after RESTART_FIRST_S again.
STABLE_S = 30.0
# How long a worker may take to stop after SIGTERM before it is killed: the HTTP server's
# grace and its bound, the last demand report and usage write, with room to spare.
STOP_S = 15.0
# How often a worker looks whether its supervisor is still its parent.
PARENT_CHECK_S = 0.5


def next_delay(delay: float, up_s: float) -> float:
    """The pause before starting again a worker that was up `up_s`, after a pause of `delay`
    before its last start (0: none, its first)."""
    if delay == 0 or up_s >= STABLE_S:
        return RESTART_FIRST_S
    return min(delay * 2, RESTART_CAP_S)


async def watch_parent(parent: int, scope: anyio.CancelScope) -> None:
    """Cancel `scope` once the process's parent is no longer `parent` (the supervisor died: its
    orphans are adopted by init or a subreaper), so that no worker serves on without it."""
    while os.getppid() == parent:
        await anyio.sleep(PARENT_CHECK_S)
    log.warning("the workers' supervisor (pid %d) is gone: stopping", parent)
    scope.cancel()


def say_ready(fd: int) -> None:
    """Tell the supervisor on `fd` (`--ready-fd`) that this worker serves."""
    try:
        os.write(fd, b"ready\n")
    except OSError as exc:
        log.warning("cannot tell the supervisor this worker serves: %s", exc)
    finally:
        os.close(fd)


@dataclass
class Worker:
    index: int
    process: anyio.abc.Process | None = None
    # The pause before its last start (0: none yet).
    delay: float = 0.0


@dataclass
class Supervisor:
    config_path: str
    count: int
    host: str
    port: int
    # The gateway's id: worker K reports demand as `<id>-w<K>`.
    gateway_id: str
    workers: list[Worker] = field(init=False)
    ready: set[int] = field(default_factory=set)
    stopping: bool = False
    announced: bool = False
    # Where each worker says on which private port it serves its metrics (`worker_metrics`).
    run_dir: str = ""

    def __post_init__(self) -> None:
        self.workers = [Worker(k) for k in range(self.count)]

    def argv(self, k: int, ready_fd: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "llmgw_gateway",
            "--config",
            self.config_path,
            "--worker",
            str(k),
            "--port",
            str(self.port),
            "--id",
            f"{self.gateway_id}-w{k}",
            "--ready-fd",
            str(ready_fd),
            "--run-dir",
            self.run_dir,
        ]

    def hold_port(self) -> socket.socket:
        """The port bound for the workers to share (port 0: a free one, kept in self.port)."""
        try:
            sock = bind(self.host, self.port, reuse_port=True, listen=False)
        except OSError as exc:
            raise ConfigError(
                f"{exc.strerror or exc}; choose another http: port (0 takes a free one) or stop what holds it"
            ) from exc
        self.port = int(sock.getsockname()[1])
        return sock

    async def run(self) -> None:
        """Hold the port and keep the workers running until SIGTERM or SIGINT, then stop them."""
        # The signals are taken before the first worker starts: none may end the supervisor
        # and leave its workers to notice alone.
        with (
            tempfile.TemporaryDirectory(prefix="llmgw-gateway-") as self.run_dir,
            self.hold_port(),
            anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals,
        ):
            async with anyio.create_task_group() as tg:
                for worker in self.workers:
                    tg.start_soon(self._keep, worker, tg)
                async for signum in signals:
                    log.info("%s: stopping %d workers", signal.Signals(signum).name, self.count)
                    break
                await self._stop()
                tg.cancel_scope.cancel()

    async def _keep(self, worker: Worker, tg: anyio.abc.TaskGroup) -> None:
        """Run `worker`, and start it again each time it ends, until the supervisor stops."""
        k = worker.index
        while not self.stopping:
            started = time.monotonic()
            pid = 0
            ended = "could not be started"
            try:
                read, write = os.pipe()
                try:
                    process = await anyio.open_process(
                        self.argv(k, write), stdin=None, stdout=None, stderr=None, pass_fds=(write,)
                    )
                finally:
                    os.close(write)
                worker.process = process
                pid = process.pid
                log.info("worker %d started (pid %d)", k, pid)
                tg.start_soon(self._await_ready, k, pid, read)
                code = await process.wait()
                ended = how_it_ended(code)
            except Exception:
                log.exception("worker %d: starting or waiting for it failed", k)
            finally:
                self.ready.discard(k)
            if self.stopping:
                return
            up_s = time.monotonic() - started
            worker.delay = next_delay(worker.delay, up_s)
            log.warning(
                "worker %d (pid %d) %s after %.1fs; starting it again in %gs",
                k,
                pid,
                ended,
                up_s,
                worker.delay,
            )
            await anyio.sleep(worker.delay)

    async def _await_ready(self, k: int, pid: int, fd: int) -> None:
        """Wait for worker `k` to say on `fd` that it serves (nothing: it ended first); the
        endpoint is announced once every worker served."""
        try:
            await anyio.wait_readable(fd)
            said = os.read(fd, 64)
        except OSError as exc:
            log.warning("cannot hear whether worker %d (pid %d) serves: %s", k, pid, exc)
            return
        finally:
            os.close(fd)
        if not said:
            return
        self.ready.add(k)
        log.info("worker %d (pid %d) serves on port %d", k, pid, self.port)
        if len(self.ready) == self.count and not self.announced:
            self.announced = True
            print(
                f"llmgw-gateway: OpenAI endpoint on http://{self.host}:{self.port}/v1 ({self.count} workers)",
                flush=True,
            )

    async def _stop(self) -> None:
        """SIGTERM every worker, wait up to STOP_S for all, then kill those still running."""
        self.stopping = True
        running = [w.process for w in self.workers if w.process is not None and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(STOP_S):
            for process in running:
                await process.wait()
        for process in running:
            if process.returncode is None:
                log.warning("worker pid %d did not stop within %gs: killing it", process.pid, STOP_S)
                process.kill()
                await process.wait()
