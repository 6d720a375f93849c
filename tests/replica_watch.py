"""Which replicas of a deployment are ready, followed from its replica events: for tests
that assert a change (a roll, a drain) never left it with none ready."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from llmgw_core.bus import Bus
from llmgw_core.events import ReplicaStatus, decoder
from llmgw_core.subjects import ONE


class ReadyReplicas:
    def __init__(self) -> None:
        self.ready: set[str] = set()
        # While `watching`: the number ready after each replica event.
        self.counts: list[int] = []
        self.watching = False

    async def on_event(self, msg: object) -> None:
        status = decoder(ReplicaStatus).decode(msg.data)  # type: ignore[attr-defined]
        if status.state == "ready":
            self.ready.add(status.replica)
        else:
            self.ready.discard(status.replica)
        if self.watching:
            self.counts.append(len(self.ready))


@contextlib.asynccontextmanager
async def ready_replicas_of(bus: Bus, deployment: str) -> AsyncIterator[ReadyReplicas]:
    watch = ReadyReplicas()
    sub = await bus.nc.subscribe(bus.names.replica_event(deployment, ONE), cb=watch.on_event)
    try:
        yield watch
    finally:
        await sub.unsubscribe()
