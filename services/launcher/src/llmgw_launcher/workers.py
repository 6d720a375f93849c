"""Where the launcher's blocking work runs: few worker threads, on purpose.

Worker threads are not free. Each is one more contender for the GIL, and on a
machine whose cores are all busy (fifty engines starting at once) every
hand-off between threads waits for the kernel to schedule the thread it is
handed to: tens of milliseconds each. Measured on 2 cores under 40 busy
processes, 50 spawns from 40 threads held the event loop for 1.5 s.

Spawns have threads of their own that take them from a queue: a burst of
spawns runs back to back, without a wake-up of a thread (and a trip back to
the event loop for the next one) between two spawns. `procs.Spawn.run` lets go
of the GIL while the kernel makes the child and the child execs, so the event
loop runs on (heartbeats, probes, statuses, the next shard's spec) meanwhile.
Up to SPAWN_THREADS of them; one that has had nothing to do for IDLE_S ends.

File work (record fsyncs, /proc scans, log reads) shares FILE_THREADS threads:
a batch's fsyncs side by side, so that the filesystem can commit them together.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio import CapacityLimiter

T = TypeVar("T")

FILE_THREADS = 2
SPAWN_THREADS = 2
IDLE_S = 10.0

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class Workers:
    def __init__(self, file_threads: int = FILE_THREADS, spawn_threads: int = SPAWN_THREADS) -> None:
        self._files = CapacityLimiter(file_threads)
        self.spawn_threads = spawn_threads
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._spawners = 0  # threads taking jobs

    async def spawn(self, fn: Callable[[], T]) -> T:
        """`fn()` in a spawning thread. Not cancellable: a process started meanwhile would
        otherwise have no owner."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._jobs.put((fn, loop, future))
            if self._spawners < self.spawn_threads:
                self._spawners += 1
                threading.Thread(target=self._take_jobs, name="llmgw-spawn", daemon=True).start()
        with anyio.CancelScope(shield=True):
            result = await future
        return result

    def _take_jobs(self) -> None:
        while True:
            try:
                fn, loop, future = self._jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with self._lock:  # a job put meanwhile is taken, not left behind
                    if self._jobs.empty():
                        self._spawners -= 1
                        return
                continue
            try:
                result = fn()
            except BaseException as exc:  # handed to the task that asked
                loop.call_soon_threadsafe(_settle, future, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, future, result, None)

    async def files(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in one of the file threads."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._files)


def _settle(future: asyncio.Future[Any], result: object, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
