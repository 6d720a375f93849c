"""What the status bucket says of this node's shards, against what this launcher runs: a pure diff.

A shard's status is written by whoever ran it last: a second machine given this
node's id, or a launcher that ran here before. `ready` at a port no engine of
this node holds stays so while this launcher's own runner does not change state,
and placement and the gateway believe it. So the launcher compares, every few
seconds: a stored status that is not the one its runner last published is
written again, and a stored status of a shard it does not run is removed. A
difference counts only when two audits in a row find the same stored value, so
a status still on its way to the bucket is not written twice.

`audit` decides, over plain data; `StatusAudit` is the launcher's member that
follows the bucket, runs it every few heartbeats and queues what it confirms.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import anyio
import msgspec

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.events import ShardStatus, now
from llmgw_core.retry import Retry
from llmgw_core.subjects import ONE

from .outbox import StatusOutbox

log = logging.getLogger("llmgw.launcher")

# This node's shard statuses are checked against what runs every this many heartbeat
# intervals (at least a second apart).
AUDIT_BEATS = 3
# The pause before watching the status bucket again after a failure, growing to the cap.
WATCH_RETRY_FIRST_S = 1.0
WATCH_RETRY_CAP_S = 30.0


@dataclass(frozen=True)
class Corrections:
    # Keys whose runner's own last status is to be written again.
    rewrite: tuple[str, ...] = ()
    # Keys of shards this launcher does not run: their stored statuses go.
    remove: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.rewrite or self.remove)


Suspects = dict[str, ShardStatus | None]


def audit(
    stored: Mapping[str, ShardStatus],
    mine: Mapping[str, ShardStatus | None],
    suspects: Mapping[str, ShardStatus | None],
) -> tuple[Corrections, Suspects]:
    """What to correct now, and what the next audit checks again.

    `stored`: the bucket's statuses of this node's shards; `mine`: each shard this
    launcher runs, with the status its runner last published (None before its
    first, as while an adopted engine is checked); `suspects`: what the last audit
    found wrong, by the stored value it found.
    """
    wrong: Suspects = {}
    for key in sorted(set(stored) | {k for k, s in mine.items() if s is not None}):
        have = stored.get(key)
        if key in mine:
            want = mine[key]
            if want is None or have == want:
                continue
        wrong[key] = have
    confirmed = [k for k, have in wrong.items() if k in suspects and suspects[k] == have]
    fix = Corrections(
        rewrite=tuple(k for k in confirmed if k in mine),
        remove=tuple(k for k in confirmed if k not in mine),
    )
    return fix, {k: v for k, v in wrong.items() if k not in confirmed}


class StatusAudit:
    """The status bucket's statuses of this node's shards against what this launcher runs.

    `mine()` is each shard the launcher runs (or is stopping: None) with the status its
    runner last published; corrections go out through the node's outbox."""

    def __init__(
        self,
        bus: Bus,
        node: str,
        outbox: StatusOutbox,
        mine: Callable[[], dict[str, ShardStatus | None]],
        heartbeat_interval_s: float,
    ) -> None:
        self.bus = bus
        self.node = node
        self.outbox = outbox
        self.mine = mine
        self.interval_s = max(1.0, AUDIT_BEATS * heartbeat_interval_s)
        # The status bucket's statuses of this node's shards, as its watch last said.
        self.stored: dict[str, ShardStatus] = {}
        # Statuses this launcher wrote again, or removed, because they were not what it runs.
        self.corrected = 0

    async def run(self) -> None:
        """Every few heartbeats: write again each status the bucket holds that this launcher's
        runner did not last publish, and remove those of shards it does not run (see `audit`)."""
        suspects: Suspects = {}
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow)
            while True:
                await anyio.sleep(self.interval_s)
                try:
                    suspects = self.correct(suspects)
                except Exception:  # a fault costs this pass, never the launcher
                    log.exception("%s: checking the shard statuses failed; trying again", self.node)
                    suspects = {}

    async def _follow(self) -> None:
        """Keep `stored` as the status bucket says, for this node's keys; a failure to watch
        (an auth.conf older than this rule refuses it) is said and retried with backoff."""
        retry = Retry(
            log,
            f"{self.node}: reading back this node's shard statuses",
            base_s=WATCH_RETRY_FIRST_S,
            cap_s=WATCH_RETRY_CAP_S,
            known=(BusError,),
        )
        names = self.bus.names
        while True:
            try:
                async for change in self.bus.watch(
                    names.shard_status_bucket, ShardStatus, names.shard_key(self.node, ONE)
                ):
                    retry.succeeded()
                    if change.value is None:
                        self.stored.pop(change.key, None)
                    else:
                        self.stored[change.key] = change.value
            except BusError as exc:
                retry.failed(
                    f"{exc}; statuses another machine wrote are not corrected until it can "
                    "(`llmgw auth init` writes the rule)"
                )
            except Exception as exc:  # a fault costs this watch, never the launcher
                retry.failed(exc)
            # A watch that ended on its own (it is not meant to) is started again after a pause.
            await anyio.sleep(retry.delay or WATCH_RETRY_FIRST_S)

    def correct(self, suspects: Suspects) -> Suspects:
        """One audit: queue the corrections it confirms; returns what the next one checks again."""
        mine = self.mine()
        fix, suspects = audit(self.stored, mine, suspects)
        for key in fix.rewrite:
            status = mine[key]
            assert status is not None
            had = self.stored.get(key)
            log.warning(
                "shard %s: the status bucket says %s; writing what this launcher runs: %s%s",
                key,
                said(had),
                status.state,
                f" at port {status.port}" if status.port else "",
            )
            self.outbox.push(status)
        for key in fix.remove:
            had = self.stored[key]
            log.warning(
                "shard %s: the status bucket says %s, but this launcher does not run it; removing it",
                key,
                said(had),
            )
            self.outbox.push(
                msgspec.structs.replace(
                    had,
                    state="stopped",
                    reason=f"not run by the launcher of {self.node}",
                    pids=(),
                    url="",
                    at=now(),
                )
            )
        self.corrected += len(fix.rewrite) + len(fix.remove)
        return suspects


def said(status: ShardStatus | None) -> str:
    """A stored status in a few words: `ready at port 8001 (pids 12, 13)`."""
    if status is None:
        return "nothing"
    port = f" at port {status.port}" if status.port else ""
    pids = f" (pids {', '.join(map(str, status.pids))})" if status.pids else ""
    return f"{status.state}{port}{pids}"
