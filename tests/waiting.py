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
