"""Keys and values: single-key reads and writes (retried while the failure is transient),
and snapshots of a whole bucket.

A write refused for space raises StoreFull at once; a value that is empty or does not
decode is dead-lettered and skipped; only a KV delete (its `KV-Operation` header)
removes a key.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

from ..access import PermissionDenied
from ..errors import BusError, ConnectionLost
from ..events import decoder, encode
from ..retry import CALL_RETRY, Retry
from ..store import Limits
from ..subjects import ALL, Names
from ..topology import bucket_config
from .connection import Connection, transient
from .deadletter import DeadLetters, DecodeFailure
from .space import Space

log = logging.getLogger("llmgw.bus")
# Failures whose message says it all (no traceback in the outage line).
KNOWN = (nats.errors.Error, OSError, BusError)

T = TypeVar("T", bound=msgspec.Struct)
R = TypeVar("R")

KV_OPS_DELETE = ("DEL", "PURGE")
# How long the server keeps a snapshot's consumer once nothing reads it (see `entries`).
SNAPSHOT_INACTIVE_S = 5.0


@dataclass(frozen=True)
class KVChange(Generic[T]):
    """One key's value (None once deleted) at a bucket revision."""

    key: str
    value: T | None
    revision: int
    # Why the value at `revision` cannot be used (it did not decode; it was dead-lettered),
    # from a watch that asked for such changes; "" for a value or a delete.
    error: str = ""


@dataclass(frozen=True)
class Snapshot:
    """What one read of a bucket found: each matching key's last value (revision, bytes,
    stored time), each key whose last message is a delete (its revision), and the highest
    revision the read saw, delete markers included. A key that held a value at a revision
    no higher than `through`, and is in neither dict, is gone too (its marker removed)."""

    values: dict[str, tuple[int, bytes, float]]
    deleted: dict[str, int]
    through: int


class KV:
    """The buckets of one connection: their handles (opened again after a reconnect), the
    reads and writes of one key, and snapshots."""

    def __init__(self, conn: Connection, space: Space, dlq: DeadLetters, limits: dict[str, Limits]) -> None:
        self.conn = conn
        self.space = space
        self.dlq = dlq
        self.limits = limits
        self._kvs: dict[str, KeyValue] = {}
        conn.on_reconnect.append(self._kvs.clear)
        # Buckets this client has opened: one of them found missing later was lost.
        self.known: set[str] = set()
        # Makes a missing bucket as `ensure` does, with its limits (`Streams.bucket`, set by
        # `Bus`); a bare create left a recreated bucket without atomic batches.
        self.recreate: Callable[[str], Awaitable[KeyValue]] = self.ensure_bucket

    async def ensure_bucket(self, bucket: str) -> KeyValue:
        try:
            kv = await self.conn.js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            config = bucket_config(bucket, self.limits, replicas=self.conn.options.replicas)
            try:
                kv = await self.conn.js.create_key_value(config)
            except nats.js.errors.BadRequestError:
                # Another process created it in the meantime, with settings of its own
                # (`allow_atomic`): "already in use with a different configuration". Use it.
                kv = await self.conn.js.key_value(bucket)
        self._kvs[bucket] = kv
        self.known.add(bucket)
        return kv

    async def kv(self, bucket: str) -> KeyValue:
        kv = self._kvs.get(bucket)
        if kv is None:
            try:
                try:
                    kv = await self.conn.js.key_value(bucket)
                except nats.js.errors.BucketNotFoundError:
                    kv = await self.recreate(bucket)
            except PermissionDenied:
                raise  # a refusal of this identity, said as such (see `watch`)
            except (nats.errors.Error, OSError) as exc:
                self.conn.raise_if_final(exc)
                raise BusError(f"cannot open bucket {bucket}: {exc or type(exc).__name__}") from exc
            self._kvs[bucket] = kv
            self.known.add(bucket)
        return kv

    async def _kv_call(
        self, what: str, bucket: str, call: Callable[[KeyValue], Awaitable[Any]], *, write: bool = False
    ) -> Any:
        """One KV operation, retried while the failure is transient (a write is idempotent:
        the same value again, or a compare-and-set that fails loudly if it already landed).
        A write refused for space raises StoreFull at once: trying again cannot help yet."""
        attempts = 3
        stream = f"KV_{bucket}"
        for attempt in range(1, attempts + 1):
            try:
                result = await call(await self.kv(bucket))
            except BusError as exc:  # SubjectTooLong and ConnectionLost are not retryable
                if attempt == attempts or not exc.retryable:
                    raise
            except (nats.errors.Error, OSError) as exc:
                self.conn.raise_if_final(exc)
                # Answers, not faults: the caller says what each one means.
                if isinstance(
                    exc,
                    nats.js.errors.NotFoundError
                    | nats.js.errors.KeyWrongLastSequenceError
                    | nats.js.errors.NoKeysError,
                ):
                    raise
                full = (
                    await self.space.refusal(stream, what, exc, unanswered=attempt == attempts)
                    if write
                    else None
                )
                if full is not None:
                    raise full from exc
                if attempt == attempts or not transient(exc):
                    raise BusError(f"{what} failed: {exc or type(exc).__name__}") from exc
            else:
                if write:
                    self.space.note_write(stream)
                return result
            await anyio.sleep(CALL_RETRY.wait(attempt))
        raise AssertionError("unreachable")

    async def put(self, bucket: str, key: str, value: msgspec.Struct) -> int:
        """Write a key; a put is idempotent, so a timed-out one (lost in a reconnect) is retried."""
        self.conn.check(Names.kv_subject(bucket, key))
        data = encode(value)
        return int(
            await self._kv_call(f"write {bucket}/{key}", bucket, lambda kv: kv.put(key, data), write=True)
        )

    async def create(self, bucket: str, key: str, value: msgspec.Struct) -> int | None:
        """Write a key only if it has no value; None if it has one."""
        self.conn.check(Names.kv_subject(bucket, key))
        data = encode(value)
        try:
            return int(
                await self._kv_call(
                    f"write {bucket}/{key}", bucket, lambda kv: kv.create(key, data), write=True
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def update(self, bucket: str, key: str, value: msgspec.Struct, *, last: int) -> int | None:
        """Compare-and-set: write only if the key is still at revision `last`; None if it moved."""
        self.conn.check(Names.kv_subject(bucket, key))
        data = encode(value)
        try:
            return int(
                await self._kv_call(
                    f"write {bucket}/{key}", bucket, lambda kv: kv.update(key, data, last=last), write=True
                )
            )
        except nats.js.errors.KeyWrongLastSequenceError:
            return None

    async def get(self, bucket: str, key: str, kind: type[T]) -> tuple[T, int] | None:
        self.conn.check(Names.kv_subject(bucket, key))
        try:
            entry = await self._kv_call(f"read {bucket}/{key}", bucket, lambda kv: kv.get(key))
        except nats.js.errors.NotFoundError:  # never written, or deleted
            return None
        if entry.value is None or entry.operation in KV_OPS_DELETE:
            return None
        return decoder(kind).decode(entry.value), int(entry.revision or 0)

    async def revisions(self, bucket: str, key: str) -> list[tuple[int, bytes | None]]:
        """Every revision of `key` the bucket still holds (its `history` setting), newest first:
        (revision, value), the value None for a delete or purge. Read as `entries` reads:
        nats-py's `KeyValue.history` ends when the client has taken as many messages as the
        server had pending, which on a busy machine (all sent, none taken yet) is none: the
        likely cause of the deployments API once taking a deployment at revision 2 for a new one."""
        found: list[tuple[int, bytes | None]] = []

        async def on_msg(msg: Msg) -> None:
            deleted = deletes(msg.headers)
            if deleted is not None:
                found.append((msg.metadata.sequence.stream, None if deleted else msg.data))

        async def read() -> list[tuple[int, bytes | None]] | None:
            found.clear()
            if not await self._read(bucket, key, on_msg, history=True):
                return None
            return sorted(found, key=lambda entry: entry[0], reverse=True)

        return await self._retried(f"the history of {bucket}/{key}", bucket, key, read)

    async def delete(self, bucket: str, key: str) -> None:
        # A key longer than the bus would write can still have been stored by a raw client;
        # deleting it is one plain publish (no JetStream API subject wraps it), so only the
        # client's own protocol-line guard applies: the key can always be removed.
        if self.conn.lost.is_set():
            raise ConnectionLost(self.conn.lost_cause)
        try:
            await self._kv_call(f"delete {bucket}/{key}", bucket, lambda kv: kv.delete(key), write=True)
        except nats.js.errors.NotFoundError:
            return

    async def keys(self, bucket: str) -> set[str]:
        """Every key that holds a value now (the values are not decoded). Read as `entries`
        reads: nats-py's own `keys()` decides it has seen every key by what the client has
        taken so far, and on a busy machine answered a partial list."""
        return set((await self._snapshot(bucket, ALL)).values)

    async def entries(self, bucket: str, kind: type[T], keys: str = ALL) -> dict[str, KVChange[T]]:
        """A snapshot of every key's current value (bad values are skipped, and counted).

        Each key's last message is only collected as it arrives, and decoded once all are
        in: through `watch`, every key costs a queue hop and a timed wait, which made
        `llmgw ctl get nodes` take seconds at 10,000 nodes. A reconnect meanwhile reads again.
        """
        out: dict[str, KVChange[T]] = {}
        for key, (revision, data, _) in (await self._snapshot(bucket, keys)).values.items():
            value = await self._value(bucket, key, data, kind)
            if value is not None:
                out[key] = KVChange(key, value, revision)
        return out

    async def changes(
        self, bucket: str, kind: type[T], keys: str = ALL
    ) -> tuple[dict[str, KVChange[T]], int]:
        """A fresh read of every matching key's last change, to check a watch against: values,
        deletes (value None) and values that do not decode (value None and their `error`, so
        that a bad write is never taken for a delete), and the highest revision the read saw
        (`Snapshot.through`)."""
        read = await self._snapshot(bucket, keys)
        out: dict[str, KVChange[T]] = {key: KVChange(key, None, rev) for key, rev in read.deleted.items()}
        for key, (revision, data, _) in read.values.items():
            value = await self.decoded(bucket, key, data, kind)
            if isinstance(value, str):
                out[key] = KVChange(key, None, revision, error=value)
            else:
                out[key] = KVChange(key, value, revision)
        return out, read.through

    async def stored(self, bucket: str) -> dict[str, tuple[int, bytes, float]]:
        """Each key's last value as stored: its revision, its bytes (not decoded: the caller
        checks them) and when it was stored (Unix seconds), read as `entries` reads."""
        return (await self._snapshot(bucket, ALL)).values

    async def _snapshot(self, bucket: str, keys: str) -> Snapshot:
        """Each matching key's last revision, value and stored time, read again after a reconnect."""
        return await self._retried(bucket, bucket, keys, lambda: self._last_messages(bucket, keys))

    async def _retried(self, what: str, bucket: str, keys: str, read: Callable[[], Awaitable[R | None]]) -> R:
        """`read()` of `bucket`'s `keys` until it answers (None: the connection was replaced
        meanwhile, read again), retried with backoff while NATS fails, for at most 30 s."""
        self.conn.check(Names.kv_subject(bucket, keys))
        retry = Retry(log, f"{self.conn.service}: reading {what}", base_s=0.5, cap_s=2.0, known=KNOWN)
        try:
            with anyio.fail_after(30):
                while True:
                    try:
                        found = await read()
                    except PermissionDenied as exc:  # a configuration error: retrying cannot help
                        raise BusError(f"{self.conn.service}: cannot read {bucket} {keys}: {exc}") from exc
                    except KNOWN as exc:
                        self.conn.raise_if_final(exc)
                        retry.failed(exc)
                        await retry.wait()
                        continue
                    if found is not None:
                        retry.succeeded()
                        return found
        except TimeoutError as exc:
            raise BusError(f"reading {what} took over 30 s; is NATS reachable?") from exc

    async def _last_messages(self, bucket: str, keys: str) -> Snapshot | None:
        """Each key's last value and revision, and each deleted key's; None when the connection
        was replaced meanwhile."""
        prefix = Names.kv_subject(bucket, "")
        found: dict[str, tuple[int, bytes, float]] = {}
        gone: dict[str, int] = {}
        through = [0]

        async def on_msg(msg: Msg) -> None:
            meta = msg.metadata
            key = msg.subject[len(prefix) :]
            deleted = deletes(msg.headers)
            through[0] = max(through[0], meta.sequence.stream)
            if deleted:
                found.pop(key, None)
                gone[key] = meta.sequence.stream
            elif deleted is not None:
                gone.pop(key, None)
                found[key] = (meta.sequence.stream, msg.data, meta.timestamp.timestamp())

        if not await self._read(bucket, keys, on_msg):
            return None
        return Snapshot(found, gone, through[0])

    async def _read(
        self, bucket: str, keys: str, on_msg: Callable[[Msg], Awaitable[None]], *, history: bool = False
    ) -> bool:
        """Give `on_msg` each matching key's last message (with `history`, every message the
        bucket still holds) from one short-lived ordered consumer, until the server says none
        is pending; False when the connection was replaced meanwhile."""
        await self.kv(bucket)  # the bucket exists, and this identity may read it
        done = anyio.Event()

        async def take(msg: Msg) -> None:
            await on_msg(msg)
            if msg.metadata.num_pending == 0:
                done.set()

        epoch = self.conn.reconnects
        # A read's consumer goes with it: an unsubscribed consumer lingers on the server for
        # its inactive threshold, and nats-server takes 1,000 consumers per stream, so a reader
        # polling every few tenths of a second (a script around `llmgw ctl get`) left every
        # reader of the bucket, placement included, refused (`maximum consumers limit reached`).
        sub = await self.last_per_key(
            bucket,
            keys,
            take,
            inactive_threshold=SNAPSHOT_INACTIVE_S,
            policy=api.DeliverPolicy.ALL if history else api.DeliverPolicy.LAST_PER_SUBJECT,
        )
        try:
            info = await sub.consumer_info()
            # Nothing left and nothing ever sent, by the server's count: an empty bucket, or
            # no key matches. (What this client has taken so far is no measure: on a busy
            # machine the server may have sent every key before the first is taken.)
            if info.num_pending == 0 and (info.delivered is None or info.delivered.consumer_seq == 0):
                done.set()
            while not done.is_set():
                with anyio.move_on_after(1.0):
                    await done.wait()
                if self.conn.reconnects != epoch:
                    return False
        finally:
            with anyio.CancelScope(shield=True), contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
        return True

    async def last_per_key(
        self,
        bucket: str,
        keys: str,
        on_msg: Callable[[Msg], Awaitable[None]],
        *,
        inactive_threshold: float = 300,
        policy: api.DeliverPolicy = api.DeliverPolicy.LAST_PER_SUBJECT,
    ) -> JetStreamContext.PushSubscription:
        """An ordered consumer of `bucket`'s keys matching `keys`: each key's last message (or
        with `policy` ALL, every one the bucket holds), then every new one, to `on_msg`."""
        return await self.conn.js.subscribe(
            Names.kv_subject(bucket, keys),
            stream=f"KV_{bucket}",
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=policy,
            inactive_threshold=inactive_threshold,
        )

    async def _value(self, bucket: str, key: str, data: bytes, kind: type[T]) -> T | None:
        """A key's value, or None (dead-lettered) when it is empty or does not decode."""
        value = await self.decoded(bucket, key, data, kind)
        return None if isinstance(value, str) else value

    async def decoded(self, bucket: str, key: str, data: bytes, kind: type[T]) -> T | str:
        """A key's value, or why it cannot be used (dead-lettered): empty, or it does not decode."""
        if not data:
            # Only a KV delete (its KV-Operation header) removes a key: an empty
            # value put by mistake must not stop an engine or drop a deployment.
            error = "an empty value is not a delete (use a KV delete); the key keeps its last value"
            await self.dlq.dead_letter(Names.kv_subject(bucket, key), b"", error)
            return error
        try:
            return self.dlq.decode(kind, Names.kv_subject(bucket, key), data)
        except DecodeFailure as exc:
            await self.dlq.dead_letter(exc.subject, data, exc.error)
            return exc.error


def deletes(headers: dict[str, str] | None) -> bool | None:
    """Whether a KV message deletes its key (a KV delete or purge, or a server's marker of
    one); None for a marker of a kind this client does not know, which is skipped, as
    nats-py's own watch does."""
    if not headers:
        return False
    operation = headers.get("KV-Operation")
    if operation is not None:
        return operation in KV_OPS_DELETE
    reason = headers.get("Nats-Marker-Reason")
    if reason is None:
        return False
    return True if reason in ("MaxAge", "Purge", "Remove") else None
