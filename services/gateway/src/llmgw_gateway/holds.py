"""Requests held for a deployment that has no ready replica (one scaled to zero, or starting).

A bounded queue per deployment (`hold_queue`) and a bounded wait (`hold_timeout_s`): the
proxy adds a request, waits on its `woken` event (or the wait's end, or its client
leaving), and removes it. `release` wakes a deployment's held requests in the order
they came, once the routing table has a replica that can take them: asyncio runs the woken
tasks in that order, and each takes its replica before its first await, so they are routed
first come, first served. `close` (the gateway stopping) wakes every one with `closing` set, to
be answered 503 rather than cut off.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

import anyio

# `Retry-After` of each answer to a held request: a full queue drains as a replica starts;
# a wait that ran out may end soon (a model still loading); a restarting gateway, or another
# behind the same address, serves again within a second or two.
FULL_RETRY_AFTER_S = 5
TIMEOUT_RETRY_AFTER_S = 10
RESTART_RETRY_AFTER_S = 1


@dataclass(eq=False)
class Held:
    deployment: str
    since: float = field(default_factory=time.monotonic)
    woken: anyio.Event = field(default_factory=anyio.Event)
    # Set by `close`: the gateway is stopping, the request must not wait on.
    closing: bool = False


class Holds:
    """The held requests of every deployment. `limit` 0 or `timeout_s` 0: nothing is held."""

    def __init__(self, limit: int = 100, timeout_s: float = 120.0) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.closing = False
        self._queues: dict[str, deque[Held]] = {}

    @property
    def enabled(self) -> bool:
        return self.limit > 0 and self.timeout_s > 0

    def queued(self, deployment: str) -> int:
        return len(self._queues.get(deployment, ()))

    def counts(self) -> dict[str, int]:
        """Held requests per deployment that has any."""
        return {name: len(q) for name, q in self._queues.items() if q}

    def add(self, deployment: str) -> Held | None:
        """A new held request, last in its deployment's queue; None when the queue is full."""
        queue = self._queues.setdefault(deployment, deque())
        if len(queue) >= self.limit:
            return None
        held = Held(deployment)
        queue.append(held)
        return held

    def remove(self, held: Held) -> None:
        """Take `held` out of its queue (done waiting, for whatever reason); idempotent."""
        queue = self._queues.get(held.deployment)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(held)
        if not queue:
            del self._queues[held.deployment]

    def release(self, deployment: str) -> int:
        """Wake every request held for `deployment`, first come first; how many."""
        queue = self._queues.pop(deployment, None)
        if not queue:
            return 0
        for held in queue:
            held.woken.set()
        return len(queue)

    def close(self) -> None:
        """The gateway is stopping: wake every held request to be answered, and hold no more."""
        self.closing = True
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            for held in queue:
                held.closing = True
                held.woken.set()
