"""Waiting on conditions with a deadline instead of sleeping."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def eventually(
    check: Callable[[], T | Awaitable[T]], timeout: float = 5.0, interval: float = 0.05
) -> T:
    """Call `check` until it returns a truthy value or stops raising AssertionError.

    Returns that value; at the deadline raises the last AssertionError (or one
    saying the value stayed falsy) so the failure says what was not reached.
    """
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    value: T | None = None
    while True:
        try:
            result = check()
            value = await result if inspect.isawaitable(result) else result
            if value:
                return value
            last = None
        except AssertionError as exc:
            last = exc
        if time.monotonic() > deadline:
            if last is not None:
                raise last
            raise AssertionError(f"condition not met within {timeout}s (last value {value!r})")
        await anyio.sleep(interval)


async def passes(
    count: Callable[[], float | Awaitable[float]],
    k: int = 3,
    *,
    since: float | None = None,
    timeout: float = 60.0,
    interval: float = 0.05,
) -> float:
    """Wait until a component's pass counter has grown by `k`, then return it.

    How a test proves that nothing happened: a sleep proves only that time
    went by, and on a loaded machine the component may not have looked at
    all. A pass in progress when the count is first read may have started
    before the moment of interest, so `k` >= 2 leaves `k - 1` whole passes
    that started after it. `since` (a `time.monotonic()` instant: a deadline
    the component judges by, such as a node timeout) starts the count only
    once that instant is past, so the passes counted are ones that judged
    after the deadline.
    """

    async def read() -> float:
        result = count()
        return await result if inspect.isawaitable(result) else result

    if since is not None:
        await anyio.sleep(max(0.0, since - time.monotonic()))
    start = await read()

    async def done() -> float:
        n = await read()
        assert n >= start + k, f"{n - start:g} of {k} passes within {timeout}s (counted from {start:g})"
        return n

    return await eventually(done, timeout=timeout, interval=interval)
