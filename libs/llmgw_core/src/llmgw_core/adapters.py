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

from .limits import Name, shown
from .sources import MAX_SOURCE_CHARS, ModelSource, SourceError, parse_source

__all__ = ["ADAPTERS_MAX", "ADAPTER_ENGINES", "SCALE_MAX", "Adapter", "ServedAdapter", "source_words"]

# Engines that serve adapters on a base replica: llama.cpp applies one per request. vLLM's
# runtime load and unload is not used yet.
ADAPTER_ENGINES = frozenset({"llamacpp"})
# The most adapters one base profile may name: each is a `--lora` file every replica loads.
ADAPTERS_MAX = 64
# The largest scale an adapter is applied at (llama.cpp multiplies the adapter's delta by it).
SCALE_MAX = 100.0


class Adapter(Struct, frozen=True, kw_only=True):
    """One LoRA adapter of the base profile `base`, served under `name`."""

    name: Name
    base: Name
    # Where the node stages the adapter's file from: hf://, https:// (with `sha256`) or file://.
    source: Annotated[str, Meta(max_length=MAX_SOURCE_CHARS)]
    sha256: str = ""
    scale: Annotated[float, Meta(gt=0, le=SCALE_MAX)] = 1.0

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


class ServedAdapter(Struct, frozen=True, kw_only=True, array_like=True):
    """An adapter a replica's engine loaded, as its shard status says it (`ShardStatus.adapters`):
    its number in the engine is its place in that list, and it is applied at `scale`."""

    name: Name
    scale: Annotated[float, Meta(ge=0, le=SCALE_MAX)] = 1.0


def source_words(words: str) -> str:
    """The weights parser's words, said of an adapter's fields."""
    return words.replace("model_sha256", "sha256").replace("model ", "source ", 1)
