"""Requests held for a deployment that has no ready replica (one scaled to zero, or starting).

A bounded queue per deployment (`hold_queue`) and a bounded wait (`hold_timeout_s`): the
proxy adds a request, waits on its `woken` event (or the wait's end, or its client
leaving), and removes it. `release` wakes a deployment's held requests in the order
they came, once the routing table has a replica that can take them, each with its turn
(`at`): they go out at most `release_per_s` a second, first come, first served. Woken all at
once, 1,000 held requests opened 1,000 connections to a replica that had just started: its
listen backlog overflowed, and a third of them were answered 503 `cannot connect … within
5s`. `close` (the gateway stopping) wakes every one with `closing` set, and stops those
released and still waiting for their turn, to be answered 503 rather than cut off.
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
    # Set by `release`: when (time.monotonic) the request's turn to go out comes.
    at: float = 0.0
    # Set by `close` for a request released and waiting for its turn: it goes no further.
    stopped: anyio.Event = field(default_factory=anyio.Event)


class Holds:
    """The held requests of every deployment. `limit` 0 or `timeout_s` 0: nothing is held.
    Released ones go out at most `release_per_s` a second per deployment."""

    def __init__(self, limit: int = 100, timeout_s: float = 120.0, release_per_s: float = 100.0) -> None:
        self.limit = limit
        self.timeout_s = timeout_s
        self.release_per_s = release_per_s
        self.closing = False
        self._queues: dict[str, deque[Held]] = {}
        # Released, and waiting for their turn (until `remove`).
        self._going: set[Held] = set()
        # Per deployment released from: when its last released request's turn comes, so that
        # a release right after another waits behind it.
        self._last_turn: dict[str, float] = {}

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
        self._going.discard(held)
        queue = self._queues.get(held.deployment)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(held)
        if not queue:
            del self._queues[held.deployment]

    def release(self, deployment: str, now: float | None = None) -> int:
        """Wake every request held for `deployment`, first come first, each with its turn:
        `1 / release_per_s` after the one before it (the first now, or after the last turn
        of a release still going out); how many."""
        queue = self._queues.pop(deployment, None)
        if not queue:
            return 0
        now = time.monotonic() if now is None else now
        step = 1.0 / self.release_per_s
        last = self._last_turn.get(deployment)
        turn = now if last is None else max(now, last + step)
        for held in queue:
            held.at = turn
            held.woken.set()
            turn += step
        self._going.update(queue)
        self._last_turn[deployment] = turn - step
        # Forgotten once passed: deployments come and go.
        for name in [name for name, last in self._last_turn.items() if last < now]:
            del self._last_turn[name]
        return len(queue)

    def close(self) -> None:
        """The gateway is stopping: wake every held request to be answered, and hold no more."""
        self.closing = True
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            for held in queue:
                held.closing = True
                held.woken.set()
        # Released but not yet at their turn: answered too, not cut off when the server's
        # grace ends.
        going, self._going = self._going, set()
        for held in going:
            held.closing = True
            held.stopped.set()
