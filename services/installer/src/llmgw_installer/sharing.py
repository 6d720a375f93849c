"""This node's part in engine wheels shared between nodes (`wheels.Share`): the locks it claims
while it fetches them, the ones it holds, its wheel server, and the other nodes' statuses.

What it holds and claims goes out in the node's status (`NodeStatus.wheels`), which the
installer writes as before; this only says what to put there and when to write it again.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.abc

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import WHEELS_MAX, NodeStatus, WheelsHeld, now

from .wheels import held_locks
from .wheelserver import serve

log = logging.getLogger("llmgw.installer.wheels")


class WheelShare:
    def __init__(
        self, node: str, bus: Bus, wheel_root: Path, report: Callable[[], Awaitable[object]]
    ) -> None:
        self.node = node
        self.bus = bus
        self.wheel_root = wheel_root
        # Writes the node's status (the installer's own); raises BusError.
        self.report = report
        # The wheel server's base URL while it runs ("" otherwise: nothing is offered).
        self.url = ""
        # The locks this node fetches now, each with when it began: who claimed first fetches.
        self.claims: dict[str, float] = {}

    def held(self) -> tuple[WheelsHeld, ...]:
        """What the node's status says of engine wheels: the locks it fetches now, then those it
        holds and serves (newest first; none while its wheel server does not run)."""
        claims = [WheelsHeld(lock=d, state="fetching", since=t) for d, t in sorted(self.claims.items())]
        held = [
            WheelsHeld(lock=d, state="held", url=f"{self.url}{d}/")
            for d in (held_locks(self.wheel_root) if self.url else [])
            if d not in self.claims
        ]
        return tuple([*claims, *held][:WHEELS_MAX])

    async def claim(self, digest: str) -> float:
        self.claims[digest] = since = now()
        await self.report()
        return since

    async def release(self, digest: str) -> None:
        if self.claims.pop(digest, None) is not None:
            await self._report_quietly()

    async def others(self) -> dict[str, NodeStatus]:
        found = await self.bus.entries(self.bus.names.nodes_bucket, NodeStatus)
        return {k: c.value for k, c in found.items() if c.value is not None and k != self.node}

    async def serve(
        self,
        host: str,
        lock: anyio.Lock,
        *,
        task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The wheel server on `host` (any free port) until cancelled; the status says where (written
        under `lock`, the installer's own) and, once it stops, that nothing is served."""
        self.wheel_root.mkdir(parents=True, exist_ok=True)

        async def run(*, task_status: anyio.abc.TaskStatus[int]) -> None:
            await serve(self.wheel_root, host, task_status=task_status)

        try:
            async with anyio.create_task_group() as tg:
                port = await tg.start(run)
                shown = f"[{host}]" if ":" in host else host
                self.url = f"http://{shown}:{port}/wheels/"
                # Where it serves now: a status from before named a port no longer served.
                async with lock:
                    await self._report_quietly()
                task_status.started(port)
        finally:
            # No longer served: peers are told, so that none tries a closed port first.
            self.url = ""
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                await self._report_quietly()

    async def _report_quietly(self) -> None:
        try:
            await self.report()
        except BusError as exc:  # the next pass says it
            log.warning("could not report the wheels this node holds: %s", exc)
