"""Which replica serves a request: the routing table kept from the buckets, and its choices.

Pure: the service feeds it every change of the replicas and deployments
buckets; the proxy asks it which deployment a `model` names, which ready
replica to send to, and, when there is none, why, in the replicas' own words.

A replica is chosen by prefix first, then by load. A request's prompt is
hashed in blocks, each block's hash covering all before it (`prompt_blocks`);
the index (`PrefixIndex`) remembers which replicas each block hash was last
sent to. The replica holding the deepest matched block takes the request, if
the match is at least `min_match_blocks` long, the block is not held by every
candidate (then it tells nothing), and the replica is within the load bound
(in flight at most `load_factor` x the mean + 1). A prompt whose lead (its
first `min_match_blocks` blocks) no candidate holds yet is a new prefix, and
goes where there is room for it (below). Otherwise, and with `prefix_aware:
false`, the ready replica with the fewest requests in flight goes, ties to the
one chosen longest ago. Either way the request's blocks are then recorded for
the replica it went to.

A new prefix is placed for the engines' prompt caches first: they are small
(a few long contexts each), so a replica sent more distinct prefixes than the
others evicts what it will be asked for again while the others' caches have
room. Measured with two one-slot llama-servers caching 3 contexts each, and
4 customers: sent 2 and 2, 91% of prompt tokens came from the caches and p90
TTFT was 0.6 s; sent 3 and 1, 66-73% and 3.2 s, worse than least outstanding.
So the index counts the blocks each replica was sent (`PrefixIndex.size`,
kept as it learns and forgets), and a new prefix goes only to a replica within
the load bound whose count is at most `prefix_balance` x the candidates' mean
(consistent hashing with bounded loads, the load being cache: SGLang's router
sends a prompt it matches nowhere to the worker whose tree is smallest). Of
those, the least busy: a new prefix is cold on every replica, so a busier one
makes it wait behind others' requests (with engines of one slot, two new
prompts on one replica while another sits idle take twice as long).

Rendezvous (highest random weight) hashing breaks the ties among those the
same way in every gateway process: each keeps its own index, and with several
workers on one port (`http: workers`) or several gateways behind one balancer,
the connections of one customer land on different processes. By "the one
chosen longest ago" each would send the same new prefix to a replica of its
own, and the engines would compute it once per process. Instead each is
weighed by a hash of the lead's own hash with the replica's key, and the
heaviest takes it: processes that see the same replicas idle and were sent
the same prefixes pick the same one, so the one that routed it goes there by
its index and the others by the same weights (where their counts differ near
the bound, they may not). A replica gone moves only the prefixes it won,
unless the balance moves more. The lead's hash is blake2b of its text (the
same in every process, unlike Python's `hash` of bytes, keyed per process):
about 3 us for the 1 KiB lead of the defaults, once per request; the weights,
splitmix64 over the lead's and each key's hash, under 1 us per candidate, paid
only by a request whose lead is new.
A lead shorter than `min_match_blocks` is no lead: short prompts, and a short
shared system prompt, keep going by load.

Where no replica is known ready, a replica whose readiness is `unknown` and
that still has a URL is sent to: its launcher went silent while its engines
were last heard ready (a launcher restarting, an agent upgrade), and placement
keeps that URL only while it judges the node alive. A request it cannot take
costs a connection attempt and goes to the next replica.

A `draining` replica is never chosen, not even as a last resort: placement is about to stop
it, and a request sent now would be cut off. Its requests in flight run to their end, but
its chat and completion streams, handed over to another replica (`relay.py`).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import logging
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llmgw_core import failures
from llmgw_core.events import Deployment, DeploymentStatus, ReplicaRecord, ShardStatus
from llmgw_core.prefixes import prompt_seed

from .adapters import AdapterIndex
from .config import RoutingConfig
from .engine_view import EngineHeld, EnginePrompt, as_text_blocks, held_depth
from .outliers import Outliers
from .prefix_index import PrefixIndex
from .weigh import bound, load_of, worth

log = logging.getLogger("llmgw.gateway")

# The paths whose prompts engines cache by prefix (embeddings are not cached), and the body
# fields that make up the prompt, in the order engines' templates put them.
PREFIX_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"})
_PROMPT_FIELDS = ("system", "instructions", "messages", "prompt", "input")


def _prompt_text(payload: dict[str, Any], limit: int) -> bytes:
    """The leading `limit` bytes (at most) of the prompt fields' text, in a canonical form:
    strings and numbers in order, objects by sorted key, each piece followed by a NUL (so that
    `["ab", "c"]` and `["a", "bc"]` differ). Never copies more than `limit` of a long string."""
    parts: list[bytes] = []
    size = 0
    stack: list[Any] = [payload.get(name) for name in reversed(_PROMPT_FIELDS)]
    while stack and size < limit:
        value = stack.pop()
        if value is None:
            continue
        if isinstance(value, list):
            stack.extend(reversed(value))
            continue
        if isinstance(value, dict):
            for k in sorted(value, reverse=True):
                stack.append(value[k])
                stack.append(k)
            continue
        # A str slice of `limit - size` characters holds at least that many bytes.
        text = value if isinstance(value, str) else str(value)
        piece = text[: limit - size].encode("utf-8", "surrogatepass") + b"\0"
        parts.append(piece)
        size += len(piece)
    return b"".join(parts)[:limit]


def prompt_blocks(
    routing: RoutingConfig, deployment: str, path: str, body: Any, adapter: str = ""
) -> tuple[int, ...]:
    """The chained hashes of the prompt's whole leading blocks (none for a path whose prompt
    engines do not cache, a body with no prompt, or with prefix-aware routing off).

    The same in every process and every run: every gateway reads the blocks the others routed
    (`prefix_share.py`), so a block must hash alike in all of them (Python's `hash` of bytes is
    keyed per process). Each block's hash is the CRC-32 and the Adler-32 of the whole text up
    to its end (64 bits; each block costs one call of each over its own bytes, the running
    values carried on): about twice the per-process `hash`, 70 us for 128 blocks against 35, a
    cryptographic hash 140. A collision, even a made one, costs one request a routing choice,
    never a wrong answer. But for the lead's block (the `min_match_blocks`-th), which
    rendezvous hashing weighs: `lead_hash` of the text up to its end.

    Seeded by the deployment and the LoRA `adapter` the request names (`prefixes.prompt_seed`):
    an engine caches a prompt under an adapter apart from the base's."""
    if not routing.prefix_aware or path not in PREFIX_PATHS or not isinstance(body, dict):
        return ()
    size = routing.block_bytes
    text = _prompt_text(body, size * routing.max_blocks)
    lead = routing.min_match_blocks * size
    hashes = []
    seed = prompt_seed(deployment, adapter)
    crc, adler = zlib.crc32(seed), zlib.adler32(seed)
    crc32, adler32 = zlib.crc32, zlib.adler32
    for start in range(0, len(text) - size + 1, size):
        block = text[start : start + size]
        crc, adler = crc32(block, crc), adler32(block, adler)
        hashes.append(
            lead_hash(deployment, text[:lead], adapter) if start + size == lead else crc << 32 | adler
        )
    return tuple(hashes)


def lead_hash(deployment: str, lead: bytes, adapter: str = "") -> int:
    """A prompt's lead hashed the same in every process (and every run), under `adapter`."""
    h = hashlib.blake2b(prompt_seed(deployment, adapter), digest_size=8)
    h.update(lead)
    return int.from_bytes(h.digest(), "little")


_MASK = (1 << 64) - 1


@functools.lru_cache(maxsize=4096)
def _key_hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def rendezvous(lead: int, keys: Sequence[str]) -> str:
    """Of replica `keys`, the one of highest weight for the prompt lead hashed `lead`: the same
    in every process; a key gone moves only the leads it won. The weight is splitmix64's
    finalizer over the lead and the key's own hash (blake2b, once per key): a few integer
    operations per replica."""
    lead &= _MASK
    best, heaviest = keys[0], -1
    for key in keys:
        x = lead ^ _key_hash(key)
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
        x ^= x >> 31
        if x > heaviest:
            best, heaviest = key, x
    return best


def prompt_text_bytes(payload: dict[str, Any], limit: int) -> int:
    """How many bytes the prompt's text is as the text index reads it (`prompt_blocks`' text,
    uncut by `max_blocks`), at most `limit` (the request body's size bounds it): what an
    engine match, in tokens, is weighed against (`engine_view.measured_bytes_per_token`)."""
    return len(_prompt_text(payload, limit))


# The most requests an engine's own counts may weigh (running and waiting, summed).
ENGINE_LOAD_MAX = 1_000_000

# `Table.reason` of a choice by other than a prefix match.
REASONS = {"hash": "new prefix", "load": "least outstanding"}

# The most of placement's refusal a client is answered: every node's reason, grouped, fits a
# few lines where the nodes are few; a thousand nodes' reasons would not fit an error message.
REFUSAL_CHARS = 1000
# Groups of nodes with one reason, and nodes named in each, before the rest are counted.
REFUSAL_GROUPS = 4
REFUSAL_NODES = 3
# One node's reason, as it is grouped (placement's words are one line of a few dozen characters).
REFUSAL_REASON_CHARS = 200


def refusal_text(deployment: str, status: DeploymentStatus) -> str:
    """Why placement places no replica of `deployment`, for a client: its nodes grouped by
    reason, the most common first (`no GPU of class H100 on n1, n2, n3 and 5 more; 0 of 2 GPUs
    free on n9`), cut to REFUSAL_CHARS. Pure."""
    by_reason: dict[str, list[str]] = {}
    for r in status.reasons:
        reason = failures.one_line(r.reason)[:REFUSAL_REASON_CHARS] or "(no reason given)"
        by_reason.setdefault(reason, []).append(r.node[:REFUSAL_REASON_CHARS])
    groups = sorted(by_reason.items(), key=lambda item: (-len(item[1]), item[0]))
    parts = []
    for reason, nodes in groups[:REFUSAL_GROUPS]:
        named = ", ".join(nodes[:REFUSAL_NODES])
        if len(nodes) > REFUSAL_NODES:
            named += f" and {len(nodes) - REFUSAL_NODES} more"
        parts.append(f"{reason} on {named}")
    if len(groups) > REFUSAL_GROUPS:
        rest = sum(len(nodes) for _, nodes in groups[REFUSAL_GROUPS:])
        parts.append(f"{len(groups) - REFUSAL_GROUPS} other reasons on {rest} nodes")
    said = failures.one_line(status.summary)[:REFUSAL_CHARS]
    why = "; ".join(parts) if parts else said or "no node fits it"
    text = (
        f"deployment {deployment} cannot be placed on any node, so no replica will serve it until "
        f"the cluster changes: {why}. `llmgw ctl explain {deployment}` shows every node's reason"
    )
    if len(text) > REFUSAL_CHARS:
        text = text[: REFUSAL_CHARS - 1] + "…"
    return text


@dataclass
class Table:
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    deployments: dict[str, Deployment] = field(default_factory=dict)
    # `<deployment>.<replica>` -> its record.
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    # Placement's last `DeploymentStatus` per deployment: its reason when none can be placed.
    statuses: dict[str, DeploymentStatus] = field(default_factory=dict)
    # Requests in flight per replica key.
    outstanding: Counter[str] = field(default_factory=Counter)
    # When each replica key was last chosen: among equally busy replicas, the one
    # chosen longest ago goes next, so one client's requests in turn reach them all.
    _last_pick: dict[str, int] = field(default_factory=dict)
    _picks: itertools.count[int] = field(default_factory=itertools.count)
    prefixes: PrefixIndex = field(init=False)
    # Each replica's answers, and those taken out of routing for failing them (outliers.py).
    outliers: Outliers = field(default_factory=Outliers)
    # Replicas chosen, by (deployment, what chose it): `prefix` (a match of the prompt's
    # blocks), `hash` (rendezvous: a lead no candidate holds) or `load` (least outstanding:
    # none within the bound, a lead every candidate holds, or too few blocks to have a lead).
    # A retry chooses again and counts again.
    routed: Counter[tuple[str, str]] = field(default_factory=Counter)
    # The same records by deployment: a request reads its deployment's alone, never every
    # replica of the cluster (at 10,000 replicas a scan of them all cost about 0.25 ms a choice
    # and 0.4 ms a name, more than the rest of the gateway's work on a request).
    _of: dict[str, dict[str, ReplicaRecord]] = field(default_factory=dict, init=False, repr=False)
    # What each shard's engine last said it runs and queues (running + waiting), by its key in
    # the shard-status bucket, while it is ready: a replica's load as every gateway makes it.
    engine_loads: dict[str, int] = field(default_factory=dict)
    # Why the last `pick` chose its replica, in words (`prefix 14 blocks`, `least outstanding`,
    # `new prefix`), for the request's span.
    reason: str = ""
    # Told each replica key whose blocks the index recorded, and each replica key gone: the
    # routing bucket's writer (`prefix_share.py`) batches them.
    recorded: Callable[[str], None] = field(default=lambda key: None, repr=False)
    gone: Callable[[str], None] = field(default=lambda key: None, repr=False)
    # `known()` and each alias's deployment, made again at the first read after a change of the
    # deployments, or of which deployments have records.
    _known: list[str] | None = field(default=None, init=False, repr=False)
    _alias_of: dict[str, str] | None = field(default=None, init=False, repr=False)
    # The LoRA adapters each replica's engine loaded, from the shard statuses (adapters.py).
    adapters: AdapterIndex = field(default_factory=AdapterIndex)
    # What each replica's engine says it holds (`source: engine` in the routing bucket), by
    # replica key, kept by the routing bucket's reader (`prefix_share.py`): such a replica is
    # matched by the request's token blocks (engine_view.py), not by what was sent there.
    engine: dict[str, EngineHeld] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prefixes = PrefixIndex(self.routing.index_blocks, self.routing.replica_blocks)

    # --- the buckets' changes ----------------------------------------------------

    def set_deployment(self, name: str, value: Deployment | None) -> None:
        if value is None:
            self.deployments.pop(name, None)
        else:
            self.deployments[name] = value
        self._known = self._alias_of = None

    def set_shard_status(self, key: str, status: ShardStatus | None) -> None:
        """A shard's status changed: its engine's load counts while it is ready and says one."""
        self.adapters.observe(key, status)
        load = None if status is None or status.state != "ready" else status.load
        if load is None:
            self.engine_loads.pop(key, None)
        else:
            # A launcher's counts, bounded: one that says -5 or 10**18 moves requests, no more.
            self.engine_loads[key] = min(max(0, load.running + load.waiting), ENGINE_LOAD_MAX)

    def set_status(self, status: DeploymentStatus) -> None:
        self.statuses[status.deployment] = status

    def set_replica(self, key: str, value: ReplicaRecord | None) -> None:
        old = self.replicas.get(key)
        if old is not None and (value is None or value.deployment != old.deployment):
            group = self._of[old.deployment]
            del group[key]
            if not group:
                del self._of[old.deployment]
                self._known = None
        if value is None:
            if self.replicas.pop(key, None) is not None:
                self.prefixes.forget(key)
                self.outliers.forget(key)
                self.gone(key)
            self._last_pick.pop(key, None)
        else:
            self.replicas[key] = value
            if value.deployment not in self._of:
                self._of[value.deployment] = {}
                self._known = None
            self._of[value.deployment][key] = value

    # --- names -------------------------------------------------------------------

    def known(self) -> list[str]:
        """Every deployment the gateway knows, sorted: from the deployments bucket, and any
        deployment that still has replica records (one being deleted, or a bucket it cannot read)."""
        if self._known is None:
            self._known = sorted({*self.deployments, *self._of})
        return list(self._known)

    def aliases(self, deployment: str) -> tuple[str, ...]:
        d = self.deployments.get(deployment)
        return d.aliases if d is not None else ()

    def resolve(self, model: str) -> str | None:
        """The deployment that `model` names: its name, else an alias (the first deployment
        by name wins where two claim the same alias)."""
        if model in self.deployments or model in self._of:
            return model
        if self._alias_of is None:
            alias_of: dict[str, str] = {}
            for name in sorted(self.deployments):
                for alias in self.deployments[name].aliases:
                    alias_of.setdefault(alias, name)
            self._alias_of = alias_of
        return self._alias_of.get(model)

    def describe_known(self) -> str:
        parts = []
        for name in self.known():
            aliases = self.aliases(name)
            parts.append(f"{name} (aliases: {', '.join(aliases)})" if aliases else name)
        return ", ".join(parts) or "none (no deployment exists yet)"

    # --- choosing ----------------------------------------------------------------

    def of(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        group = self._of.get(deployment)
        return sorted(group.items()) if group else []

    def ready(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        return [(k, r) for k, r in self.of(deployment) if r.state == "ready" and r.url]

    def unknown(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        """Replicas whose launcher is silent while their engines were last heard ready."""
        return [(k, r) for k, r in self.of(deployment) if r.state == "unknown" and r.url]

    def viewed(self, deployment: str) -> list[tuple[str, ReplicaRecord]]:
        """The ready replicas of `deployment` whose engine says what it holds (none at the cost
        of one lookup where no engine says anything)."""
        if not self.engine:
            return []
        return [(k, r) for k, r in self.ready(deployment) if k in self.engine]

    def pick(
        self,
        deployment: str,
        exclude: frozenset[str] = frozenset(),
        blocks: Sequence[int] = (),
        engine: EnginePrompt | None = None,
    ) -> tuple[str, ReplicaRecord] | None:
        """The ready replica, not in `exclude`, that holds the deepest match of the prompt's
        `blocks`, else for a lead none holds the heaviest by rendezvous hashing of the least
        busy with room for it (see the module's docstring), else the one with the fewest
        requests in flight; where none is ready, the `unknown` one with a URL, chosen alike. A
        replica out of routing for failing its answers (`outliers.py`) only where no other is.
        With `engine` (the prompt's token blocks), first the deepest match worth its load of
        what the replicas' engines say they hold; where none is, the text index of everything
        routed, as without: a repeat the engine has not said it stored yet follows its first,
        and one whose context the engine evicted goes back where it was asked before (and is
        computed again where it will be asked for again), not to the least busy, which spread
        a conversation over every replica's cache."""
        candidates = [(k, r) for k, r in self.ready(deployment) if k not in exclude]
        if not candidates:
            candidates = [(k, r) for k, r in self.unknown(deployment) if k not in exclude]
        if not candidates:
            return None
        out = self.outliers.ejected([k for k, _ in candidates])
        if out:
            # Replicas failing their answers are skipped while any other can take the request.
            candidates = [(k, r) for k, r in candidates if k not in out] or candidates
        records = dict(candidates)
        how = "load"
        key = ""
        depth = 0
        loads = self._loads(records)
        viewed: frozenset[str] = frozenset()
        if engine is not None and len(records) > 1:
            viewed = frozenset(k for k in records if k in self.engine)
            matched, depth = self._engine_matched(engine, loads)
            if matched:
                key, how = min(matched, key=lambda k: (loads[k], self._last_pick.get(k, -1))), "engine"
        if not key and len(records) > 1 and len(blocks) >= self.routing.min_match_blocks:
            matched, depth = self._matched(blocks, loads)
            if matched:
                key, how = min(matched, key=lambda k: (loads[k], self._last_pick.get(k, -1))), "prefix"
            else:
                lead = blocks[self.routing.min_match_blocks - 1]
                if not any(k in records for k in self.prefixes.holders(lead)):
                    least = self._least_busy(self._roomy(loads, viewed, engine), loads)
                    # One least busy: load decides, as it would without the prefix.
                    key, how = (rendezvous(lead, least), "hash") if len(least) > 1 else (least[0], "load")
        if not key:
            key = min(records, key=lambda k: (loads[k], self._last_pick.get(k, -1)))
        self._last_pick[key] = next(self._picks)
        if blocks:
            self.prefixes.record(blocks, key)
            self.recorded(key)
        self.routed[deployment, how] += 1
        self.reason = REASONS.get(how) or f"prefix {depth} blocks" + (" (engine)" if how == "engine" else "")
        return key, records[key]

    def _loads(self, candidates: dict[str, ReplicaRecord]) -> dict[str, int]:
        """Each candidate's load (`weigh.load_of`): in flight from here, or its engine's
        running and waiting where more."""
        outstanding = self.outstanding
        engines = self.engine_loads
        if not engines:
            return {k: outstanding[k] for k in candidates}
        out = {}
        for k, r in candidates.items():
            said = [engines[s] for s in r.shards if s in engines]
            out[k] = load_of(outstanding[k], sum(said) if said else None)
        return out

    def _engine_matched(self, engine: EnginePrompt, loads: dict[str, int]) -> tuple[list[str], int]:
        """As `_matched`, by what the candidates' engines say they hold: the candidates whose
        engine holds the prompt's deepest token block at least `min_match_blocks` deep (in the
        text index's blocks, `engine_view.as_text_blocks`) and not held by every candidate,
        within the load bound and worth their load, and that depth in engine blocks."""
        routing = self.routing
        depths = {k: held_depth(engine, self.engine[k]) for k in loads if k in self.engine}
        limit = bound(loads.values(), routing.load_factor)
        least = min(loads.values())
        for deep in sorted({d for d in depths.values() if d}, reverse=True):
            weight = as_text_blocks(deep, engine.block_tokens, routing.block_bytes, engine.bytes_per_token)
            if weight < routing.min_match_blocks:
                break
            held = [k for k, d in depths.items() if d >= deep]
            if len(held) == len(loads):
                break
            within = [
                k
                for k in held
                if loads[k] <= limit and worth(weight, loads[k], least, routing.match_per_load)
            ]
            if within:
                return within, deep
        return [], 0

    def _matched(self, blocks: Sequence[int], loads: dict[str, int]) -> tuple[list[str], int]:
        """The candidates (the keys of `loads`) that hold the deepest block of `blocks` at least
        `min_match_blocks` deep and not held by every candidate, within the load bound and
        worth their load (`weigh.py`), and that depth; ([], 0) where there are none."""
        routing = self.routing
        limit = bound(loads.values(), routing.load_factor)
        least = min(loads.values())
        # From the deepest block held up: a shallower block's holders include the deeper's, so
        # where every candidate holds one, all shallower tell nothing either.
        for depth in range(self.prefixes.deepest(blocks), routing.min_match_blocks - 1, -1):
            held = [k for k in self.prefixes.holders(blocks[depth - 1]) if k in loads]
            if len(held) == len(loads):
                break
            within = [
                k for k in held if loads[k] <= limit and worth(depth, loads[k], least, routing.match_per_load)
            ]
            if within:
                return within, depth
        return [], 0

    def _roomy(
        self, loads: dict[str, int], viewed: frozenset[str] = frozenset(), engine: EnginePrompt | None = None
    ) -> list[str]:
        """Where a new prefix may go: the candidates (the keys of `loads`) within the load bound
        that were sent at most `prefix_balance` times the mean of the prompt blocks the
        candidates were sent (the index's `size`; for one in `viewed`, what its engine says it
        holds, in text blocks at `engine`'s bytes a token); those
        within the load bound where none of them is (never none: the least busy is within it)."""
        limit = bound(loads.values(), self.routing.load_factor)
        within = [k for k in loads if loads[k] <= limit]
        text = self.prefixes.size

        def size(k: str) -> float:
            if k not in viewed or engine is None:
                return text(k)
            held = len(self.engine[k].blocks)
            return as_text_blocks(held, engine.block_tokens, self.routing.block_bytes, engine.bytes_per_token)

        most = self.routing.prefix_balance * sum(size(k) for k in loads) / len(loads)
        return [k for k in within if size(k) <= most] or within

    def _least_busy(self, candidates: Sequence[str], loads: dict[str, int]) -> list[str]:
        """The candidates with the least load (never none)."""
        fewest = min(loads[k] for k in candidates)
        return [k for k in candidates if loads[k] == fewest]

    def outcome(self, key: str, status: int, words: str = "") -> None:
        """Count an attempt's outcome at replica `key` (`status` 0: no answer came) for outlier
        detection: a replica failing its answers is taken out of routing for a while."""
        record = self.replicas.get(key)
        if record is None:
            return
        failed = not 0 < status < 500
        size = (len(self.ready(record.deployment)) or len(self.unknown(record.deployment))) if failed else 0
        if self.outliers.record(key, record.deployment, record.replica, status, words, size):
            log.warning(
                "%s: replica %s at %s taken out of routing for failing its answers (last: %s %s)",
                record.deployment,
                record.replica,
                record.url,
                status or "no answer",
                words,
            )

    def refused(self, deployment: str) -> str | None:
        """Placement's refusal, where nothing can serve `deployment` until the cluster changes:
        no replica of it is placed (none loading, none starting, no node staging one) and its
        last `DeploymentStatus` says placement could place none, every node known refusing it
        for good (none installing its engine). Its node reasons,
        grouped by reason, cut to REFUSAL_CHARS; None where something may still serve it."""
        if self._of.get(deployment):
            return None
        status = self.statuses.get(deployment)
        if status is None or not status.unplaceable or status.ready or status.pending:
            return None
        if not status.reasons or any(failures.readying(r) for r in status.reasons):
            # No node heard of yet (a cluster starting), or a node installing the engine
            # (`failures.readying`, read from the reason's kind): one may take the replica
            # within the hold.
            return None
        d = self.deployments.get(deployment)
        if d is not None and d.autoscale is None and d.replicas == 0:
            return None  # scaled to 0 by hand: `unavailable` says so
        return refusal_text(deployment, status)

    def unavailable(self, deployment: str, now: float | None = None) -> str:
        """Why `deployment` has no ready replica, quoting each replica's state (and for how long,
        `now` being wall-clock time) and reason."""
        records = self.of(deployment)
        d = self.deployments.get(deployment)
        if not records:
            if d is not None and d.autoscale is None and d.replicas == 0:
                return (
                    f"deployment {deployment} has 0 ready replicas: it is scaled to 0, with no "
                    f"autoscale (`llmgw ctl scale {deployment} --replicas N` starts it)"
                )
            status = self.statuses.get(deployment)
            if status is not None and status.unplaceable and status.summary:
                # Placement's own words, every node's reason included ("chat: 0 of 2 ready;
                # 2 cannot be placed: node-a no GPU of class H100, …").
                return f"deployment {deployment} has 0 ready replicas: {status.summary}"
            if d is not None and d.autoscale is not None:
                return (
                    f"deployment {deployment} has 0 ready replicas: it is scaled to 0 "
                    f"(autoscale, min_replicas {d.autoscale.min_replicas}) and no replica was placed"
                )
            # Not refused (yet): placing it, or placement has not spoken of it.
            return (
                f"deployment {deployment} has 0 ready replicas: none placed yet "
                f"(`llmgw ctl explain {deployment}` shows placement's reason)"
            )
        parts = []
        for _, r in records:
            part = f"{r.replica} {r.state}"
            if now is not None and r.since:
                part += f" for {max(0, round(now - r.since))}s"
            why = failures.one_line(r.reason) or failures.summary(failures.failure_of(r))
            parts.append(f"{part} ({why})" if why else part)
        return f"deployment {deployment} has 0 ready replicas: {'; '.join(parts)}"

    def routed_by(self, how: str) -> int:
        """Replicas chosen by `how` (`prefix` or `load`), every deployment summed."""
        return sum(n for (_, h), n in self.routed.items() if h == how)
