"""`Hearing`: what placement hears on core NATS, and whether it could hear it.

Every node's heartbeats (when each was last heard, its clock, who claims it) and every
gateway's demand, heard by every placement, leader or standby; and `state.heard_from`,
since when this placement could hear every heartbeat: reset by a reconnect and by a
stall of its own loop, so that no node is declared lost for a silence that was ours.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import anyio
import anyio.abc
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.events import Demand, Heartbeat
from llmgw_core.subjects import ONE

from .config import ServerConfig
from .demand import DemandBook, engine_demand
from .liveness import clock_turn
from .state import ClusterState

log = logging.getLogger("llmgw.placement")

# A control loop that waits longer than this past its deadline was stalled: the
# heartbeats it should have heard are still queued, so silence is not judged for it.
STALL_S = 0.5
# No stall for this long: placement has caught up.
CAUGHT_UP_S = 10.0


class Hearing:
    """Hears heartbeats and demand into `state` and `book`; judges whether placement is behind."""

    def __init__(
        self,
        config: ServerConfig,
        bus: Bus,
        state: ClusterState,
        book: DemandBook,
        identity: str,
        wake: Callable[[], None],
    ) -> None:
        self.config = config
        self.bus = bus
        self.state = state
        self.book = book
        self.identity = identity
        # Called when what the control loop acts on changed.
        self.wake = wake
        # Overload: whether this placement is behind now, and how often its loop stalled.
        self.behind = False
        self.stalls = 0
        self._last_stall = 0.0

    async def heartbeats(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        state = self.state

        async def seen(beat: Heartbeat, subject: str) -> None:
            # Only a time is recorded here, in the subscription's callback: no
            # queue to overflow, no log line per message. The node and the service
            # are the ones the subject names: nats-server lets each node's identity
            # publish only there, while the payload says whatever the sender wrote.
            _, _, node, service = subject.rsplit(".", 3)
            at = time.monotonic()
            if state.claims.beat(beat, node, service, at):
                # Two machines send this node's beats: said once per episode; `index` views
                # the node again, and nothing more is placed on it while it lasts.
                log.error(
                    "%s; nothing more is placed on it until one of them stops",
                    state.claims.claimed(node, at),
                )
                self.wake()
            if beat.standby:
                # An agent that waits while another instance works for the node runs
                # nothing: its beats say nothing about the node's engines.
                return
            wall = time.time()
            offset = beat.at - wall
            state.clock_offset[node] = offset
            was_off = node in state.clock_off
            off, crossed = clock_turn(
                offset, was_off, state.clock_crossed.get(node), at, 3 * self.config.heartbeat_interval_s
            )
            if crossed is None:
                state.clock_crossed.pop(node, None)
            else:
                state.clock_crossed[node] = crossed
            if off != was_off:
                # Said once when it starts and once when it ends: every time the node stamps
                # (its statuses, its probes) is off by this much.
                if was_off:
                    state.clock_off.discard(node)
                    log.warning("node %s: its clock agrees with placement's again (%+.1f s)", node, offset)
                else:
                    state.clock_off.add(node)
                    way = "ahead of" if offset > 0 else "behind"
                    log.warning(
                        "node %s: its clock is %.0f s %s placement's: the times it stamps are off by "
                        "as much (ages are computed from placement's clock); fix its time sync (NTP)",
                        node,
                        abs(offset),
                        way,
                    )
            if service == "installer":
                state.installer_seen[node] = at
                return
            if service == "launcher":
                state.with_installer.add(node)
            first = node not in state.last_seen
            state.last_seen[node] = at
            state.last_seen_wall[node] = wall
            missing = frozenset(beat.missing_models)
            if missing != state.missing_models.get(node, frozenset()):
                # The node lacks (or now has) a model file: its view changes, and a replica
                # that failed for want of it is placed elsewhere in the next step.
                state.missing_models[node] = missing
                state.dirty_nodes.add(node)
                first = True
            if first:
                self.wake()

        await self.bus.subscribe_core(self.bus.names.heartbeat_all, Heartbeat, seen, task_status=task_status)

    async def demand(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Hear every gateway's `Demand`. A report holding a request for a deployment wakes the
        control loop at once: a deployment at zero starts its first replica without waiting
        for the next step."""
        book, state = self.book, self.state

        async def heard(report: Demand, subject: str) -> None:
            # The gateway is the one the subject names, whatever the payload says.
            gateway = subject.rsplit(".", 1)[-1]
            if report.gateway != gateway:
                report = msgspec.structs.replace(report, gateway=gateway)
            at = time.monotonic()
            book.heard(report, at)
            book.sample(at, engine_demand(state.shard_status))
            if any(d.queued for d in report.deployments):
                self.wake()

        await self.bus.subscribe_core(self.bus.names.demand(ONE), Demand, heard, task_status=task_status)

    async def hearing(self) -> None:
        """Keep `state.heard_from`: since when this placement could hear every heartbeat.

        Reset by a reconnect (nothing was heard while away) and by a stall of
        this process's own loop (heartbeats queued unread); None while
        disconnected, so no node is declared lost for a silence that was ours.
        """
        tick = 0.1
        epoch = self.bus.reconnects
        expected = time.monotonic() + tick
        while True:
            await anyio.sleep(tick)
            at = time.monotonic()
            if not self.bus.connected:
                self.state.heard_from = None
            elif self.state.heard_from is None or self.bus.reconnects != epoch:
                epoch = self.bus.reconnects
                self.state.heard_from = at
                log.warning(
                    "%s: hearing the cluster again: every node gets a full node_timeout", self.identity
                )
            elif at - expected > STALL_S:
                self.state.heard_from = at
                self.stalls += 1
                if not self.behind:
                    log.warning(
                        "%s: placement is behind (its loop ran %.1f s late): every node gets a full "
                        "node_timeout until it catches up",
                        self.identity,
                        at - expected,
                    )
                self.behind = True
                self._last_stall = at
            elif self.behind and at - self._last_stall > CAUGHT_UP_S:
                self.behind = False
                log.warning("%s: placement caught up (%d stalls)", self.identity, self.stalls)
            expected = at + tick
