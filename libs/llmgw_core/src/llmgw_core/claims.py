"""One node id, one machine: who sends a node's heartbeats, and whether two machines claim it.

Every heartbeat says who sent it (a `Claimant`: host name, boot id, pid, a random
instance id, when it started). `Claims` is the pure record of what was heard: a
node is claimed twice while two instances of one of its services both beat and
their beats interleave. A restart is no double claim: the old instance's beats
stop before the new one's start, and it never beats again.

An agent (installer, launcher) also listens to its own node's beats of its own
service before it starts working (`hold`): while another instance that works
beats, it stands by (beats marked `standby`, runs nothing, says why) and takes
over once the other has been silent for `TAKEOVER_BEATS` heartbeats. Two
machines given one node id then never both run its shards or both write its
status; a replacement machine, whose predecessor is gone, starts at once.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from .errors import BusError
from .events import Heartbeat, now

if TYPE_CHECKING:
    from .beats import HeartbeatBus

log = logging.getLogger("llmgw.claims")

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# An agent listens this many heartbeat intervals for another instance before it works.
SETTLE_BEATS = 1.5
# A standby takes over once the working instance has been silent this many intervals.
TAKEOVER_BEATS = 5.0


def _boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Claimant:
    """Who sends a service's heartbeats: one per running service."""

    host: str
    boot_id: str
    pid: int
    instance: str
    started_at: float

    @classmethod
    def here(cls) -> Claimant:
        return cls(
            host=socket.gethostname(),
            boot_id=_boot_id(),
            pid=os.getpid(),
            instance=uuid.uuid4().hex[:12],
            started_at=now(),
        )

    def beat(
        self, node: str, service: str, *, standby: bool = False, missing_models: tuple[str, ...] = ()
    ) -> Heartbeat:
        return Heartbeat(
            node=node,
            service=service,
            at=now(),
            host=self.host,
            boot_id=self.boot_id,
            pid=self.pid,
            instance=self.instance,
            started_at=self.started_at,
            standby=standby,
            missing_models=missing_models,
        )


def machine(beat: Heartbeat) -> str:
    """`host-a (boot 1a2b3c4d)`: the machine a beat came from."""
    boot = f" (boot {beat.boot_id[:8]})" if beat.boot_id else ""
    return f"{beat.host or 'unknown host'}{boot}"


def describe(node: str, beats: list[Heartbeat]) -> str:
    """`n1 is claimed by two machines: host-a (boot 1a2b3c4d) with launcher pid 100, and
    host-b (boot 5e6f7a8b) with launcher pid 200 (standing by)`, from the last beat of every
    instance heard (two or more), the machine that started first first."""
    by_machine: dict[tuple[str, str], list[Heartbeat]] = {}
    for b in sorted(beats, key=lambda b: (b.started_at, b.service, b.instance)):
        by_machine.setdefault((b.host, b.boot_id), []).append(b)

    def who(some: list[Heartbeat]) -> str:
        return ", ".join(f"{b.service} pid {b.pid}{' (standing by)' if b.standby else ''}" for b in some)

    if len(by_machine) > 1:
        count = "two" if len(by_machine) == 2 else str(len(by_machine))
        parts = [f"{machine(some[0])} with {who(some)}" for some in by_machine.values()]
        return f"{node} is claimed by {count} machines: {', and '.join(parts)}"
    ((some),) = by_machine.values()
    return f"{node} is claimed twice on one machine, {machine(some[0])}, with {who(some)}"


@dataclass
class _Heard:
    beat: Heartbeat
    seen: float


@dataclass
class Claims:
    """The instances heard per node and service, and the nodes claimed twice (pure: times are
    given, on the caller's monotonic clock). An instance silent for `window` is forgotten."""

    window: float
    # Node -> service -> instance -> its last beat.
    _heard: dict[str, dict[str, dict[str, _Heard]]] = field(default_factory=dict)
    _latest: dict[tuple[str, str], str] = field(default_factory=dict)
    # Node -> when two instances last proved it claimed twice.
    _contested: dict[str, float] = field(default_factory=dict)

    def beat(self, beat: Heartbeat, node: str, service: str, at: float) -> bool:
        """Take a beat of `service` on `node` (the subject's, not the payload's); True if it
        proves the node claimed twice when it was not a moment ago."""
        if not beat.instance:
            return False  # an agent that does not say who it is
        key = (node, service)
        heard = self._heard.setdefault(node, {}).setdefault(service, {})
        for instance in [i for i, h in heard.items() if at - h.seen > self.window]:
            del heard[instance]
        latest = self._latest.get(key)
        # An instance heard again after another one was: two senders, not a restart.
        proved = latest is not None and latest != beat.instance and beat.instance in heard
        heard[beat.instance] = _Heard(beat, at)
        self._latest[key] = beat.instance
        if not proved:
            return False
        was = self.claimed(node, at) is not None
        self._contested[node] = at
        return not was

    def claimed(self, node: str, at: float) -> str | None:
        """Why the node is claimed twice, while it is (a sender that stopped is forgotten after
        `window`), else None."""
        since = self._contested.get(node)
        if since is None or at - since > self.window:
            return None
        claimants: list[Heartbeat] = []
        for heard in self._heard.get(node, {}).values():
            live = [h.beat for h in heard.values() if at - h.seen <= self.window]
            if len(live) > 1:
                claimants += live
        return describe(node, claimants) if claimants else None

    def contested(self, at: float) -> list[str]:
        """The nodes claimed twice now, sorted; an episode that ended is forgotten here."""
        for node in [n for n, since in self._contested.items() if at - since > self.window]:
            del self._contested[node]
        return sorted(n for n in self._contested if self.claimed(n, at) is not None)


class Holder:
    """An agent's side: its own beats, and the other instances of its node and service it hears."""

    def __init__(self, node: str, service: str, interval: float, claimant: Claimant | None = None) -> None:
        self.node = node
        self.service = service
        self.interval = interval
        self.me = claimant or Claimant.here()
        self.standby = True
        # What this service's beats say about the node beyond who sends them (see Heartbeat).
        self.missing_models: tuple[str, ...] = ()
        # Other instances: instance -> (their last beat, when heard, monotonic).
        self.others: dict[str, tuple[Heartbeat, float]] = {}
        self._told: str | None = None

    def heard(self, beat: Heartbeat, at: float) -> None:
        if beat.instance and beat.instance != self.me.instance:
            self.others[beat.instance] = (beat, at)

    def working_others(self, at: float) -> list[Heartbeat]:
        """Other instances that work (not standing by), heard within the takeover time."""
        window = TAKEOVER_BEATS * self.interval
        for instance in [i for i, (_, seen) in self.others.items() if at - seen > window]:
            del self.others[instance]
        return sorted(
            (b for b, _ in self.others.values() if not b.standby), key=lambda b: (b.started_at, b.instance)
        )

    def must_wait(self, at: float) -> str | None:
        """Why this instance stands by now (another one works for the node), else None."""
        others = self.working_others(at)
        if not others:
            return None
        return (
            f"{describe(self.node, [*others, self.me.beat(self.node, self.service, standby=True)])}; "
            f"this {self.service} stands by and runs nothing until the other has been silent for "
            f"{TAKEOVER_BEATS * self.interval:g} s: stop one of them, or give this machine a node id "
            "of its own"
        )

    def clash(self, at: float) -> str | None:
        """While working: why another working instance is a problem, once per episode."""
        others = self.working_others(at)
        if not others:
            self._told = None
            return None
        text = describe(self.node, [self.me.beat(self.node, self.service), *others])
        if text == self._told:
            return None
        self._told = text
        return text


async def hold(
    bus: HeartbeatBus,
    node: str,
    service: str,
    interval: float,
    *,
    claimant: Claimant | None = None,
    task_status: anyio.abc.TaskStatus[Holder] = anyio.TASK_STATUS_IGNORED,
) -> None:
    """Beat for `service` on `node` until cancelled; `task_status.started(holder)` once this
    instance may work: no other instance of it works for the node (heard for `SETTLE_BEATS`
    intervals, and then for as long as one does). Never raises: a beat that fails is logged,
    and a subscription the server refuses (an auth.conf older than this rule) means working
    at once, as before."""
    holder = Holder(node, service, interval, claimant)
    subject = bus.names.heartbeat(node, service)

    async def on_beat(beat: Heartbeat, subject: str) -> None:
        holder.heard(beat, time.monotonic())

    async with anyio.create_task_group() as tg:
        hearing = True
        try:  # a beat that does not decode goes to the DLQ (Bus.subscribe_core)
            await tg.start(bus.subscribe_core, subject, Heartbeat, on_beat)
        except BusError as exc:
            hearing = False
            log.warning(
                "%s %s: cannot hear its node's other agents (%s); working at once", node, service, exc
            )

        def beat() -> Heartbeat:
            return holder.me.beat(node, service, standby=holder.standby, missing_models=holder.missing_models)

        tg.start_soon(bus.heartbeat, node, service, interval, beat)
        if hearing:
            await anyio.sleep(SETTLE_BEATS * interval)
            told = False
            while (why := holder.must_wait(time.monotonic())) is not None:
                if not told:
                    log.error("%s", why)
                    told = True
                await anyio.sleep(interval)
            if told:
                log.warning("%s %s: the other instance is silent; taking over", node, service)
        holder.standby = False
        task_status.started(holder)
        while True:
            await anyio.sleep(interval)
            clash = holder.clash(time.monotonic())
            if clash is not None:
                log.error("%s; placement places nothing more on it until one of them stops", clash)
