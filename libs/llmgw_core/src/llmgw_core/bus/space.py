"""Writes that NATS refused for space: each such failure as StoreFull, and the episode
(from the first refused write to the first that lands again) said once at each end.
What counts as a refusal for space is `store.space_refusal`."""

from __future__ import annotations

import contextlib
import logging
import time

import anyio
import nats.errors
import nats.js.errors

from ..errors import StoreFull
from ..store import Episode, Refusal, StoreWatch, clock, space_refusal, unacknowledged
from .connection import Connection

log = logging.getLogger("llmgw.bus")


class Space:
    """Whether writes are refused for space now (`store`), said once at each end."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.store = StoreWatch()
        # Each stream's byte limit as the server holds it, asked once (see `space`).
        self._byte_limits: dict[str, int] = {}

    def created(self, stream: str) -> None:
        """`stream` exists with its limits: a refusal to create it (its limit did not fit) is over."""
        if self.store.episode is not None:
            self.said_stored(self.store.stored(stream, written=False))

    def note_write(self, stream: str) -> None:
        """A write to `stream` landed: an episode of writes refused for space may be over (said
        once). Cheap while nothing is refused."""
        if self.store.episode is not None:
            self.said_stored(self.store.stored(stream))

    async def refusal(
        self, stream: str, what: str, exc: BaseException, *, unanswered: bool = False
    ) -> StoreFull | None:
        """The StoreFull that a failed write to `stream` is, if NATS refused it for space (the
        episode's start is said once); with `unanswered`, for a write that timed out at every
        try, also when nats-server answers everything but the write. None for any other fault."""
        if isinstance(exc, nats.js.errors.APIError):
            # nats-py's KeyWrongLastSequenceError is an APIError made without an err_code.
            found = await self.space(stream, getattr(exc, "err_code", None), exc.description or "")
        else:
            found = await self.space(stream, None, str(exc))
        if found is not None:
            return self.refused(stream, found, what)
        return await self._unanswered(stream, what, exc) if unanswered else None

    async def space(self, stream: str, err_code: int | None, description: str) -> Refusal | None:
        refusal = space_refusal(err_code, description, stream=stream)
        if refusal is None or "maximum bytes" not in description.lower():
            return refusal
        # The bucket's own limit, as the server holds it (this client's configuration may differ).
        limit = self._byte_limits.get(stream)
        if limit is None:
            limit = 0
            with anyio.move_on_after(2), contextlib.suppress(nats.errors.Error, OSError):
                limit = (await self.conn.js.stream_info(stream)).config.max_bytes or 0
            self._byte_limits[stream] = limit
        return space_refusal(err_code, description, stream=stream, limit=limit)

    def refused(self, stream: str, refusal: Refusal, what: str) -> StoreFull:
        started = self.store.episode is None
        if self.store.refused(stream, refusal, time.time()):
            # A warning, as an outage of NATS is: the service goes on, and says when it stores again.
            if started:
                log.warning(
                    "%s: %s; free space in NATS's store or raise the limit (docs/operations.md)",
                    self.conn.service,
                    self.store.banner(),
                )
            else:
                log.warning("%s: %s", self.conn.service, self.store.banner())
        return StoreFull(
            f"{what} refused: NATS store full: {refusal.reason}", stream=stream, banner=self.store.banner()
        )

    def said_stored(self, ended: Episode | None) -> None:
        if ended is not None:
            log.warning(
                "%s: NATS stores again: writes work after %.0f s (%d refused since %s)",
                self.conn.service,
                time.time() - ended.since,
                ended.refused,
                clock(ended.since),
            )

    async def _unanswered(self, stream: str, what: str, exc: BaseException) -> StoreFull | None:
        """A write that timed out at every try, while nats-server answers a question about its
        stream at once: the stream is not storing (a disk that filled stops it until nats-server
        restarts). None when the server does not answer either (an outage, said as one)."""
        if not isinstance(exc, nats.errors.TimeoutError | TimeoutError) or not self.conn.connected:
            return None
        with anyio.move_on_after(2):
            try:
                await self.conn.js.stream_info(stream)
            except (nats.errors.Error, OSError):
                return None
            return self.refused(stream, unacknowledged(stream), what)
        return None
