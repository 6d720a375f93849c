"""A LoRA adapter's GGUF header, read as hostile bytes, and whether it fits its base.

llama.cpp's adapters are GGUF files (`convert_lora_to_gguf.py`) with `general.type` "adapter",
`adapter.type` "lora", `adapter.lora.alpha`, the base's `general.architecture`, and for each
adapted weight `<tensor>.lora_a` (ggml shape [n_in, rank]) and `<tensor>.lora_b` ([rank, n_out]).
A file that is none of that, or whose tensors do not match the base's, makes llama-server exit
at start; refused here, on the node, by name, the base replica starts without it instead.

The walk is `fit`'s bounded GGUF walk (every count and length checked against the file's size
before use) keeping a little more: the three keys above and the adapted tensors' shapes.

    FitError            (llmgw_core.fit) the file cannot be read as a GGUF
    ├── HeaderError     (llmgw_core.fit) a header that breaks the format or llmgw's bounds
    └── AdapterError    a well-formed GGUF that is not a LoRA adapter, or not one for this base
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from msgspec import Struct

from .fit import (
    _GGUF_MAX_NAME,
    _GGUF_SCALARS,
    _GGUF_STRING,
    FitError,
    _ggml_sizes,
    _gguf_splits,
    _GgufWalk,
    _name,
    _Window,
    figure,
)

__all__ = ["RANK_MAX", "AdapterError", "AdapterHeader", "adapter_header", "fit_problem", "read_adapter"]

# The largest LoRA rank llmgw serves (published adapters use 8 to 256).
RANK_MAX = 8192
# Adapted weights one adapter may name (every 2-D weight of a 1,000-layer model is far less).
PAIRS_MAX = 1 << 14
# How long a text value the adapter keys may be.
_TEXT_MAX = 64
_LORA = (".lora_a", ".lora_b")


class AdapterError(FitError):
    """A GGUF that is not a LoRA adapter, or not one for the base it is named for."""


class AdapterHeader(Struct, frozen=True, kw_only=True):
    architecture: str
    alpha: float
    # The largest rank of its adapted weights.
    rank: int
    # Each adapted weight of the base: (n_in, n_out), as the base's tensor must have it.
    shapes: dict[str, tuple[int, int]]


class _AdapterWalk(_GgufWalk):
    """`fit`'s walk, keeping the adapter's keys, and the 2-D shapes of the tensors named in
    `wanted` (None: those ending in .lora_a or .lora_b)."""

    def __init__(self, buf: bytes | _Window, where: Path, wanted: frozenset[str] | None) -> None:
        super().__init__(buf, where, _ggml_sizes())
        self.wanted = wanted
        self.texts: dict[str, str] = {}
        self.alpha: float | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}

    def pair(self) -> None:
        start = self.pos
        key = self.string("a key", _GGUF_MAX_NAME)
        if key in ("general.type", "adapter.type"):
            kind = self.unpack("I", f"type of {key}")
            if kind != _GGUF_STRING:
                raise self.error(f"{key} is not a string")
            text = self.string(key, _TEXT_MAX)
            if text is None:
                raise self.error(f"{key} is longer than {_TEXT_MAX} bytes")
            self.texts[key] = text
            return
        if key == "adapter.lora.alpha":
            kind = self.unpack("I", f"type of {key}")
            fmt = _GGUF_SCALARS.get(kind)
            if fmt is None or fmt in ("?",):
                raise self.error(f"{key} is not a number")
            self.alpha = float(self.unpack(fmt, key))
            return
        self.pos = start
        super().pair()

    def tensor(self, name: str, shape: tuple[int, ...]) -> None:
        keep = name.endswith(_LORA) if self.wanted is None else name in self.wanted
        if keep:
            if len(self.shapes) >= 2 * PAIRS_MAX:
                raise self.error(f"more than {PAIRS_MAX:,} adapted weights")
            self.shapes[name] = shape


def _walk(buf: bytes | _Window, where: Path, wanted: frozenset[str] | None) -> _AdapterWalk:
    walk = _AdapterWalk(buf, where, wanted)
    try:
        walk.walk()
    except struct.error as exc:  # a bounds check missed: still the reader's own error
        raise walk.error(f"cannot be read: {exc}") from exc
    except (OverflowError, ValueError) as exc:  # a float alpha of NaN stays; these do not
        raise walk.error(f"cannot be read: {exc}") from exc
    return walk


def adapter_header(buf: bytes | _Window, where: Path) -> AdapterHeader:
    """`buf` (a file's bytes, or a window on them) read as a LoRA adapter: FitError (or one of
    its kinds) for anything else, never another exception."""
    return _checked(_walk(buf, where, None), where)


def _checked(walk: _AdapterWalk, where: Path) -> AdapterHeader:
    kind = walk.texts.get("general.type")
    if kind != "adapter":
        said = "no general.type" if kind is None else f"general.type {_name(kind)}"
        raise AdapterError(f"{where}: not an adapter ({said}; a LoRA adapter's is 'adapter')")
    lora = walk.texts.get("adapter.type")
    if lora != "lora":
        said = "no adapter.type" if lora is None else f"adapter.type {_name(lora)}"
        raise AdapterError(f"{where}: not a LoRA adapter ({said}; llmgw serves 'lora' adapters)")
    if walk.arch is None:
        raise AdapterError(f"{where}: no general.architecture; cannot tell which base it fits")
    alpha = walk.alpha
    if alpha is None or not -1e6 <= alpha <= 1e6:  # NaN fails both
        raise AdapterError(f"{where}: adapter.lora.alpha is {'missing' if alpha is None else alpha}")
    shapes: dict[str, tuple[int, int]] = {}
    rank = 0
    for name, a in sorted(walk.shapes.items()):
        if not name.endswith(".lora_a"):
            continue
        weight = name[: -len(".lora_a")]
        b = walk.shapes.get(f"{weight}.lora_b")
        if b is None:
            raise AdapterError(f"{where}: tensor {_name(name)} has no {_name(weight + '.lora_b')} beside it")
        if len(a) != 2 or len(b) != 2:
            raise AdapterError(f"{where}: the LoRA tensors of {_name(weight)} are not 2-D")
        if a[1] != b[0]:
            raise AdapterError(
                f"{where}: {_name(weight)}: lora_a's rank {figure(a[1])} is not lora_b's {figure(b[0])}"
            )
        if not 1 <= a[1] <= RANK_MAX:
            raise AdapterError(
                f"{where}: {_name(weight)} has rank {figure(a[1])}; llmgw serves ranks 1 to {RANK_MAX:,}"
            )
        rank = max(rank, a[1])
        shapes[weight] = (a[0], b[1])
    unpaired = sorted(n for n in walk.shapes if n.endswith(".lora_b") and n[:-7] not in shapes)
    if unpaired:
        raise AdapterError(f"{where}: tensor {_name(unpaired[0])} has no lora_a beside it")
    if not shapes:
        raise AdapterError(f"{where}: no .lora_a/.lora_b tensors; the adapter changes nothing")
    return AdapterHeader(architecture=walk.arch, alpha=alpha, rank=rank, shapes=shapes)


def _read(path: Path, wanted: frozenset[str] | None) -> _AdapterWalk:
    if not path.is_file():
        raise FitError(f"{path}: not a regular file")
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise FitError(f"{path}: {size} bytes; not a GGUF file")
        return _walk(_Window(f.fileno(), size, path), path, wanted)


def read_adapter(path: Path) -> AdapterHeader:
    """The adapter file at `path`, read and checked (`adapter_header`)."""
    return _checked(_read(path, None), path)


def fit_problem(header: AdapterHeader, base: Path) -> str | None:
    """Why the adapter `header` cannot be applied to the base model at `base` (a GGUF file, its
    first part if split); None when it can. FitError where the base cannot be read."""
    wanted = frozenset(header.shapes)
    parts = [_read(part, wanted) for part in _gguf_splits(base)]
    walk = parts[0]
    for part in parts[1:]:
        walk.shapes.update(part.shapes)
    if walk.arch != header.architecture:
        return (
            f"the adapter is for architecture {_name(header.architecture)}, the base {base.name} is "
            f"{_name(walk.arch or 'unknown')}"
        )
    for weight, (n_in, n_out) in sorted(header.shapes.items()):
        have = walk.shapes.get(weight)
        if have is None:
            return f"the adapter changes tensor {_name(weight)}, which the base {base.name} does not have"
        if len(have) < 2 or (have[0], have[1]) != (n_in, n_out):
            return (
                f"the adapter's {_name(weight)} is {figure(n_in)} x {figure(n_out)}, the base's is "
                + " x ".join(figure(d) for d in have)
            )
    return None
