"""Trying again: the one backoff every retrying loop in llmgw uses, and how an outage is logged.

    Backoff   the wait before each next attempt: exponential, jittered, capped; reset on success
    Outage    one log line when failures start (with the cause), one when they end
              (how long, how many attempts), and none for each attempt in between
    Retry     the two together, for a loop that runs an attempt until it works

Why jitter: services that lost NATS together (a restart, a leader election) retry
together. Without jitter each of them waits exactly 0.5 s, 1 s, 2 s, ..., and the
whole fleet reconnects in the same instant, again and again, the moment NATS is
least able to take it.

Why this jitter: after the n-th failure in a row the wait is drawn uniformly between
the base and the exponential ceiling, min(cap, base x 2^n). That is full jitter (drawn
between 0 and the ceiling) with the base as its floor:

- the floor: a configured `restart_backoff_s` or `install_backoff_s` stays the
  shortest pause an operator will see, and a failure that repeats at once (an
  engine that crashes on start) is never retried after a few milliseconds, which
  plain full jitter allows on any attempt;
- the ceiling: it doubles with each failure, so the mean wait, (base + ceiling) / 2,
  is about what the unjittered loops waited (base x 2^(n-1)) and reaches the cap
  after about as many failures (six from 1 s to 60 s); and the wait depends only
  on the count of failures: a loop that keeps that count anyway (a shard's
  restarts, kept across a launcher restart; the installer's failed passes) needs
  no other state;
- not decorrelated jitter (each wait between the base and three times the last):
  its waits are a random walk that may fall back to the base at any step, and grow
  more slowly: from a 1 s base, the median wait after six failures in a row is about
  10 s (the old loops waited 32 s) and the 60 s cap comes after a median of twelve
  failures, not six; and each wait needs the last as state.

The very first wait is drawn too (between the base and twice it): that is the retry
that a fleet failing at the same moment would otherwise make in step. (`llmgw up`'s
supervisor takes the ceiling alone, unjittered: see `llmgw.supervise`.)

Why our own module rather than `tenacity` or `stamina`: both wrap a callable and
retry it until it returns, and log (or instrument) each attempt. llmgw's retrying
loops are mostly not of that shape: a watch that runs for days and is retried when
it breaks, an engine restarted from a supervising loop that reports each attempt,
a status outbox that schedules a later write, a control loop that must re-raise a
lost lease. What they share is the delay and the outage log, about a hundred lines that
neither library offers (an outage-start line and an outage-end line with its
length and attempts); a dependency would bring its own decorators and per-attempt
hooks, and still leave that part to write.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable

import anyio

__all__ = ["CALL_RETRY", "Backoff", "Outage", "Retry"]


class Backoff:
    """Waits that grow from `base_s` to at most `cap_s`, jittered: after the n-th failure in
    a row, drawn uniformly between the base and min(cap, base x 2^n) (see the module)."""

    def __init__(self, base_s: float, cap_s: float, *, rng: random.Random | None = None) -> None:
        if not 0 < base_s <= cap_s:
            raise ValueError(f"backoff of {base_s:g} s to {cap_s:g} s: need 0 < base <= cap")
        self.base_s = base_s
        self.cap_s = cap_s
        self._rng = rng or random.Random()
        # Failures in a row since the last reset.
        self.failures = 0

    def ceiling(self, failures: int) -> float:
        """The longest wait after `failures` failures in a row (1, 2, ...)."""
        return min(self.cap_s, self.base_s * 2.0 ** min(max(failures, 0), 64))

    def wait(self, failures: int) -> float:
        """A wait after `failures` failures in a row, drawn: base_s <= wait <= ceiling(failures)."""
        return self._rng.uniform(self.base_s, self.ceiling(failures))

    def next(self) -> float:
        """Count one more failure; the wait before the next attempt."""
        self.failures += 1
        return self.wait(self.failures)

    def reset(self) -> None:
        """After a success: the next failure waits about the base again."""
        self.failures = 0


class Outage:
    """A run of failures of one thing, said twice: when it starts and when it ends.

    `what` names the thing for an operator (`node-a: watching this node's shard
    statuses`). A failure whose type is in `known` (a NATS error: its message says
    it all) is logged with its message; any other (a bug) with its traceback, once.
    The attempts in between are logged at debug level only: a NATS outage of an
    hour otherwise writes a thousand lines that say nothing new.
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        known: tuple[type[BaseException], ...] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.known = known
        self.clock = clock
        self.since: float | None = None
        self.failures = 0

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, cause: BaseException | str) -> None:
        """One attempt failed; the first of a run is logged, with its cause."""
        self.failures += 1
        if self.since is not None:
            self.log.debug("%s failed again (%d in a row): %s", self.what, self.failures, _said(cause))
            return
        self.since = self.clock()
        if isinstance(cause, BaseException) and not isinstance(cause, self.known):
            self.log.error("%s failed, retrying with backoff: %s", self.what, _said(cause), exc_info=cause)
        else:
            self.log.warning("%s failed, retrying with backoff: %s", self.what, _said(cause))

    def recovered(self) -> None:
        """An attempt worked; if failures came before it, say for how long and how many."""
        if self.since is not None:
            lasted = self.clock() - self.since
            attempts = "attempt" if self.failures == 1 else "attempts"
            self.log.warning(
                "%s works again after %.1f s and %d failed %s", self.what, lasted, self.failures, attempts
            )
        self.since = None
        self.failures = 0


class Retry:
    """A Backoff and an Outage for one loop: `failed` logs (once) and gives the wait,
    `succeeded` ends the outage and resets the wait.

        retry = Retry(log, "following deployments", base_s=0.5, cap_s=10.0, known=(BusError,))
        while True:
            try:
                async for change in watch():
                    retry.succeeded()
                    ...
            except Exception as exc:
                retry.failed(exc)
            await retry.wait()
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        base_s: float,
        cap_s: float,
        known: tuple[type[BaseException], ...] = (),
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff = Backoff(base_s, cap_s, rng=rng)
        self.outage = Outage(log, what, known=known, clock=clock)
        # The wait before the next attempt: 0 after a success.
        self.delay = 0.0

    def failed(self, cause: BaseException | str) -> float:
        self.outage.failed(cause)
        self.delay = self.backoff.next()
        return self.delay

    def succeeded(self) -> None:
        self.outage.recovered()
        self.backoff.reset()
        self.delay = 0.0

    async def wait(self) -> None:
        await anyio.sleep(self.delay)

    async def attempt(
        self, call: Callable[[], Awaitable[object]], *, fatal: tuple[type[BaseException], ...] = ()
    ) -> bool:
        """Run `call` once: True if it returned; False if it raised (logged as above, and
        `delay` says how long to wait). Cancellation and the `fatal` types propagate."""
        try:
            await call()
        except fatal:
            raise
        except Exception as exc:
            self.failed(exc)
            return False
        self.succeeded()
        return True


def _said(cause: BaseException | str) -> str:
    if isinstance(cause, str):
        return cause
    return str(cause) or type(cause).__name__


# The waits of one call tried again at once, a few times, inside the bus client (a write
# NATS timed out or answered 503 while a stream leader was being elected): short, and
# jittered so that a cluster's clients do not all try again in step.
CALL_RETRY = Backoff(0.2, 0.8)
