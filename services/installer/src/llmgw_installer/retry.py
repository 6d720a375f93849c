"""Trying a network step again when retrying can help: a few attempts, with llmgw's backoff
(`llmgw_core.retry`: jittered, from `backoff_s` to at most `cap_s`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

from llmgw_core.retry import Backoff

from .errors import InstallError

T = TypeVar("T")

OnRetry = Callable[[int, InstallError], Awaitable[None]]


async def retrying(
    op: Callable[[], Awaitable[T]],
    *,
    attempts: int = 3,
    backoff_s: float = 1.0,
    cap_s: float = 30.0,
    on_retry: OnRetry | None = None,
) -> T:
    """`op()`, again after a retryable InstallError; the last one says how many attempts were made.
    Each retry is told to `on_retry` (the install's progress), not logged on its own."""
    waits = Backoff(backoff_s, cap_s)
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
            await anyio.sleep(waits.next())
    raise AssertionError("unreachable")
