"""Stopping a service on SIGTERM or Ctrl-C."""

from __future__ import annotations

import signal

import anyio


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Cancel `scope` at the first SIGTERM or SIGINT (run it as a task in that scope)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return
