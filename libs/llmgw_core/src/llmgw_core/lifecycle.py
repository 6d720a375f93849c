"""Starting a service whatever the bus is doing, and stopping it on SIGTERM or Ctrl-C."""

from __future__ import annotations

import logging
import signal

import anyio

from .bus import Bus, BusOptions
from .errors import BusError, StoreFull

log = logging.getLogger("llmgw.lifecycle")


async def connect_service(options: BusOptions, service: str, *, ensure: bool = True) -> Bus:
    """Connect (and create llmgw's streams and buckets) for a long-running service.

    A service may start before NATS does (compose, a rebooted rack, a cluster
    still electing its leaders): while the failure is one that waiting can
    cure, it waits, with capped backoff, saying so once. A refusal that waiting
    cannot cure (wrong credentials) is raised at once.
    """
    delay = 0.5
    told = False

    async def wait(exc: BusError) -> None:
        nonlocal delay, told
        if not told:
            log.warning("%s: %s; waiting for NATS", service, exc)
            told = True
        await anyio.sleep(delay)
        delay = min(5.0, delay * 2)

    while True:
        try:
            bus = await Bus.connect(options, service=service)
        except BusError as exc:
            if not exc.retryable:
                raise
            await wait(exc)
            continue
        if not ensure:
            break
        try:
            while True:
                try:
                    await bus.ensure()
                    break
                except StoreFull as exc:
                    # Tried again on this connection, whose store watch says the episode once.
                    await wait(exc)
        except BusError as exc:
            await bus.close()
            await wait(exc)
            continue
        break
    if told:
        log.warning("%s: NATS is up", service)
    return bus


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Cancel `scope` at the first SIGTERM or SIGINT (run it as a task in that scope)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return
