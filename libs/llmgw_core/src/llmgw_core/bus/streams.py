"""llmgw's streams and buckets made as `topology` says, with this configuration's limits."""

from __future__ import annotations

import logging

import nats.errors
import nats.js.errors

from ..errors import BusError, StoreFull
from ..store import Limits, total_bytes
from ..store import size as _size
from ..topology import event_streams
from .batch import Batches
from .connection import Connection
from .kv import KV
from .space import Space

log = logging.getLogger("llmgw.bus")


class Streams:
    def __init__(
        self, conn: Connection, space: Space, kv: KV, batches: Batches, limits: dict[str, Limits]
    ) -> None:
        self.conn = conn
        self.space = space
        self.kv = kv
        self.batches = batches
        self.limits = limits

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
            for bucket in self.conn.names.buckets():
                stream = f"KV_{bucket}"
                await self.kv.ensure_bucket(bucket)
                await self._raise_limits(stream)
                await self._allow_atomic(stream)
                self.space.created(stream)
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
