"""Per-key limits (requests and tokens per minute) shared by every gateway over the limits bucket.

One value per key, `KeyWindow{window, requests, tokens}`, changed only by compare-and-set.

Requests are handed out in reservations: a gateway claims a few of the minute's requests at
once (`chunk`: a tenth of the limit, at least 1, at most 100) and serves them from memory,
claiming the next batch in the background once half of the last is spent. So most requests
never wait on the bus (one in `chunk` at most does, when the batch ran out before the next
came), and the requests served in a minute never exceed the limit: every one served was
claimed, and the claims add up to at most the limit. The price is the other way: what a
gateway claimed and did not serve is lost when the minute ends, so a key may be refused
with up to (gateways - 1) x chunk requests of its minute unserved.

Tokens are known only when an answer ends: each answer's tokens are added to the key's
window (in the background, coalesced per key), and every gateway sees every gateway's
additions through its watch of the bucket. A request is admitted while the window's tokens
are under the limit, so a minute can overshoot by the tokens of the requests admitted
before the window's count reached the limit (those in flight then, and those admitted in
the FLUSH_S a gateway gathers its tokens for, plus the few milliseconds a write takes to
reach the other gateways).

While the bus does not answer a claim within CLAIM_TIMEOUT_S, a gateway admits on its own
count (a batch granted locally, said in its log once): each gateway then holds a key to its
limit on its own, and the key may get up to the limit once per gateway. For OFFLINE_S after
a claim failed, claims are granted locally without asking the bus, so during an outage one
request in OFFLINE_S at most waits CLAIM_TIMEOUT_S for it, not every one.

Windows are fixed minutes of Unix time; a client may spend one minute's limit at its end and
the next at the start of the next.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import anyio
import anyio.abc

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.keys import WINDOW_S, ApiKey, KeyWindow, retry_after, window_of

log = logging.getLogger("llmgw.gateway")

CLAIM_TIMEOUT_S = 2.0
# The pause between adding one batch of tokens to the shared windows and the next. Without it
# a gateway busy with short answers wrote after nearly every one (a read and a compare-and-set
# on the bus, and the watch's echo of it, per request): a tenth of its CPU at 1 in flight.
FLUSH_S = 0.05
OFFLINE_S = 5.0
CAS_ATTEMPTS = 20


def chunk(rpm: int) -> int:
    return max(1, min(100, rpm // 10))


@dataclass
class _Local:
    window: int = -1
    granted: int = 0
    used: int = 0
    claiming: bool = False
    # The limit at which the shared window was found spent this minute: until the minute ends
    # (or the key's limit changes) a request over it is refused without asking the bus again,
    # so a client flooding past its limit costs NATS nothing.
    spent_at: int = 0
    # Tokens of answers that ended, not yet added to the shared window.
    pending_tokens: int = 0


@dataclass(frozen=True)
class Limited:
    """A request refused: which limit, and how long until its minute ends."""

    what: str  # "requests" or "tokens"
    limit: int
    retry_after: int


class Budgets:
    def __init__(self, bus: Bus | None) -> None:
        self.bus = bus
        self._local: dict[str, _Local] = {}
        # The shared windows as the watch last showed them.
        self._seen: dict[str, KeyWindow] = {}
        self._locks: dict[str, anyio.Lock] = {}
        self._dirty = anyio.Event()
        self._tg: anyio.abc.TaskGroup | None = None
        self._said_offline = False
        # Until when claims are granted locally (monotonic), after one the bus did not answer.
        self._offline_until = 0.0

    # --- the watch ------------------------------------------------------------------------

    def observe(self, name: str, value: KeyWindow | None) -> None:
        if value is None:
            self._seen.pop(name, None)
            return
        # Within a window the counts only grow: a late copy of an older value is not taken.
        old = self._seen.get(name)
        if old is None or (value.window, value.requests + value.tokens) >= (
            old.window,
            old.requests + old.tokens,
        ):
            self._seen[name] = value

    def tokens(self, name: str, now: float) -> int:
        """The key's tokens this minute: every gateway's, as last seen, and this one's not yet sent."""
        seen = self._seen.get(name)
        local = self._local.get(name)
        shared = seen.tokens if seen is not None and seen.window == window_of(now) else 0
        return shared + (local.pending_tokens if local is not None else 0)

    # --- the hot path --------------------------------------------------------------------

    def _fresh(self, name: str, window: int) -> _Local:
        local = self._local.get(name)
        if local is None:
            local = self._local[name] = _Local(window=window)
        elif local.window != window:
            local.window, local.granted, local.used, local.spent_at = window, 0, 0, 0
        return local

    async def admit(self, key: ApiKey, now: float | None = None) -> Limited | None:
        """None when `key` may send one more request now (counted), else which limit it hit."""
        if not key.rpm and not key.tpm:
            return None
        clock = now is None
        now = time.time() if now is None else now
        window = window_of(now)
        if key.tpm and self.tokens(key.name, now) >= key.tpm:
            return Limited("tokens", key.tpm, retry_after(now))
        if not key.rpm:
            return None
        local = self._fresh(key.name, window)
        if local.used >= local.granted and local.spent_at != key.rpm:
            async with self._locks.setdefault(key.name, anyio.Lock()):
                local = self._fresh(key.name, window)
                if local.used >= local.granted and local.spent_at != key.rpm:
                    await self._claim(key, window)
            if local.window != window:
                # The minute ended while the claim was on the bus (a request of the next one
                # reset the count): what was claimed belonged to the minute gone; the request
                # is judged again in the new one, never refused for the old one's count.
                later = time.time() if clock else now
                return await self.admit(key, max(later, local.window * WINDOW_S))
        if local.used >= local.granted:
            return Limited("requests", key.rpm, retry_after(now))
        local.used += 1
        if local.granted - local.used <= chunk(key.rpm) // 2 and not local.claiming and self._tg is not None:
            local.claiming = True
            self._tg.start_soon(self._claim_ahead, key, window)
        return None

    def charge(self, key: ApiKey, tokens: int) -> None:
        """An answer of `key` ended, having spent `tokens`: added to the shared window soon."""
        if not key.tpm or tokens <= 0:
            return
        self._fresh(key.name, window_of(time.time())).pending_tokens += tokens
        self._dirty.set()

    # --- claims ---------------------------------------------------------------------------

    async def _claim_ahead(self, key: ApiKey, window: int) -> None:
        try:
            async with self._locks.setdefault(key.name, anyio.Lock()):
                await self._claim(key, window)
        finally:
            self._fresh(key.name, window).claiming = False

    async def _claim(self, key: ApiKey, window: int) -> None:
        """Claim the next batch of `key`'s requests in `window` (what is left of the limit)."""
        local = self._fresh(key.name, window)
        want = chunk(key.rpm)
        try:
            if time.monotonic() < self._offline_until:
                raise TimeoutError("the bus did not answer a claim moments ago")
            with anyio.fail_after(CLAIM_TIMEOUT_S):
                got = await self._cas(key.name, window, requests=want, limit=key.rpm)
        except Exception as exc:
            # Any fault of a claim (NATS silent, a refusal, a value no reader decodes) costs
            # this claim, never the gateway: the key is held to its limit here meanwhile.
            if not isinstance(exc, (BusError, TimeoutError)):
                log.exception("claiming requests of key %s failed", key.name)
            if time.monotonic() >= self._offline_until:
                self._offline_until = time.monotonic() + OFFLINE_S
            if not self._said_offline:
                self._said_offline = True
                log.warning(
                    "cannot claim requests of key %s from the limits bucket (%s); until NATS answers, "
                    "this gateway holds each key to its limits on its own",
                    key.name,
                    exc or type(exc).__name__,
                )
            got = max(0, min(want, key.rpm - local.granted))
        else:
            if self._said_offline:
                self._said_offline = False
                log.warning("the limits bucket answers again: limits are shared by the gateways again")
        if local.window == window:
            local.granted += got
            if not got and not self._said_offline:
                local.spent_at = key.rpm

    async def _cas(
        self, name: str, window: int, *, requests: int = 0, tokens: int = 0, limit: int = 0
    ) -> int:
        """Add `tokens`, and up to `requests` (within `limit`), to `name`'s window; the requests
        added. Compare-and-set, tried again when another gateway wrote in between."""
        assert self.bus is not None
        bucket = self.bus.names.limits_bucket
        for _ in range(CAS_ATTEMPTS):
            found = await self.bus.get(bucket, name, KeyWindow)
            current = found[0] if found is not None and found[0].window >= window else None
            base = current or KeyWindow(window=window)
            got = max(0, min(requests, limit - base.requests)) if requests else 0
            if requests and not got and not tokens:
                self.observe(name, base)
                return 0
            new = KeyWindow(window=window, requests=base.requests + got, tokens=base.tokens + tokens)
            if found is None:
                rev = await self.bus.create(bucket, name, new)
            else:
                rev = await self.bus.update(bucket, name, new, last=found[1])
            if rev is not None:
                self.observe(name, new)
                return got
        raise BusError(f"the limits bucket's value of key {name} changed {CAS_ATTEMPTS} times in a row")

    # --- the background ------------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Claims ahead and adds tokens to the shared windows, until cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            delay = 0.5
            while True:
                await self._dirty.wait()
                await anyio.sleep(FLUSH_S)
                self._dirty = anyio.Event()
                try:
                    await self._flush()
                    delay = 0.5
                except Exception as exc:
                    if isinstance(exc, (BusError, TimeoutError)):
                        log.warning(
                            "cannot add tokens to the limits bucket: %s; retrying in %.1fs", exc, delay
                        )
                    else:
                        log.exception("adding tokens to the limits bucket failed; retrying in %.1fs", delay)
                    self._dirty.set()
                    await anyio.sleep(delay)
                    delay = min(10.0, delay * 2)

    async def _flush(self) -> None:
        window = window_of(time.time())
        for name, local in list(self._local.items()):
            tokens = local.pending_tokens
            if not tokens:
                continue
            with anyio.fail_after(CLAIM_TIMEOUT_S):
                await self._cas(name, window, tokens=tokens)
            local.pending_tokens -= tokens
