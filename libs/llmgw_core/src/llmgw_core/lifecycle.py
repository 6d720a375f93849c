"""Starting a service whatever the bus is doing, stopping it on SIGTERM or Ctrl-C, and
ending it when NATS closed its connection for good."""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import anyio

from .bus import Bus, BusOptions
from .errors import BusError, ConnectionLost, StoreFull
from .retry import Retry

log = logging.getLogger("llmgw.lifecycle")


async def connect_service(options: BusOptions, service: str, *, ensure: bool = True) -> Bus:
    """Connect (and create llmgw's streams and buckets) for a long-running service.

    A service may start before NATS does (compose, a rebooted rack, a cluster
    still electing its leaders): while the failure is one that waiting can
    cure, it waits, with llmgw's backoff (`retry`), saying so when it starts
    waiting and when NATS answers. A refusal that waiting cannot cure (wrong
    credentials) is raised at once.
    """
    retry = Retry(log, f"{service}: connecting to NATS", base_s=0.5, cap_s=5.0, known=(BusError,))

    async def wait(exc: BusError) -> None:
        retry.failed(exc)
        await retry.wait()

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
    retry.succeeded()
    return bus


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Cancel `scope` at the first SIGTERM or SIGINT (run it as a task in that scope)."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            scope.cancel()
            return


@contextlib.asynccontextmanager
async def while_connected(bus: Bus) -> AsyncIterator[None]:
    """Run the body while `bus`'s connection lives. Once NATS closed it for good (`Bus.lost`),
    the body is cancelled and ConnectionLost raised, saying why: the service ends, and its
    supervisor (systemd, compose, `llmgw up`) starts it again with a new connection.

    Not a new connection in the process: a client closed for good has lost every
    subscription and consumer, and one that was not made again would leave a service up
    but deaf in part (a placement that answers no liveness request, a launcher that no
    longer hears its shards). A restart makes all of them again, by the path every start
    takes, and each service is built to be restarted (see docs/bus.md, Connections).
    """
    failed: Exception | None = None
    async with anyio.create_task_group() as tg:

        async def end_when_lost() -> None:
            await bus.lost.wait()
            tg.cancel_scope.cancel()

        tg.start_soon(end_when_lost)
        try:
            yield
        except Exception as exc:
            # Raised below, outside the task group: inside, it would come out wrapped in an
            # ExceptionGroup, and a service's main says an LlmgwError in one line.
            failed = exc
        tg.cancel_scope.cancel()
    if bus.lost.is_set():
        ends = f"{bus.service} ends here, for its supervisor to start it again"
        raise ConnectionLost(f"{bus.lost_cause}; {ends}") from failed
    if failed is not None:
        raise failed
