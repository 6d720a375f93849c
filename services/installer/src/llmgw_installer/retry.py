"""Trying a network step again when retrying can help: a few attempts, capped exponential backoff."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from .errors import InstallError

T = TypeVar("T")

OnRetry = Callable[[int, InstallError], Awaitable[None]]


def backoff(attempt: int, base_s: float, cap_s: float) -> float:
    """The wait after failed attempt `attempt` (1, 2, ...): base, 2x base, 4x base, ... at most cap."""
    return float(min(cap_s, base_s * 2.0 ** (attempt - 1)))


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    attempts: int = 3,
    backoff_s: float = 1.0,
    cap_s: float = 30.0,
    on_retry: OnRetry | None = None,
) -> T:
    """`op()`, again after a retryable InstallError; the last one says how many attempts were made."""
    for attempt in range(1, attempts + 1):
        try:
            return await op()
        except InstallError as exc:
            if not exc.retryable:
                raise
            if attempt == attempts:
                raise type(exc)(f"{exc} (gave up after {attempts} attempts)", retryable=True) from exc
            if on_retry is not None:
                await on_retry(attempt, exc)
            await anyio.sleep(backoff(attempt, backoff_s, cap_s))
    raise AssertionError("unreachable")
