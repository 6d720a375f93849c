"""llmgw's streams and buckets made as `topology` says, with this configuration's limits."""

from __future__ import annotations

import logging

import anyio
import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from ..access import PermissionDenied
from ..errors import BusError, StoreFull
from ..retry import CALL_RETRY
from ..store import Limits, total_bytes
from ..store import size as _size
from ..topology import event_streams
from .batch import Batches
from .connection import Connection, transient
from .kv import KV
from .loss import Losses
from .space import Space

log = logging.getLogger("llmgw.bus")


class Streams:
    def __init__(
        self,
        conn: Connection,
        space: Space,
        kv: KV,
        batches: Batches,
        limits: dict[str, Limits],
        losses: Losses,
    ) -> None:
        self.conn = conn
        self.space = space
        self.kv = kv
        self.batches = batches
        self.limits = limits
        self.losses = losses
        # Streams `ensure` made or found: one of them missing later was lost.
        self.ensured: set[str] = set()
        self._rebuilding = anyio.Lock()
        kv.recreate = self.bucket

    def names(self) -> list[str]:
        """Every stream llmgw keeps: the events, DLQ and usage streams, and each bucket's."""
        o = self.conn.options
        streams = event_streams(
            self.conn.names, self.limits, replicas=o.replicas, max_age_s=o.events_max_age_s
        )
        return [cfg.name or "" for cfg in streams] + [f"KV_{b}" for b in self.conn.names.buckets()]

    async def bucket(self, bucket: str) -> KeyValue:
        """A bucket found missing at first use, made as `ensure` makes it (its limits, atomic
        batches): one made bare took no atomic batch, and every later commit to it failed
        (`atomic publish is disabled`). An identity that may not make it (a node's) waits for
        placement to: the refusal is a retryable BusError that says so, never the end of the
        service. A bucket this client had opened before was lost: said (`Losses`)."""
        stream = f"KV_{bucket}"
        waiting = (
            f"{self.conn.service}: bucket {bucket} does not exist; placement makes llmgw's buckets "
            f"(is it running, with nats prefix {self.conn.names.prefix!r}? was NATS's store emptied?): "
            "waiting for it"
        )
        if bucket in self.kv.known or stream in self.ensured:
            # A bucket this client used is gone: the store was lost. Every stream is made again
            # at once, so that nothing is written to a half-made store.
            try:
                await self.rebuild()
            except BusError as exc:
                if isinstance(exc.__cause__, PermissionDenied):
                    raise BusError(waiting) from exc
                raise
            return await self.kv.ensure_bucket(bucket)
        try:
            kv = await self.kv.ensure_bucket(bucket)
        except PermissionDenied as exc:
            raise BusError(waiting) from exc
        try:
            await self._raise_limits(stream)
            await self._allow_atomic(stream)
        except PermissionDenied:
            # Made meanwhile by placement, with its settings, which this identity may not change.
            info = await self.conn.js.stream_info(stream)
            self.batches.atomic[stream] = bool(info.config.allow_atomic)
        self.space.created(stream)
        return kv

    async def rebuild(self) -> list[str]:
        """Make again every stream and bucket that is gone (the store emptied or replaced under
        a running cluster), with this configuration's limits, before anything is written to
        them; the streams that were gone (none: nothing done). Said and recorded (`Losses`)."""
        async with self._rebuilding:  # one at a time: each finds what the last one left
            gone = [stream for stream in self.names() if not await self._exists(stream)]
            # A rebuild cut short (a lost lease cancels the step it ran in) left its loss open
            # and its streams half made (a bucket without atomic batches yet): made whole now,
            # by a client that makes streams (`ensure` succeeded before), whatever exists.
            last = self.losses.last
            open_loss = self.ensured and last is not None and last.rebuilt is None
            unfinished = list(last.streams) if open_loss and last is not None else []
            if gone or unfinished:
                if gone:
                    self.losses.noticed(gone)
                await self.ensure()
                self.losses.noticed(sorted({*gone, *unfinished}), back=True)
        return gone

    async def ensure(self) -> None:
        """Create or update the events and DLQ streams and every bucket, with their limits
        (`llmgw_core.store`); safe to repeat.

        The events and DLQ streams take this configuration's limits as they are (they drop
        their oldest messages at the limit). A bucket's limits are only ever raised to what
        this configuration asks, never lowered: a bucket refuses new values at its limit, so
        lowering one below what it holds would leave it refusing every new key, and a node
        agent and placement whose `nats:` sections differ would undo each other at every
        start. Lower one by hand (docs/operations.md).
        """
        o = self.conn.options
        streams = event_streams(
            self.conn.names, self.limits, replicas=o.replicas, max_age_s=o.events_max_age_s
        )
        stream = ""
        try:
            for cfg in streams:
                stream = cfg.name or ""
                try:
                    info = await self.conn.js.add_stream(cfg)
                except nats.js.errors.BadRequestError:
                    info = await self.conn.js.update_stream(cfg)
                self.batches.atomic[stream] = bool(info.config.allow_atomic)
                self.space.created(stream)
                self.ensured.add(stream)
            for bucket in self.conn.names.buckets():
                stream = f"KV_{bucket}"
                await self.kv.ensure_bucket(bucket)
                await self._raise_limits(stream)
                await self._allow_atomic(stream)
                self.space.created(stream)
                self.ensured.add(stream)
        except nats.errors.Error as exc:
            self.conn.raise_if_final(exc)
            full = await self.space.refusal(
                stream, f"creating {stream} ({_size(self.limits[stream].max_bytes)})", exc
            )
            if full is not None:
                need = _size(total_bytes(o, self.conn.names))
                raise StoreFull(
                    f"{full}; llmgw's streams need {need} in all on each NATS "
                    "server that holds them: give its JetStream store more room (jetstream "
                    "{ max_file_store }, a larger disk) or size llmgw for a smaller cluster "
                    "(nats: max_nodes, max_shards, max_deployments, events_max_bytes; docs/operations.md)",
                    stream=full.stream,
                    banner=full.banner,
                ) from exc
            raise BusError(f"cannot create llmgw's streams and buckets: {exc}") from exc

    async def _exists(self, stream: str) -> bool:
        """Whether `stream` exists, asked again while the failure is transient (a server just
        restarted answers its first requests late)."""
        attempts = 3
        for attempt in range(1, attempts + 1):
            try:
                await self.conn.js.stream_info(stream)
                return True
            except nats.js.errors.NotFoundError:
                return False
            except PermissionDenied:
                return True  # not this identity's to read (a node's, the usage stream): not judged
            except nats.errors.Error as exc:
                self.conn.raise_if_final(exc)
                if attempt == attempts or not transient(exc):
                    raise BusError(f"cannot check that {stream} exists: {exc or type(exc).__name__}") from exc
            await anyio.sleep(CALL_RETRY.wait(attempt))
        raise AssertionError("unreachable")

    async def _raise_limits(self, stream: str) -> None:
        """Raise a bucket's byte and value-size limits to this configuration's (see `ensure`); a
        bucket without limits (made by an older llmgw) gets them, unless it holds more already."""
        info = await self.conn.js.stream_info(stream)
        config = info.config
        want = self.limits[stream]
        changed = False
        held = info.state.bytes
        current = config.max_bytes if config.max_bytes is not None else -1
        if current < 0 and held > want.max_bytes:
            log.warning(
                "%s: %s holds %s, over the %s this configuration sizes it for: it stays without a "
                "byte limit; raise nats: max_nodes, max_shards or max_deployments (docs/operations.md)",
                self.conn.service,
                stream,
                _size(held),
                _size(want.max_bytes),
            )
        elif current < want.max_bytes:
            config.max_bytes = want.max_bytes
            changed = True
        largest = config.max_msg_size if config.max_msg_size is not None else -1
        if want.max_msg_size > 0 and largest < want.max_msg_size:  # -1 (none) included
            config.max_msg_size = want.max_msg_size
            changed = True
        if changed:
            await self.conn.js.update_stream(config)

    async def _allow_atomic(self, stream: str) -> None:
        """Let a bucket's stream take atomic batches, where the server knows them (2.12+);
        an older server leaves the flag unset and `commit` writes one by one."""
        config = (await self.conn.js.stream_info(stream)).config
        if not config.allow_atomic:
            config.allow_atomic = True
            try:
                config = (await self.conn.js.update_stream(config)).config
            except nats.js.errors.BadRequestError as exc:
                log.info("%s takes no atomic batches (%s): writes go one by one", stream, exc)
                config.allow_atomic = False
        self.batches.atomic[stream] = bool(config.allow_atomic)
