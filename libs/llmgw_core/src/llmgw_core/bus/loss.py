"""A NATS store lost under a running cluster: streams and buckets that this client knew and
that are gone (a disk lost, a server started on an emptied store, a stream deleted by hand).

Noticed where it shows: a watch opened again on a bucket whose stream was created anew
(`watch.py`), a bucket recreated on first use after it vanished (`streams.py`), or placement's
look at every stream (`Streams.rebuild`). Each notice is said once, recorded here for the
surfaces (placement's `/healthz` and `/api/store`), and handed to the holders' hooks
(`on_lost`, once a lost stream is back): a node agent writes again at once what it
reports (its node, its shards), instead of at its next recheck.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("llmgw.bus")

# Streams found gone within this long of a loss are the same loss (each bucket shows it alone).
SAME_LOSS_S = 60.0


@dataclass
class StoreLoss:
    """One loss: when it was noticed (Unix time), which streams were gone, which of them were
    seen made again, and when all of them were, with their configured limits (None until then)."""

    since: float
    streams: tuple[str, ...]
    rebuilt: float | None = None
    back: set[str] = field(default_factory=set)

    def words(self) -> str:
        """One line for every surface: what was lost, when, and what to do."""
        at = time.strftime("%H:%M:%S", time.localtime(self.since))
        gone = ", ".join(self.streams)
        if self.rebuilt is None:
            state = "not rebuilt yet: placement makes them again when it leads"
        else:
            rebuilt = time.strftime("%H:%M:%S", time.localtime(self.rebuilt))
            state = f"rebuilt at {rebuilt} with their configured limits"
        return (
            f"NATS store lost: {gone} gone at {at} (store emptied or replaced); {state}; what they held "
            "is gone: restore it with `llmgw ctl restore -f BACKUP` (docs/operations.md)"
        )


@dataclass
class Losses:
    """Every loss this client noticed: the last one, how many, and who wants to hear of one."""

    service: str
    last: StoreLoss | None = None
    total: int = 0
    on_lost: list[Callable[[], None]] = field(default_factory=list)

    def noticed(self, streams: list[str] | tuple[str, ...], *, back: bool = False) -> StoreLoss:
        """`streams` were gone; with `back`, they exist again now (made anew, empty or restored).
        Within a minute of the last loss it is the same loss seen from another bucket: its list
        grows, and it is said again only for streams new to it. Each hook is called whenever a
        stream is back: what a holder writes again then must find its bucket there."""
        now = time.time()
        last = self.last
        if last is not None and now - last.since < SAME_LOSS_S:
            fresh = [s for s in streams if s not in last.streams]
            last.streams = tuple(sorted({*last.streams, *streams}))
            if back:
                last.back.update(streams)
                # Rebuilt once every lost stream is back: a watch that found one bucket made
                # anew while placement was still making the others is not the end of it (a
                # bucket read then had no atomic batches yet).
                if last.rebuilt is None and last.back.issuperset(last.streams):
                    last.rebuilt = now
                    fresh = fresh or list(streams)
            elif fresh:
                last.rebuilt = None  # more is gone than was made again
        else:
            fresh = list(streams)
            last = StoreLoss(
                since=now,
                streams=tuple(sorted(streams)),
                rebuilt=now if back else None,
                back=set(streams) if back else set(),
            )
            self.last = last
            self.total += 1
        if fresh:
            log.error("%s: %s", self.service, last.words())
        if back:
            for hook in list(self.on_lost):
                try:
                    hook()
                except Exception as exc:  # a holder's hook costs its own notice, never the bus
                    log.warning("%s: after the NATS store was lost: %s", self.service, exc)
        return last
