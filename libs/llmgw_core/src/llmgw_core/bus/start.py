"""A service's start on the bus: the streams it uses exist before it uses them."""

from __future__ import annotations

import logging
import time

import anyio
import nats.errors
import nats.js.errors

from ..access import PermissionDenied
from ..errors import BusError
from ..retry import Backoff
from ..topology import node_streams
from .facade import Bus

log = logging.getLogger("llmgw.access")


async def require_streams(bus: Bus, streams: list[str], *, timeout: float | None = None) -> None:
    """Wait until every stream exists; fail with what is missing, or which permission is.

    Placement creates llmgw's streams and buckets (only it may), and waits for NATS as
    long as it takes. Node services started with it, or before it, wait for the streams
    as long (without a `timeout`, for ever): on a fresh 3-server cluster creating the
    replicated streams took over a minute, and agents that gave up at 30 s needed a
    restart. The wait is said once, and so is its end.
    """
    waiting: list[str] = []
    since: float | None = None
    with anyio.move_on_after(timeout):
        while True:
            waiting = []
            for stream in streams:
                try:
                    await bus.js.stream_info(stream)
                except nats.js.errors.NotFoundError:
                    waiting.append(stream)
                except PermissionDenied as exc:
                    raise BusError(f"{bus.service}: cannot check that {stream} exists: {exc}") from exc
                except nats.errors.Error as exc:
                    bus.raise_if_final(exc)
                    log.warning("%s: cannot check that %s exists yet: %s", bus.service, stream, exc)
                    waiting.append(stream)
            if not waiting:
                if since is not None:
                    log.warning(
                        "%s: the streams are there after %.0f s; starting",
                        bus.service,
                        time.monotonic() - since,
                    )
                return
            if since is None:
                since = time.monotonic()
                log.warning(
                    "%s: waiting for placement to create streams %s (it creates llmgw's streams and "
                    "buckets when it starts, with the same nats prefix %r)",
                    bus.service,
                    ", ".join(waiting),
                    bus.names.prefix,
                )
            await anyio.sleep(0.5)
    raise BusError(
        f"{bus.service}: {', '.join(waiting)} still missing after {timeout:g}s at "
        f"{bus.options.resolved_url()} (prefix {bus.names.prefix!r}); placement creates llmgw's streams and "
        "buckets when it starts: start it first, with the same nats prefix"
    )


async def prepare_node(bus: Bus, *, timeout: float | None = None) -> None:
    """A node service's start: create the streams on an unauthenticated bus (as before
    identities existed), otherwise wait for placement to have created them; either way
    for as long as it takes, or `timeout` seconds."""
    if bus.options.authenticated():
        await require_streams(bus, node_streams(bus.names), timeout=timeout)
        return
    started = time.monotonic()
    waits = Backoff(0.5, 5.0)
    told = False
    while True:
        try:
            await bus.ensure()
            break
        except BusError as exc:
            # A cluster still electing its stream leaders, or short of space: waiting can cure it.
            delay = waits.next()
            if not exc.retryable or (timeout is not None and time.monotonic() - started + delay > timeout):
                raise
            if not told:
                log.warning("%s: %s; waiting for NATS", bus.service, exc)
                told = True
        await anyio.sleep(delay)
    if told:
        waited = time.monotonic() - started
        log.warning("%s: the streams are there after %.0f s; starting", bus.service, waited)
