"""Per-key limits (requests and tokens per minute) shared by every gateway over the limits bucket.

One value per key, `KeyWindow{window, requests, tokens, by}`, changed only by compare-and-set.

Requests are handed out in reservations: a gateway claims a batch of the minute's requests
at once and serves them from memory, claiming the next in the background once half of the
last is spent. A batch (`batch`) is BATCH_S of the rate the gateway serves the key at, within
what is left of the minute at that rate, at least `chunk` (a tenth of the limit, at least 1,
at most 100) and at most a tenth of the limit. So most requests never wait on the bus (one in
a batch at most does, when it ran out before the next came), a busy gateway claims about once
a second, and the requests served in a minute never exceed the limit: every one served was
claimed, and the claims add up to at most the limit. The price is the other way: what a
gateway claimed and did not serve is lost when the minute ends, so a key may be refused
with up to (gateways - 1) batches of its minute unserved.

Tokens are known only when an answer ends, so each request reserves what it may spend before
it is sent (`Estimate`: its prompt, the body's bytes / 4, and the most it may generate, its
`max_tokens` times its `n`, UNCAPPED_TOKENS where it gives none; at most the tpm), held by this
gateway until its answer ends and settled then with what it spent (`Reservation`). A request
is admitted while the key's tokens this minute and those held for its requests in flight are
under the tpm. So one gateway's minute stays within the tpm, plus the reservation of the
request admitted last, plus what answers spent beyond their reservations (a prompt over its
estimate; an answer that gave no max_tokens, past UNCAPPED_TOKENS): with every request capped,
under twice the tpm. Without reservations the overshoot was the tokens of every request
admitted before the count reached the limit, all of them at once (tpm 300, 40 requests at once:
2,200 tokens). A reservation dropped without an answer (its client left before the answer
began) gives its tokens back when it is collected.

Each answer's tokens are added to the key's window (in the background, coalesced per key), and
every gateway sees every gateway's additions through its watch of the bucket; reservations
stay with their gateway. Between gateways, a minute can overshoot by the tokens of the requests
admitted before the window's count reached the limit on each (those in flight then, and those
admitted in the FLUSH_S a gateway gathers its tokens for, plus the few milliseconds a write
takes to reach the other gateways). Far from the limit (the key's minute under half its tpm,
and a gateway's tokens not yet added under a twentieth of it) a gateway gathers tokens for
FLUSH_IDLE_S instead: the other gateways then lag by at most a twentieth of the tpm each,
which cannot take the key past its limit unseen.

Tokens count in the minute their answer ended, and only there: those a gateway could not add
to the shared window before their minute ended (NATS down) are dropped, never added to the
next minute's, so an outage holds a key to its tpm per minute on each gateway, as it does
its rpm.

Each gateway process writes its own part of the window (`KeyWindow.by`, under a name of its
own for its lifetime) as its running total for the minute, never as an increment, and the
totals as the sum of the parts. A compare-and-set whose answer was lost (it landed; the
gateway timed out, or the client library tried it again and was refused as stale) is thus
made again harmlessly: the part already says what the new write would, and nothing is
counted twice. The requests a gateway granted on its own while the bus was silent are in its
part from its next write on, so the other gateways count them too.

While the bus does not answer a claim within CLAIM_TIMEOUT_S, a gateway admits on its own
count (a batch granted locally, said in its log once): each gateway then holds a key to its
limit on its own, and the key may get up to the limit once per gateway. For OFFLINE_S after
a claim failed, claims are granted locally without asking the bus, so during an outage one
request in OFFLINE_S at most waits CLAIM_TIMEOUT_S for it, not every one.

Windows are fixed minutes of Unix time; a client may spend one minute's limit at its end and
the next at the start of the next.

A LoRA adapter with limits of its own (`adapter_limits.py`) is counted the same way, under a
window of its own that every key calling it shares: a request for it is admitted by its key,
then by the adapter (a request the adapter refuses gives its key's request back, so the key
loses nothing), and its tokens are held against both and charged to both.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import anyio
import anyio.abc

from llmgw_core.bus import Bus
from llmgw_core.errors import BusError
from llmgw_core.keys import WINDOW_S, ApiKey, KeyWindow, Spent, retry_after, window_of

log = logging.getLogger("llmgw.gateway")

CLAIM_TIMEOUT_S = 2.0
# The pause between adding one batch of tokens to the shared windows and the next. Without it
# a gateway busy with short answers wrote after nearly every one (a read and a compare-and-set
# on the bus, and the watch's echo of it, per request): a tenth of its CPU at 1 in flight.
FLUSH_S = 0.05
# How long tokens wait to be added while they cannot bring their key near its tpm: its minute
# under half of it, and the tokens not yet added under a twentieth. Each write holds the request
# in flight up to a millisecond; every FLUSH_S, that was one request in seventy at 1 in flight.
FLUSH_IDLE_S = 0.5
OFFLINE_S = 5.0
CAS_ATTEMPTS = 20


# How long a batch of claimed requests is to last a gateway at the rate it serves the key: a
# busy gateway claims about once a second, not every hundred requests (each claim is a read,
# a compare-and-set and the watch's echo, which held a request in flight up to a millisecond:
# at 1,400 requests a second, one in a hundred).
BATCH_S = 2.0


# The completion tokens a request that gives no max_tokens reserves: an engine then generates
# up to the model's context less the prompt, which the gateway does not know.
UNCAPPED_TOKENS = 1024
# The most one count of a body (max_tokens, n) weighs in an estimate: a reservation is at most
# the key's tpm anyway, and a product of two bodies' integers stays small.
_MOST = 1 << 32
# The body fields that cap what a request generates: chat's (`max_completion_tokens` first,
# as vLLM reads them) and completions' and Anthropic's `max_tokens`, the Responses API's
# `max_output_tokens`; and those that multiply it (`n` answers, `best_of` generated).
_CAPS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
_TIMES = ("n", "best_of")


class Estimate(NamedTuple):
    """What a request may spend, judged from its body before it is sent."""

    # Its prompt: the body's bytes / 4 (English text runs about 4 characters a token; the
    # JSON around the text stands for the chat template's tokens around each message).
    prompt: int
    # Its prompt and the most its answer may generate.
    tokens: int
    # Whether its answer generates tokens (all but embeddings).
    generates: bool = True


def estimate(payload: dict[str, Any], size: int, path: str) -> Estimate:
    """What a request to `path` with body `payload` (`size` bytes) may spend. Pure; the
    fields it reads are integers or absent (`limits.body_problem` refused any other)."""
    prompt = -(-max(0, size) // 4)
    if path == "/v1/embeddings":
        return Estimate(prompt, prompt, generates=False)
    cap = UNCAPPED_TOKENS
    for name in _CAPS:
        value = payload.get(name)
        if type(value) is int:
            cap = value
            break
    times = max([1, *(v for v in map(payload.get, _TIMES) if type(v) is int)])
    return Estimate(prompt, prompt + min(max(0, cap), _MOST) * min(times, _MOST))


def chunk(rpm: int) -> int:
    """The smallest batch of `rpm`'s requests a gateway claims."""
    return max(1, min(100, rpm // 10))


def batch(rpm: int, rate: float, left_s: float) -> int:
    """The batch to claim of a key with `rpm` that a gateway serves `rate` requests a second
    of, with `left_s` of the minute left: BATCH_S of that rate, within what the minute has left
    of it, at least `chunk(rpm)` and at most a tenth of the limit."""
    wanted = math.ceil(rate * min(BATCH_S, max(0.0, left_s)))
    return max(chunk(rpm), min(max(1, rpm // 10), wanted))


_NOTHING = Spent()


class Holder(Protocol):
    """What limits are counted for: a key (`ApiKey`), or an adapter (`AdapterLimit`), by the
    name of its window in the limits bucket."""

    @property
    def name(self) -> str: ...

    @property
    def rpm(self) -> int: ...

    @property
    def tpm(self) -> int: ...


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
    # Tokens of answers that ended this minute, and how many of them the shared window holds.
    tokens: int = 0
    shared_tokens: int = 0
    # This process's part as it last wrote it this minute (the write answered).
    written: Spent = _NOTHING
    # The rate this gateway serves the key at (requests a second, kept across minutes), from
    # the requests served between its claims; and the size of its last claim.
    rate: float = 0.0
    rate_at: float = 0.0
    rate_used: int = 0
    batch: int = 0


@dataclass(frozen=True)
class Limited:
    """A request refused: which limit, and how long until its minute ends (or, where tokens held
    for answers in flight fill what the minute has left, a second: they end sooner)."""

    what: str  # "requests" or "tokens"
    limit: int
    retry_after: int
    # Of the tokens: those held for the key's answers in flight on this gateway.
    held: int = 0
    # The window of the LoRA adapter whose own limit refused it (`adapter.<name>`); "" where
    # the key's did.
    window: str = ""


@dataclass(slots=True)
class _Held:
    """The tokens held for one key's requests in flight."""

    tokens: int = 0


class Reservation:
    """A request admitted with `tokens` held against its key's tpm (0 where it has none) until
    `settle` charges what its answer spent; `estimate` is what it was judged to spend (its
    prompt's part is charged where the answer was cut off before it said its usage).

    One dropped unsettled (a path that never reached an answer, e.g. a client that left before
    its streamed answer began: the relay never ran) gives its tokens back when it is collected,
    so its key is never left short for good. That only changes an integer of an object of its
    own: a finalizer may run inside any allocation, a dict's included."""

    __slots__ = ("_budgets", "_held", "_open", "also", "estimate", "key", "tokens")

    def __init__(
        self,
        budgets: Budgets,
        key: Holder,
        estimate: Estimate,
        tokens: int,
        held: _Held,
        also: Reservation | None = None,
    ) -> None:
        self._budgets = budgets
        self._held = held
        self.key = key
        self.estimate = estimate
        self.tokens = tokens
        # The request's reservation against its adapter's own limits, settled with this one.
        self.also = also
        held.tokens += tokens
        self._open = True

    def settle(self, spent: int, now: float | None = None) -> None:
        """The answer ended having spent `spent` tokens: charged, and the held tokens given back.
        Once: a later call does nothing."""
        if not self._open:
            return
        self._open = False
        self._held.tokens -= self.tokens
        self._budgets.charge(self.key, spent, now)
        if self.also is not None:
            self.also.settle(spent, now)

    def __del__(self) -> None:
        if self._open:
            self._open = False
            self._held.tokens -= self.tokens


class Budgets:
    def __init__(self, bus: Bus | None, writer: str = "", clock: Callable[[], float] = time.time) -> None:
        self.bus = bus
        # Unix time, whose minutes are the limits' windows (every gateway's alike).
        self.clock = clock
        # This process's part's name in every key's window: its own, never another's, even
        # if a gateway of the same id ran before it this minute.
        self.writer = f"{writer[:100]}.{secrets.token_hex(4)}" if writer else secrets.token_hex(6)
        self._local: dict[str, _Local] = {}
        # The shared windows as the watch last showed them.
        self._seen: dict[str, KeyWindow] = {}
        self._locks: dict[str, anyio.Lock] = {}
        # The tokens reserved for each key's requests in flight here (`Reservation`).
        self._held: dict[str, _Held] = {}
        self._dirty = anyio.Event()
        # Set when tokens were spent that could bring a key near its tpm: added after FLUSH_S.
        self._urgent = anyio.Event()
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
        window = window_of(now)
        seen = self._seen.get(name)
        local = self._local.get(name)
        others = 0
        if seen is not None and seen.window == window:
            others = max(0, seen.tokens - self._mine(seen, local).tokens)
        return others + (local.tokens if local is not None and local.window == window else 0)

    def _mine(self, value: KeyWindow, local: _Local | None) -> Spent:
        """This process's part of `value`: as `value` holds it, or, where a gateway that keeps no
        parts (an older release) wrote the value since, as this process last wrote it, which the
        totals that gateway added to still hold."""
        part = value.by.get(self.writer)
        if part is not None:
            return part
        return local.written if local is not None and local.window == value.window else _NOTHING

    # --- the hot path --------------------------------------------------------------------

    def _fresh(self, name: str, window: int) -> _Local:
        local = self._local.get(name)
        if local is None:
            local = self._local[name] = _Local(window=window)
        elif local.window != window:
            # Tokens of a minute gone limit nothing now: never added to the new one's.
            local.window, local.granted, local.used, local.spent_at = window, 0, 0, 0
            local.tokens = local.shared_tokens = 0
            local.written = _NOTHING
            local.rate_used = 0
        return local

    def held(self, name: str) -> int:
        """The tokens held for key `name`'s requests in flight here."""
        found = self._held.get(name)
        return found.tokens if found is not None else 0

    def _tokens_left(self, key: Holder, now: float) -> bool:
        """Whether `key`'s minute has tokens left: those spent and those held under its tpm."""
        return not key.tpm or self.tokens(key.name, now) + self.held(key.name) < key.tpm

    def _out_of_tokens(self, key: Holder, now: float) -> Limited:
        held = self.held(key.name)
        # Where the answers in flight hold what is left, the room comes back as they end.
        wait = 1 if held and self.tokens(key.name, now) < key.tpm else retry_after(now)
        return Limited("tokens", key.tpm, wait, held)

    async def reserve(
        self, key: ApiKey, estimate: Estimate, now: float | None = None, adapter: Holder | None = None
    ) -> Reservation | Limited:
        """`admit`, and `estimate`'s tokens (at most the tpm) held for the request once admitted.
        With `adapter` (the limits of the LoRA adapter it calls), admitted by both, the key
        first; refused by the adapter, the key's request is given back."""
        limited = await self.admit(key, now)
        if limited is not None:
            return limited
        if adapter is None or not (adapter.rpm or adapter.tpm):
            return self._reservation(key, estimate)
        limited = await self.admit(adapter, now)
        if limited is not None:
            self._give_back(key)
            return Limited(limited.what, limited.limit, limited.retry_after, limited.held, adapter.name)
        return self._reservation(key, estimate, self._reservation(adapter, estimate))

    def _give_back(self, key: Holder) -> None:
        """One request of `key` admitted and not sent after all: no longer counted (in the
        minute it was counted in, this gateway's batch of it; nothing of it reached the bus)."""
        local = self._local.get(key.name)
        if key.rpm and local is not None and local.used > 0:
            local.used -= 1

    def reserve_at_once(self, key: ApiKey, estimate: Estimate, now: float) -> Reservation | None:
        """`admit_at_once`, and `estimate`'s tokens held for the request once admitted."""
        return self._reservation(key, estimate) if self.admit_at_once(key, now) else None

    def _reservation(self, key: Holder, estimate: Estimate, also: Reservation | None = None) -> Reservation:
        held = self._held.get(key.name)
        if held is None:
            held = self._held[key.name] = _Held()
        return Reservation(self, key, estimate, min(estimate.tokens, key.tpm), held, also)

    async def admit(self, key: Holder, now: float | None = None) -> Limited | None:
        """None when `key` may send one more request now (counted), else which limit it hit."""
        clock = now is None
        now = self.clock() if now is None else now
        if self.admit_at_once(key, now):
            return None
        if not self._tokens_left(key, now):
            return self._out_of_tokens(key, now)
        # The minute's batch is spent: the next one is claimed, unless the limit is.
        window = window_of(now)
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
                later = self.clock() if clock else now
                return await self.admit(key, max(later, local.window * WINDOW_S))
        if local.used >= local.granted:
            return Limited("requests", key.rpm, retry_after(now))
        if not self._tokens_left(key, now):
            # Requests that waited for the claim together: those admitted first hold the rest.
            return self._out_of_tokens(key, now)
        self._use(key, local)
        return None

    def admit_at_once(self, key: Holder, now: float) -> bool:
        """Admit one more request of `key` now (counted as `admit` counts it) where that needs
        no wait: False where a limit is reached or a batch must be claimed on the bus first,
        for `admit` to decide."""
        if not key.rpm and not key.tpm:
            return True
        if not self._tokens_left(key, now):
            return False
        if not key.rpm:
            return True
        local = self._fresh(key.name, window_of(now))
        if local.used >= local.granted:
            return False
        self._use(key, local)
        return True

    def _use(self, key: Holder, local: _Local) -> None:
        """One request of the batch served; the next batch claimed in the background once half
        of this one is spent."""
        local.used += 1
        if local.granted - local.used <= local.batch // 2 and not local.claiming and self._tg is not None:
            local.claiming = True
            self._tg.start_soon(self._claim_ahead, key, local.window)

    def charge(self, key: Holder, tokens: int, now: float | None = None) -> None:
        """An answer of `key` ended, having spent `tokens`: added to the shared window soon."""
        if not key.tpm or tokens <= 0:
            return
        now = self.clock() if now is None else now
        local = self._fresh(key.name, window_of(now))
        local.tokens += tokens
        self._dirty.set()
        if (local.tokens - local.shared_tokens) * 20 >= key.tpm or self.tokens(key.name, now) * 2 >= key.tpm:
            self._urgent.set()

    # --- claims ---------------------------------------------------------------------------

    async def _claim_ahead(self, key: Holder, window: int) -> None:
        try:
            async with self._locks.setdefault(key.name, anyio.Lock()):
                await self._claim(key, window)
        finally:
            self._fresh(key.name, window).claiming = False

    async def _claim(self, key: Holder, window: int) -> None:
        """Claim the next batch of `key`'s requests in `window` (what is left of the limit)."""
        local = self._fresh(key.name, window)
        at = time.monotonic()
        if local.rate_at and at > local.rate_at and local.used >= local.rate_used:
            served = (local.used - local.rate_used) / (at - local.rate_at)
            local.rate = (local.rate + served) / 2 if local.rate else served
        local.rate_at, local.rate_used = at, local.used
        want = local.batch = batch(key.rpm, local.rate, (window + 1) * WINDOW_S - self.clock())
        try:
            if time.monotonic() < self._offline_until:
                raise TimeoutError("the bus did not answer a claim moments ago")
            with anyio.fail_after(CLAIM_TIMEOUT_S):
                claimed = await self._cas(key.name, window, requests=want, limit=key.rpm)
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
            if claimed is None:
                # The other gateways' clocks are in the next minute already: this one's ends
                # in moments, served on its own count as while the bus is silent.
                got = max(0, min(want, key.rpm - local.granted))
            else:
                got = max(0, claimed - local.granted)
        if local.window == window:
            local.granted += got
            if not got and not self._said_offline:
                local.spent_at = key.rpm

    async def _cas(self, name: str, window: int, *, requests: int = 0, limit: int = 0) -> int | None:
        """Write this process's part of `name`'s window: the requests it was granted and up to
        `requests` more (while the window's total stays within `limit`), and every token its
        answers spent. Returns the requests its part now holds, or None when the bucket is in
        a later minute already. Compare-and-set, tried again when another gateway wrote in
        between; what the part already holds (a write that landed unheard) is not added again."""
        assert self.bus is not None
        bucket = self.bus.names.limits_bucket
        for _ in range(CAS_ATTEMPTS):
            found = await self.bus.get(bucket, name, KeyWindow)
            if found is not None and found[0].window > window:
                self.observe(name, found[0])
                return None
            current = (
                found[0] if found is not None and found[0].window == window else KeyWindow(window=window)
            )
            local = self._local.get(name)
            granted, tokens = (
                (local.granted, local.tokens) if local is not None and local.window == window else (0, 0)
            )
            mine = self._mine(current, local)
            others = Spent(
                requests=max(0, current.requests - mine.requests), tokens=max(0, current.tokens - mine.tokens)
            )
            have = max(mine.requests, granted)
            got = max(0, min(requests, limit - others.requests - have))
            part = Spent(requests=have + got, tokens=max(mine.tokens, tokens))
            if found is not None and current is found[0] and current.by.get(self.writer) == part:
                # Nothing to add: the limit is spent, or the part says it already (a write
                # whose answer was lost).
                self.observe(name, current)
                return part.requests
            new = KeyWindow(
                window=window,
                requests=others.requests + part.requests,
                tokens=others.tokens + part.tokens,
                by={**current.by, self.writer: part},
            )
            if found is None:
                rev = await self.bus.create(bucket, name, new)
            else:
                rev = await self.bus.update(bucket, name, new, last=found[1])
            if rev is not None:
                if local is not None and local.window == window:
                    local.written = part
                self.observe(name, new)
                return part.requests
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
                with anyio.move_on_after(FLUSH_IDLE_S):
                    await self._urgent.wait()
                await anyio.sleep(FLUSH_S)
                self._dirty, self._urgent = anyio.Event(), anyio.Event()
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
        window = window_of(self.clock())
        for name, local in list(self._local.items()):
            tokens = local.tokens
            if tokens <= local.shared_tokens or local.window != window:
                continue  # nothing new, or a minute gone: its tokens limit nothing now
            with anyio.fail_after(CLAIM_TIMEOUT_S):
                await self._cas(name, window)
            if local.window == window:  # else the count was reset for the next minute meanwhile
                local.shared_tokens = max(local.shared_tokens, tokens)
