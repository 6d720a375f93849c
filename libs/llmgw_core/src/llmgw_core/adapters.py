"""LoRA adapters as desired state: an `Adapter` names a fine-tune of one base profile, where its
file comes from, and the scale it is applied at (docs/adapters.md).

An adapter is kept on its base profile (`Profile.adapters`), so it travels to the nodes inside
every shard spec of the base, and adding or removing one changes the profile's fingerprint: the
base's replicas are replaced one at a time (a rolling update), each new one started with the
adapters the profile now names.

The values alone: what may be written of one, beside the catalog and the deployments, is
`adapter_rules`.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from .limits import Name, Token, shown
from .sources import MAX_SOURCE_CHARS, ModelSource, SourceError, parse_source

__all__ = [
    "ADAPTERS_MAX",
    "ADAPTER_ENGINES",
    "LIMIT_MAX",
    "LORA_RANKS",
    "MAX_LORAS_DEFAULT",
    "MAX_LORA_RANK_DEFAULT",
    "RUNTIME_ENGINES",
    "SCALE_MAX",
    "Adapter",
    "AdapterLoad",
    "AdapterLoaded",
    "AdapterQuota",
    "ServedAdapter",
    "adapter_quotas",
    "load_subject",
    "source_words",
]

# Engines that serve adapters on a base replica: llama.cpp loads them all at start and applies
# one per request; vLLM (and the simulator, which speaks as it does) load one at run time when
# a request asks for it, at most `max_loras` at once (docs/adapters.md).
ADAPTER_ENGINES = frozenset({"llamacpp", "vllm", "sim"})
# The engines that load and unload adapters at run time (`/v1/load_lora_adapter`).
RUNTIME_ENGINES = frozenset({"vllm", "sim"})
# Adapters one replica of a runtime engine holds at once where the profile names no
# `max_loras`: each is GPU memory the engine reserves at start.
MAX_LORAS_DEFAULT = 4
# The largest rank a runtime engine's replica serves where the profile names no
# `max_lora_rank` (vLLM reserves buffers of this rank for every slot).
MAX_LORA_RANK_DEFAULT = 64
# The ranks vLLM's `--max-lora-rank` accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The most adapters one base profile may name: each is a `--lora` file every replica loads.
ADAPTERS_MAX = 64
# The largest scale an adapter is applied at (llama.cpp multiplies the adapter's delta by it).
SCALE_MAX = 100.0
# The largest rpm or tpm an adapter may be given: past a billion a minute, a limit limits nothing.
LIMIT_MAX = 1_000_000_000


class Adapter(Struct, frozen=True, kw_only=True):
    """One LoRA adapter of the base profile `base`, served under `name`."""

    name: Name
    base: Name
    # Where the node stages the adapter's file from: hf://, https:// (with `sha256`) or file://.
    source: Annotated[str, Meta(max_length=MAX_SOURCE_CHARS)]
    sha256: str = ""
    scale: Annotated[float, Meta(gt=0, le=SCALE_MAX)] = 1.0
    # Requests and tokens (prompt and completion) per minute across every key that calls it,
    # counted by the gateways together (0: no limit of its own): one team's adapter on a shared
    # base cannot take the base's capacity. Limits change no process: the profile's fingerprint
    # leaves them out (`Profile.fingerprint`), so changing one replaces no replica.
    rpm: Annotated[int, Meta(ge=0, le=LIMIT_MAX)] = 0
    tpm: Annotated[int, Meta(ge=0, le=LIMIT_MAX)] = 0

    @property
    def model_source(self) -> ModelSource:
        """Where the node stages the file from. Raises SourceError naming the adapter."""
        try:
            found = parse_source(self.source, self.sha256)
        except SourceError as exc:
            raise SourceError(f"adapter {self.name}: {source_words(exc.words)}") from None
        if found is None:
            raise SourceError(
                f"adapter {self.name}: source {shown(self.source)} names no file; use "
                "hf://<org>/<repo>/<file>.gguf, https://… with sha256, or file:///path.gguf"
            )
        return found


class AdapterQuota(Struct, frozen=True, kw_only=True):
    """An adapter's own limits as placement says them to the gateways, on its base deployment's
    status (`DeploymentStatus.adapter_quotas`): the gateways may not read the catalog, whose
    profiles carry engines' environments."""

    name: Name
    rpm: Annotated[int, Meta(ge=0, le=LIMIT_MAX)] = 0
    tpm: Annotated[int, Meta(ge=0, le=LIMIT_MAX)] = 0


def adapter_quotas(adapters: tuple[Adapter, ...]) -> tuple[AdapterQuota, ...]:
    """The limits of those of `adapters` that have any, by name."""
    return tuple(
        AdapterQuota(name=a.name, rpm=a.rpm, tpm=a.tpm)
        for a in sorted(adapters, key=lambda a: a.name)
        if a.rpm or a.tpm
    )


class ServedAdapter(Struct, frozen=True, kw_only=True, array_like=True):
    """An adapter a replica's engine loaded, as its shard status says it (`ShardStatus.adapters`):
    its number in the engine is its place in that list, and it is applied at `scale`."""

    name: Name
    scale: Annotated[float, Meta(ge=0, le=SCALE_MAX)] = 1.0


# The adapters a load request may name as recently used on its replica (at most ADAPTERS_MAX
# loaded on one, and the gateway names only those).
_RECENT_MAX = ADAPTERS_MAX


class AdapterLoad(Struct, frozen=True, kw_only=True):
    """A gateway asks the launcher running `shard` (its leader) to load `adapter` into the
    replica's engine: request/reply on `load_subject(node)`. `recent`: the replica's adapters
    the gateway sent requests to, most recent first; where the engine is full, the loaded one
    least recently used (last in `recent`, or not in it at all) is unloaded once `adapter`
    loaded, never one in use: one the engine says has requests running or waiting, or one in
    `in_flight` (the replica's adapters the gateway sent a request to in the last moments, which
    may not be in the engine's count yet)."""

    shard: Token
    adapter: Name
    recent: Annotated[tuple[Name, ...], Meta(max_length=_RECENT_MAX)] = ()
    in_flight: Annotated[tuple[Name, ...], Meta(max_length=_RECENT_MAX)] = ()


class AdapterLoaded(Struct, frozen=True, kw_only=True):
    """The launcher's reply: `error` empty where the engine holds the adapter now, else why not
    (the engine's own words where it refused); `unloaded` the adapter it unloaded for room.
    `retryable`: nothing was tried, because every adapter the engine holds has requests running
    or waiting; asked again once one ends, the load may go (the gateway retries within its hold)."""

    shard: str
    adapter: str
    error: str = ""
    unloaded: str = ""
    retryable: bool = False


def load_subject(prefix: str, node: str) -> str:
    """Request/reply: the node's launcher answers an `AdapterLoad` with `AdapterLoaded`."""
    return f"{prefix}.launcher.{node}.adapters"


def source_words(words: str) -> str:
    """The weights parser's words, said of an adapter's fields."""
    return words.replace("model_sha256", "sha256").replace("model ", "source ", 1)
