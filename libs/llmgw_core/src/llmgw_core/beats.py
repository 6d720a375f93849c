"""`HeartbeatBus`: what claiming a node (`claims.hold`) asks of the bus.

A protocol in a leaf module, so that `claims`, which the bus's publisher imports for its
default beat, need not import the bus back: the bus satisfies it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
import anyio.abc
import msgspec

from .events import Heartbeat
from .subjects import Names

T = TypeVar("T", bound=msgspec.Struct)


class HeartbeatBus(Protocol):
    """Beat on a node's subject, and hear the beats on it."""

    @property
    def names(self) -> Names: ...

    async def subscribe_core(
        self,
        subject: str,
        kind: type[T],
        handler: Callable[[T, str], Awaitable[None]],
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None: ...

    async def heartbeat(
        self, node: str, service: str, interval: float, beat: Callable[[], Heartbeat] | None = None
    ) -> None: ...
