"""Whether a model fits a GPU, from the weights' own metadata, before any engine starts.

Two halves, kept apart so placement can decide without the files:

- `read_shape(path)` (an effect, on the node that holds the weights) reads only
  metadata: a GGUF's header (tensor sizes and types, the architecture's layer
  and head counts, its trained context), or each `.safetensors` file's header
  (the 8-byte length and the JSON after it, never a tensor's bytes) with the
  directory's `config.json`. It returns a `ModelShape`, a plain Struct that can
  travel on the bus.
- `estimate(shape, profile)` and `check(est, gpu, gpu_class, profile)` are pure:
  the memory one GPU of a shard needs (the weights split over TP x PP, plus the
  KV cache for the profile's context length in its cache dtype) and, against a
  GPU's usable memory, `None` or the refusal in figures:
  `needs ~23.7 GiB per GPU (weights 35.1 GiB / TP 2 + KV cache 6.1 GiB at 32k
  context), L40S-48G has 44.5 GiB usable`.

The estimate counts what the engines allocate up front for a model (llama.cpp's
model and KV buffers, vLLM's weights and one full-length sequence of KV cache),
not activations or the compute buffer, which the usable figure leaves room for.

A header is outside bytes (a hub's, a peer's): every count, dimension, offset and
length in it is checked against the file's size and the bounds of a `ModelShape`
before it is used, strings are read to a limit, and no error quotes more than a
clipped piece of it. Reading a header costs a bounded amount of memory and time
whatever it holds (the GGUF reader walks the header itself, skipping what it does
not need by its length; the `gguf` package would read every string and array).

Errors:

    FitError          the shape cannot be told or used; never retryable, the same
    │                 bytes give the same answer (a config without the counts the
    │                 cache needs, a file that is not a model)
    └── HeaderError   a header that breaks its format or llmgw's bounds: a broken
                      or hostile file, which no engine should be started on
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
from msgspec import Struct

from .engines import GPUInfo, Profile
from .events import MODEL_MAX_BYTES, MODEL_MAX_COUNT, MODEL_MAX_DTYPE, MODEL_MAX_TOKENS, ModelShape

__all__ = [
    "Estimate",
    "FitError",
    "HeaderError",
    "ModelShape",
    "check",
    "check_host",
    "check_shard",
    "estimate",
    "figure",
    "read_shape",
    "shape_problem",
]

GiB = 1024**3
MiB = 1024**2

# What a GPU keeps for itself before an engine allocates a model: the CUDA context and
# cuBLAS workspaces (about 300-500 MiB), and the engine's compute buffer for a batch.
# Without it a model that fills the card to the byte is placed and fails to allocate.
RESERVE_MB = 512

# The share of a GPU vLLM and SGLang take unless the profile says otherwise
# (`--gpu-memory-utilization`, `--mem-fraction-static`); llama.cpp takes what it needs.
DEFAULT_FRACTION = {"vllm": 0.9, "sglang": 0.88}

# Bytes per element of a cache or weight dtype as the engines spell it. Block-quantised
# cache types are bytes per block over elements per block (q8_0: 34 bytes per 32).
_DTYPE_BYTES: dict[str, float] = {
    "f32": 4,
    "float32": 4,
    "float": 4,
    "f16": 2,
    "float16": 2,
    "half": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
}

# safetensors' dtypes, as its header names them.
_ST_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
_ST_FLOATS = {"F64", "F32", "F16", "BF16"}

# A safetensors header longer than this is not a header (a file that is not safetensors).
_MAX_HEADER = 100 * MiB
# What one safetensors header is read to: the biggest checkpoints' headers are a few MiB
# (a few thousand tensors per file). Its tensors are counted (by their opening braces)
# before any is decoded, so a header of tiny entries cannot cost more than these many.
_MAX_HEADER_READ = 16 * MiB
_MAX_TENSORS = 1 << 17
_MAX_RANK = 16
# config.json and the safetensors index are read to these sizes (a config is a few KiB; the
# index of a 600B model names ~100k tensors in ~10 MiB); the index names at most these files.
_MAX_CONFIG = 4 * MiB
_MAX_INDEX = 64 * MiB
_MAX_FILES = 1 << 16
# How much of a header's text or a name an error quotes.
_QUOTE = 80
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class FitError(Exception):
    """Weights whose metadata cannot be read, or lack what the estimate needs."""

    retryable = False


class HeaderError(FitError):
    """A header that breaks its format's rules or llmgw's bounds (an offset past the file, a
    count no model has): a broken or hostile file. A shard of it fails once, not retried."""


class Estimate(Struct, frozen=True, kw_only=True):
    """The memory one GPU of a shard needs, with the figures it is made of."""

    weight_bytes: int
    split: int
    split_label: str
    kv_bytes_per_gpu: int
    context: int
    cache_dtype: str
    kv_bytes_per_token: float

    @property
    def weights_per_gpu(self) -> int:
        return -(-self.weight_bytes // self.split)

    @property
    def per_gpu(self) -> int:
        return self.weights_per_gpu + self.kv_bytes_per_gpu

    def text(self, per: str = "per GPU") -> str:
        split = f" / {self.split_label}" if self.split > 1 else ""
        return (
            f"needs ~{gib(self.per_gpu)} GiB {per} (weights {gib(self.weight_bytes)} GiB{split}"
            f" + KV cache {gib(self.kv_bytes_per_gpu)} GiB at {context_label(self.context)} context)"
        )


def gib(n: float) -> str:
    return f"{n / GiB:.1f}"


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 and tokens % 1024 == 0 else str(tokens)


def figure(n: int) -> str:
    """An integer from outside as an error quotes it: `4,104`, or `10**400` / `over 10**400`
    for one too long to print (a 1,000,000-digit number costs seconds to print, and Python
    refuses past 4,300 digits)."""
    if -(10**21) < n < 10**21:
        return f"{n:,}"
    sign, m = ("-", -n) if n < 0 else ("", n)
    k = int(math.log10(m))
    while 10**k > m:  # log10 of a big int rounds up near a power of ten
        k -= 1
    return f"{sign}10**{k}" if 10**k == m else f"{sign}over 10**{k}"


def _clip(text: str, most: int = _QUOTE) -> str:
    return text if len(text) <= most else f"{text[:most]}… ({len(text):,} characters)"


def _name(raw: str) -> str:
    """A name from a header as an error quotes it: clipped, in quotes, control characters escaped."""
    return repr(_clip(raw))


# ---- the shape's bounds ----

_BOUNDS = {
    "weight_bytes": MODEL_MAX_BYTES,
    "n_layer": MODEL_MAX_COUNT,
    "n_head_kv": MODEL_MAX_COUNT,
    "head_dim_k": MODEL_MAX_COUNT,
    "head_dim_v": MODEL_MAX_COUNT,
    "context_length": MODEL_MAX_TOKENS,
    "float_params": MODEL_MAX_BYTES,
    "other_bytes": MODEL_MAX_BYTES,
}


def shape_problem(shape: ModelShape) -> str | None:
    """What makes `shape` unusable (a figure outside the bounds `ModelShape` decodes with), else
    None. A shape decoded from the bus is within them; one built in memory may not be."""
    if shape.format not in ("gguf", "safetensors"):
        return f"format {_name(str(shape.format))} is neither gguf nor safetensors"
    for field, most in _BOUNDS.items():
        value = getattr(shape, field)
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{field} is not an integer"
        if not 0 <= value <= most:
            return f"{field} {figure(value)} is outside 0 to {figure(most)}"
    if not isinstance(shape.dtype, str) or len(shape.dtype) > MODEL_MAX_DTYPE:
        return f"dtype is not a name of at most {MODEL_MAX_DTYPE} characters"
    return None


def _checked(where: object, shape: ModelShape) -> ModelShape:
    problem = shape_problem(shape)
    if problem is not None:
        raise HeaderError(f"{where}: {problem}")
    return shape


# ---- reading the metadata (the only effects here) ----


def read_shape(path: str | Path) -> ModelShape:
    """The shape of the model at `path`: a `.gguf` file (its other splits found beside it),
    a `.safetensors` file, or a directory with `config.json` and `.safetensors` files.

    Raises FitError (HeaderError for a header that breaks its format or the bounds); never
    another exception, whatever the files hold."""
    p = Path(path)
    try:
        if p.is_dir():
            if (p / "config.json").is_file():
                return _read_safetensors_dir(p)
            ggufs = _listed(p, "*.gguf")
            if ggufs:
                return _read_gguf(ggufs[0])
            raise FitError(f"{p}: no config.json and no .gguf file; cannot tell the model's shape")
        if p.suffix == ".gguf":
            return _read_gguf(p)
        if p.suffix == ".safetensors":
            return _read_safetensors_dir(p.parent, files=[p])
    except OSError as exc:
        raise FitError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    raise FitError(f"{p}: neither a .gguf nor a .safetensors file nor a model directory")


def _listed(directory: Path, pattern: str) -> list[Path]:
    found: list[Path] = []
    for f in directory.glob(pattern):
        if f.is_file():
            found.append(f)
            if len(found) > _MAX_FILES:
                raise HeaderError(f"{directory}: more than {_MAX_FILES:,} {pattern} files")
    return sorted(found)


def _regular(path: Path) -> None:
    """Only a regular file is opened: a FIFO or a device under a model's name would block the
    reader for ever or feed it without end."""
    if not path.is_file():
        raise FitError(f"{path}: not a regular file")


# -- GGUF --

# A GGUF header (its key-value pairs and tensor infos) ends within this many bytes of the
# file's start: the biggest vocabularies (256k tokens, their scores and merges) take ~20 MiB.
_GGUF_MAX_HEADER = 128 * MiB
_GGUF_MAX_KV = 1 << 16
_GGUF_MAX_TENSORS = 1 << 18
# Elements of string arrays walked per file (each is a length and its bytes, skipped one by
# one): a vocabulary and its merges are under 1M; this bounds the walk to seconds.
_GGUF_MAX_ITEMS = 1 << 22
_GGUF_MAX_DEPTH = 4
# A per-layer count is an array of one value per layer.
_GGUF_MAX_LAYERS = 1 << 16
_GGUF_MAX_KEY = 1 << 16
_GGUF_MAX_NAME = 1 << 10
_GGUF_MAX_ARCH = 64
_GGML_MAX_DIMS = 4
# Fixed-size value types (GGUFValueType): struct format and size. 8 is a string, 9 an array.
_GGUF_SCALARS: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_GGUF_INTS = {0, 1, 2, 3, 4, 5, 10, 11}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# The keys the estimate reads, by the part after `<architecture>.`.
_GGUF_COUNTS = (
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "block_count",
    "context_length",
)


def _ggml_sizes() -> dict[int, tuple[int, int]]:
    """ggml's tensor types: elements per block and bytes per block, from the `gguf` package
    (a dependency of llmgw-core; imported here, not at the top: it brings numpy, which
    placement, importing this module for the estimate, never needs)."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): (int(block), int(size)) for t, (block, size) in GGML_QUANT_SIZES.items()}


class _Window:
    """A file's bytes read through one window of `_WINDOW` bytes at a time (`os.pread`): what a
    header walk reads of a file it never holds whole. Not mapped: a file truncated under a
    mapping (a model copied over while the probe reads it) kills the reader with SIGBUS."""

    def __init__(self, fd: int, size: int, where: Path) -> None:
        self.fd = fd
        self.size = size
        self.where = where
        self.start = 0
        self.data = b""

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        at, end = span.start or 0, span.stop
        if not self.start <= at <= end <= self.start + len(self.data):
            self.start, self.data = at, os.pread(self.fd, max(end - at, _WINDOW), at)
        got = self.data[at - self.start : end - self.start]
        if len(got) != end - at:
            raise HeaderError(f"{self.where}: the file changed while its header was read (at byte {at:,})")
        return got


_WINDOW = 1 << 20


class _GgufWalk:
    """One bounded pass over a GGUF file's header (v2/v3: magic, version, tensor and key-value
    counts, the typed key-value pairs, the tensor infos), over `buf` (the file's bytes, or a
    `_Window` on them). It keeps only the architecture, the counts the estimate needs and the
    alignment, and skips every other value by its length; every count and offset is checked
    against the file's size."""

    def __init__(self, buf: bytes | _Window, where: Path, sizes: dict[int, tuple[int, int]]) -> None:
        self.buf = buf
        self.size = len(buf)
        self.end = min(self.size, _GGUF_MAX_HEADER)
        self.where = where
        self.sizes = sizes
        self.pos = 0
        self.order = "<"
        self.items = 0
        self.arch: str | None = None
        self.alignment = 32
        # Every integer (or array of integers: its largest) under a key ending in a count's name,
        # and why such a key is not one (an error only where the estimate reads that key: another
        # architecture's keys may end alike).
        self.counts: dict[str, int | None] = {}
        self.bad: dict[str, str] = {}
        self.weight_bytes = 0
        self.most_end = 0

    def error(self, what: str) -> HeaderError:
        return HeaderError(f"{self.where}: GGUF header: {what}")

    def need(self, n: int, what: str) -> int:
        """The offset of the next `n` bytes of the header, taken."""
        if n > self.end - self.pos:
            if self.pos + n > self.size:
                raise self.error(
                    f"{what} ({figure(n)} bytes at {self.pos:,}) runs past the file's {self.size:,} bytes"
                )
            raise self.error(
                f"{what} runs past {_GGUF_MAX_HEADER // MiB} MiB; no model's header is that long"
            )
        at = self.pos
        self.pos += n
        return at

    def unpack(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        at = self.need(size, what)
        return struct.unpack(self.order + fmt, self.buf[at : at + size])[0]

    def string(self, what: str, most: int) -> str | None:
        """A GGUF string (u64 length, bytes): its text when at most `most` bytes long, else
        skipped (None)."""
        n = self.unpack("Q", f"length of {what}")
        at = self.need(n, what)
        if n > most:
            return None
        try:
            return bytes(self.buf[at : at + n]).decode()
        except UnicodeDecodeError:
            raise self.error(f"{what} is not UTF-8") from None

    def walk(self) -> None:
        magic = self.buf[self.need(4, "magic") : 4]
        if magic != b"GGUF":
            # Not a GGUF at all (a file of another kind under the name): not a model llmgw can
            # size, but no header claiming to be one either.
            raise FitError(f"{self.where}: no GGUF magic; not a GGUF file")
        raw = self.buf[self.need(4, "version") : 8]
        (version,) = struct.unpack("<I", raw)
        if version & 0xFFFF == 0:  # written big-endian
            self.order = ">"
            (version,) = struct.unpack(">I", raw)
        if version not in (2, 3):
            raise self.error(f"version {figure(version)}; llmgw reads GGUF versions 2 and 3")
        n_tensors = self.unpack("Q", "tensor count")
        n_kv = self.unpack("Q", "key-value count")
        # Each pair takes 12 bytes at least, each tensor info 24: counts the file cannot hold are
        # refused before a loop runs on them.
        if n_kv > _GGUF_MAX_KV or n_kv * 12 > self.size - self.pos:
            raise self.error(
                f"key-value count {figure(n_kv)} is more than the file's {self.size:,} bytes hold"
            )
        if n_tensors > _GGUF_MAX_TENSORS or n_tensors * 24 > self.size - self.pos:
            raise self.error(
                f"tensor count {figure(n_tensors)} is more than the file's {self.size:,} bytes hold"
            )
        for _ in range(n_kv):
            self.pair()
        infos_end = self.tensor_infos(n_tensors)
        self.check_data(infos_end)

    def pair(self) -> None:
        key = self.string("a key", _GGUF_MAX_KEY)
        if key is None:
            raise self.error(f"a key longer than {_GGUF_MAX_KEY:,} bytes")
        kind = self.unpack("I", f"type of {_name(key)}")
        if key == "general.architecture":
            if kind != _GGUF_STRING:
                raise self.error("general.architecture is not a string")
            length = self.unpack("Q", "length of general.architecture")
            if length > _GGUF_MAX_ARCH:
                raise self.error(
                    f"general.architecture is {figure(length)} bytes long; an architecture's name "
                    f"is at most {_GGUF_MAX_ARCH}"
                )
            self.pos -= 8
            self.arch = self.string("general.architecture", _GGUF_MAX_ARCH)
            return
        if key == "general.alignment":
            if kind not in _GGUF_INTS:
                raise self.error("general.alignment is not an integer")
            align = self.unpack(_GGUF_SCALARS[kind], "general.alignment")
            if not 1 <= align <= 1 << 16 or align & (align - 1):
                raise self.error(f"general.alignment {figure(align)} is not a power of two up to 65,536")
            self.alignment = align
            return
        if key.endswith(_GGUF_COUNTS) and len(self.counts) + len(self.bad) < 64:
            if kind in _GGUF_INTS or (kind == _GGUF_ARRAY and self.int_array()):
                self.counts[key] = self.count(key, kind)
                return
            self.bad[key] = f"{_name(key)} is not an integer"
        self.skip(kind, _name(key), 0)

    def int_array(self) -> bool:
        """Whether the array that starts here holds integers (its element type, peeked)."""
        at = self.need(4, "an array's element type")
        self.pos = at
        return struct.unpack(self.order + "I", self.buf[at : at + 4])[0] in _GGUF_INTS

    def count(self, key: str, kind: int) -> int | None:
        """An integer, or the largest of an array of them (a per-layer count); None for an empty one."""
        if kind in _GGUF_INTS:
            return int(self.unpack(_GGUF_SCALARS[kind], key))
        elem = self.unpack("I", f"element type of {_name(key)}")
        n = self.unpack("Q", f"length of {_name(key)}")
        if n > _GGUF_MAX_LAYERS:
            raise self.error(f"{_name(key)} has {figure(n)} values; a per-layer count has one per layer")
        fmt = _GGUF_SCALARS[elem]
        width = struct.calcsize(fmt)
        at = self.need(n * width, _name(key))
        if not n:
            return None
        values: list[int] = [
            v for (v,) in struct.iter_unpack(self.order + fmt, self.buf[at : at + n * width])
        ]
        return max(values)

    def skip(self, kind: int, what: str, depth: int) -> None:
        """Past one value of type `kind`, reading only lengths."""
        fmt = _GGUF_SCALARS.get(kind)
        if fmt is not None:
            self.need(struct.calcsize(fmt), what)
            return
        if kind == _GGUF_STRING:
            self.need(self.unpack("Q", f"length of {what}"), what)
            return
        if kind != _GGUF_ARRAY:
            raise self.error(f"{what} has value type {figure(kind)}, which GGUF does not define")
        if depth >= _GGUF_MAX_DEPTH:
            raise self.error(f"{what} nests arrays deeper than {_GGUF_MAX_DEPTH}")
        elem = self.unpack("I", f"element type of {what}")
        n = self.unpack("Q", f"length of {what}")
        fmt = _GGUF_SCALARS.get(elem)
        if fmt is not None:
            self.need(n * struct.calcsize(fmt), what)
            return
        # Strings and arrays are 8 bytes at least each: a count the file cannot hold is refused
        # before the walk, and the walk over all of them is bounded (`_GGUF_MAX_ITEMS`).
        if n * 8 > self.end - self.pos:
            raise self.error(
                f"{what} has {figure(n)} elements, more than the file's {self.size:,} bytes hold"
            )
        self.items += n
        if self.items > _GGUF_MAX_ITEMS:
            raise self.error(f"more than {_GGUF_MAX_ITEMS:,} strings and arrays in arrays")
        if elem == _GGUF_STRING:
            self.skip_strings(n, what)
            return
        for _ in range(n):
            self.skip(elem, what, depth + 1)

    def skip_strings(self, n: int, what: str) -> None:
        """Past `n` strings (a vocabulary: hundreds of thousands), a window of the file at a
        time, in a tight loop: one call per string cost seconds per header."""
        unpack = struct.Struct(self.order + "Q").unpack_from
        pos, end = self.pos, self.end
        while n:
            chunk = self.buf[pos : min(end, pos + _WINDOW)]
            size, off = len(chunk), 0
            while n and off + 8 <= size:
                (length,) = unpack(chunk, off)
                off += 8 + length
                n -= 1
                if off > size:
                    break
            if not off:  # not even the next length is left before the end
                self.pos = pos
                self.need(8, f"length of a string in {what}")
            if pos + off > end:
                self.pos = pos + off - length
                self.need(length, f"a string in {what}")
            pos += off
        self.pos = pos

    def tensor_infos(self, n: int) -> int:
        """Every tensor's bytes (ggml's type and dimensions), summed; the end of the infos."""
        most_end = 0
        for i in range(n):
            name = self.string(f"the name of tensor {i}", _GGUF_MAX_NAME)
            if name is None:
                raise self.error(f"the name of tensor {i} is longer than {_GGUF_MAX_NAME:,} bytes")
            dims = self.unpack("I", f"dimensions of tensor {_name(name)}")
            if dims > _GGML_MAX_DIMS:
                raise self.error(f"tensor {_name(name)} has {figure(dims)} dimensions; ggml has at most 4")
            shape = []
            numel = 1
            for _ in range(dims):
                shape.append(self.unpack("Q", f"a dimension of tensor {_name(name)}"))
                numel *= shape[-1]
                if numel > MODEL_MAX_BYTES:
                    raise self.error(f"tensor {_name(name)} has more than {figure(MODEL_MAX_BYTES)} elements")
            kind = self.unpack("I", f"type of tensor {_name(name)}")
            offset = self.unpack("Q", f"offset of tensor {_name(name)}")
            if kind not in self.sizes:
                raise self.error(f"tensor {_name(name)} has type {figure(kind)}, which ggml does not define")
            block, size = self.sizes[kind]
            n_bytes = numel * size // block
            self.weight_bytes += n_bytes
            most_end = max(most_end, offset + n_bytes)
            self.tensor(name, tuple(shape))
        self.most_end = most_end
        return self.pos

    def tensor(self, name: str, shape: tuple[int, ...]) -> None:
        """One tensor's name and dimensions, as read (bounded): for a walk that keeps some."""

    def check_data(self, infos_end: int) -> None:
        """Every tensor lies within the file, and they hold no more bytes than it does."""
        start = -(-infos_end // self.alignment) * self.alignment
        data = max(0, self.size - start)
        if self.most_end > data:
            raise self.error(
                f"tensor data runs to {figure(self.most_end)} bytes past the header, "
                f"past the {data:,} bytes the file holds there"
            )
        if self.weight_bytes > data:
            raise self.error(
                f"tensors of {figure(self.weight_bytes)} bytes in all, "
                f"more than the file's {data:,} bytes of data"
            )


def read_gguf_header(
    buf: bytes | _Window, where: Path, sizes: dict[int, tuple[int, int]] | None = None
) -> _GgufWalk:
    """One GGUF header walked over `buf` (the file's bytes, or a window on them): HeaderError
    for anything that breaks the format or the bounds, FitError for a file that is not a GGUF,
    never another exception."""
    walk = _GgufWalk(buf, where, _ggml_sizes() if sizes is None else sizes)
    try:
        walk.walk()
    except struct.error as exc:  # a bounds check missed: still the reader's own error
        raise walk.error(f"cannot be read: {exc}") from exc
    return walk


def _read_gguf(path: Path) -> ModelShape:
    sizes = _ggml_sizes()
    parts = _gguf_splits(path)
    weight_bytes = 0
    first: _GgufWalk | None = None
    for part in parts:
        _regular(part)
        with part.open("rb") as f:
            size = part.stat().st_size
            if size < 24:
                raise FitError(f"{part}: {size} bytes; not a GGUF file")
            walk = read_gguf_header(_Window(f.fileno(), size, part), part, sizes)
        first = first or walk
        weight_bytes += walk.weight_bytes
        if weight_bytes > MODEL_MAX_BYTES:
            raise HeaderError(f"{path}: weights of over {figure(MODEL_MAX_BYTES)} bytes")
    assert first is not None
    return _gguf_shape(first, path, weight_bytes)


def _gguf_shape(walk: _GgufWalk, path: Path, weight_bytes: int) -> ModelShape:
    arch = walk.arch
    if arch is None:
        raise FitError(f"{path}: no general.architecture in the GGUF header")

    def count(key: str, default: int | None = None) -> int:
        bad = walk.bad.get(f"{arch}.{key}")
        if bad is not None:
            raise HeaderError(f"{path}: GGUF header: {bad}")
        v = walk.counts.get(f"{arch}.{key}")
        if v is None:
            if default is None:
                raise FitError(f"{path}: no {arch}.{key} in the GGUF header; cannot size the KV cache")
            return default
        if not 0 <= v <= MODEL_MAX_TOKENS:
            raise HeaderError(
                f"{path}: GGUF header: {arch}.{key} {figure(v)} is outside 0 to {figure(MODEL_MAX_TOKENS)}"
            )
        return v

    n_embd = count("embedding_length")
    n_head = count("attention.head_count")
    n_head_kv = count("attention.head_count_kv", n_head)
    head_k = count("attention.key_length", n_embd // max(n_head, 1))
    return _checked(
        f"{path}: GGUF header",
        ModelShape(
            format="gguf",
            weight_bytes=weight_bytes,
            n_layer=count("block_count"),
            n_head_kv=n_head_kv,
            head_dim_k=head_k,
            head_dim_v=count("attention.value_length", head_k),
            context_length=count("context_length", 0),
        ),
    )


def _gguf_splits(path: Path) -> list[Path]:
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        named = ", ".join(missing[:5]) + (f" and {len(missing) - 5:,} more" if len(missing) > 5 else "")
        raise FitError(f"{path}: split GGUF is missing {named} beside it")
    return parts


# -- safetensors --


class _Tensor(Struct, frozen=True):
    """One entry of a safetensors header. `__metadata__` decodes as one too (its strings are
    unknown fields, ignored), and is skipped by name."""

    dtype: str = ""
    shape: list[int] = []
    data_offsets: tuple[int, int] | None = None


_header_decoder = msgspec.json.Decoder(dict[str, _Tensor])


def safetensors_header(path: Path) -> tuple[dict[str, _Tensor], int]:
    """A safetensors file's header (its first 8 bytes, little-endian, are the JSON's length)
    and the bytes of tensor data after it."""
    _regular(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        raw = f.read(8)
        # Until its header decodes as a JSON object, a file is not taken for a safetensors file
        # (FitError); past that, what breaks the format or the bounds is a HeaderError.
        if len(raw) != 8:
            raise FitError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise FitError(f"{path}: header length {n} is not plausible; not a safetensors file")
        if n > size - 8:
            raise FitError(f"{path}: header length {n:,} runs past the file's {size:,} bytes")
        if n > _MAX_HEADER_READ:
            raise HeaderError(
                f"{path}: header of {n:,} bytes; llmgw reads headers up to {_MAX_HEADER_READ // MiB} MiB"
            )
        text = f.read(n)
    return parse_safetensors_header(text, path), size - 8 - n


def parse_safetensors_header(text: bytes, where: Path) -> dict[str, _Tensor]:
    """The header's JSON, decoded to its tensors: HeaderError for one that is not a
    safetensors header, never another exception."""
    if not text.lstrip().startswith(b"{"):
        raise FitError(f"{where}: header is not a JSON object; not a safetensors file")
    if text.count(b"{") > _MAX_TENSORS + 2:
        raise HeaderError(f"{where}: header of more than {_MAX_TENSORS:,} tensors")
    try:
        return _header_decoder.decode(text)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise HeaderError(f"{where}: header is not a safetensors header: {_clip(str(exc), 200)}") from None
    except RecursionError:
        raise HeaderError(f"{where}: header nests too deep; not a safetensors header") from None


def _tensor_figures(name: str, t: _Tensor, data: int, where: Path) -> tuple[int, int, int]:
    """Of one tensor of a header: its elements, its stored bytes, and where its data ends, each
    checked against the bounds and the `data` bytes the file holds after its header."""

    def bad(what: str) -> HeaderError:
        return HeaderError(f"{where}: safetensors header: tensor {_name(name)}: {what}")

    if t.data_offsets is None:
        raise bad("no data_offsets")
    if len(t.shape) > _MAX_RANK:
        raise bad(f"{len(t.shape):,} dimensions; llmgw reads at most {_MAX_RANK}")
    numel = 1
    for d in t.shape:
        if d < 0:
            raise bad(f"a dimension of {figure(d)}")
        numel *= d
        if numel > MODEL_MAX_BYTES:
            raise bad(f"more than {figure(MODEL_MAX_BYTES)} elements")
    start, end = t.data_offsets
    if not 0 <= start <= end:
        raise bad(f"data_offsets [{figure(start)}, {figure(end)}]")
    if end > data:
        raise bad(f"data_offsets end {figure(end)} past the file's {data:,} bytes of data")
    width = _ST_BYTES.get(t.dtype)
    if width is not None and numel * width != end - start:
        held = end - start
        raise bad(
            f"{numel:,} elements of {t.dtype} are {numel * width:,} bytes, its data_offsets hold {held:,}"
        )
    return numel, end - start, end


def _read_safetensors_dir(directory: Path, files: list[Path] | None = None) -> ModelShape:
    # The headers first: a hostile one is refused as such even where config.json is missing
    # (a single file staged alone).
    if files is None:
        files = _weight_files(directory)
    if not files:
        raise FitError(f"{directory}: no .safetensors files")
    float_params = other = stored = 0
    for path in files:
        header, data = safetensors_header(path)
        in_file = 0
        for name, t in header.items():
            if name == "__metadata__":
                continue
            numel, n_bytes, _end = _tensor_figures(name, t, data, path)
            in_file += n_bytes
            if t.dtype in _ST_FLOATS:
                float_params += numel
            else:
                other += n_bytes
        if in_file > data:
            raise HeaderError(
                f"{path}: tensors of {figure(in_file)} bytes in all, more than the file's {data:,}"
            )
        stored += in_file
        if stored > MODEL_MAX_BYTES or float_params > MODEL_MAX_BYTES:
            raise HeaderError(f"{directory}: weights of over {figure(MODEL_MAX_BYTES)} bytes")
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FitError(f"{config_path}: missing; the KV cache cannot be sized without it")
    config = _json_object(config_path, _MAX_CONFIG)
    return _shape_of_config(config, config_path, stored, float_params, other)


def _json_object(path: Path, most: int) -> dict[str, Any]:
    """A small JSON file's object, read to `most` bytes."""
    _regular(path)
    with path.open("rb") as f:
        raw = f.read(most + 1)
    if len(raw) > most:
        raise HeaderError(f"{path}: over {most // MiB} MiB; not a model's {path.name}")
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise FitError(f"{path}: not readable JSON: {_clip(str(exc), 200)}") from None
    except RecursionError:
        raise FitError(f"{path}: not readable JSON: it nests too deep") from None
    if not isinstance(value, dict):
        raise FitError(f"{path}: not a JSON object")
    return value


def _weight_files(directory: Path) -> list[Path]:
    # A repository may hold one model twice (`consolidated.safetensors` beside
    # `model-0000x-of-0000y.safetensors`); the index names the files the engines load.
    index = directory / "model.safetensors.index.json"
    if not index.exists():
        return _listed(directory, "*.safetensors")
    weight_map = _json_object(index, _MAX_INDEX).get("weight_map")
    if not isinstance(weight_map, dict):
        raise FitError(f"{index}: not a safetensors index (no weight_map)")
    names = set()
    for name in weight_map.values():
        # Each one a file of the directory (or under it): a name that climbs out of it
        # (`../../etc/shadow`, `/dev/zero`) is refused, never opened.
        rel = PurePosixPath(name) if isinstance(name, str) else None
        if (
            rel is None
            or rel.is_absolute()
            or ".." in rel.parts
            or not rel.parts
            or "\\" in name
            or "\0" in name
        ):
            raise HeaderError(f"{index}: weight_map names {_name(str(name))}, not a file of {directory}")
        names.add(name)
        if len(names) > _MAX_FILES:
            raise HeaderError(f"{index}: weight_map names more than {_MAX_FILES:,} files")
    return [directory / f for f in sorted(names)]


def _shape_of_config(
    config: dict[str, Any], where: Path, stored: int, float_params: int, other: int
) -> ModelShape:
    # Multimodal configs keep the language model's counts in `text_config`.
    text = config.get("text_config")
    if not isinstance(text, dict) or not text:
        text = config

    def get(*keys: str) -> int | None:
        for key in keys:
            v = text.get(key, config.get(key))
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                if v > MODEL_MAX_TOKENS:
                    raise HeaderError(f"{where}: {key} {figure(v)} is past {figure(MODEL_MAX_TOKENS)}")
                return v
        return None

    n_layer = get("num_hidden_layers", "n_layer", "num_layers")
    n_head = get("num_attention_heads", "n_head")
    hidden = get("hidden_size", "n_embd", "d_model")
    if n_layer is None or n_head is None or hidden is None:
        raise FitError(
            f"{where}: needs num_hidden_layers, num_attention_heads and hidden_size to size the KV cache"
        )
    head_dim = get("head_dim") or hidden // n_head
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or ""
    if not isinstance(dtype, str) or len(dtype) > MODEL_MAX_DTYPE:
        dtype = ""  # not a dtype's name: vLLM's `--dtype auto` is then counted as bf16
    return _checked(
        where,
        ModelShape(
            format="safetensors",
            weight_bytes=stored,
            n_layer=n_layer,
            n_head_kv=get("num_key_value_heads", "num_kv_heads") or n_head,
            head_dim_k=head_dim,
            head_dim_v=head_dim,
            context_length=get("max_position_embeddings", "n_positions", "max_sequence_length") or 0,
            float_params=float_params,
            other_bytes=other,
            dtype=dtype,
        ),
    )


# ---- the estimate (pure) ----


def arg_value(args: tuple[str, ...], *names: str) -> str | None:
    """The value of the last of `names` in `args` (`--x v` or `--x=v`), as engines read them."""
    found: str | None = None
    for i, a in enumerate(args):
        for name in names:
            if a == name and i + 1 < len(args):
                found = args[i + 1]
            elif a.startswith(name + "="):
                found = a[len(name) + 1 :]
    return found


_CONTEXT_ARGS = {
    "llamacpp": ("-c", "--ctx-size"),
    "vllm": ("--max-model-len",),
    "sglang": ("--context-length",),
    # The simulated engine sizes its pretend cache by `--kv-tokens` (4096 without it).
    "sim": ("--kv-tokens",),
}
_CONTEXT_ENV = {"llamacpp": "LLAMA_ARG_CTX_SIZE"}
_CONTEXT_DEFAULT = {"sim": 4096}


def profile_context(profile: Profile, shape: ModelShape) -> int:
    """The context length the engine will size its cache for: the profile's, else the model's."""
    raw = arg_value(profile.args, *_CONTEXT_ARGS.get(profile.engine, ()))
    env = _CONTEXT_ENV.get(profile.engine)
    if raw is None and env:
        raw = profile.env.get(env)
    try:
        value = _tokens(raw) if raw is not None else 0
    except (ValueError, OverflowError):  # `nan`, `inf`: no number the engine reads either
        value = 0
    if value > MODEL_MAX_TOKENS:
        # A context of 1e308 tokens would make every figure after it infinite.
        raise FitError(
            f"profile {profile.name}: a context of {figure(value)} tokens is past {figure(MODEL_MAX_TOKENS)}"
        )
    # llama.cpp's `-c 0` means the model's own context.
    return value if value > 0 else _CONTEXT_DEFAULT.get(profile.engine, shape.context_length)


def _tokens(raw: str) -> int:
    # vLLM accepts `32k` and `1m` for --max-model-len.
    s = raw.strip().lower()[:64]
    scale = {"k": 1024, "m": 1024**2}.get(s[-1:], 1)
    return int(float(s[:-1] if scale > 1 else s) * scale)


def _weight_dtype_bytes(profile: Profile, shape: ModelShape) -> float:
    raw = (arg_value(profile.args, "--dtype") or "auto").lower()
    if raw == "auto":
        raw = shape.dtype.lower() or "bfloat16"
        # vLLM serves float32 checkpoints in half precision unless told otherwise.
        if raw in ("float32", "float"):
            raw = "bfloat16"
    return _DTYPE_BYTES.get(raw, 2)


def _cache(profile: Profile, shape: ModelShape) -> tuple[str, float, float]:
    """The cache dtype's name and the bytes per element of K and of V."""
    if shape.format == "gguf":
        k = (arg_value(profile.args, "-ctk", "--cache-type-k") or "f16").lower()
        v = (arg_value(profile.args, "-ctv", "--cache-type-v") or "f16").lower()
        name = k if k == v else f"{k}/{v}"
        return name, _DTYPE_BYTES.get(k, 2), _DTYPE_BYTES.get(v, 2)
    raw = (arg_value(profile.args, "--kv-cache-dtype") or "auto").lower()
    if raw == "auto":
        b = _weight_dtype_bytes(profile, shape)
        return ("bfloat16" if b == 2 else "float32" if b == 4 else raw), b, b
    b = _DTYPE_BYTES.get(raw, 1 if raw.startswith("fp8") else 2)
    return raw, b, b


def estimate(shape: ModelShape, profile: Profile) -> Estimate:
    """The memory one GPU of a shard of `profile` needs for the model `shape` describes.

    FitError for a shape outside its bounds (`shape_problem`) or a profile whose context is
    past them: every figure is then finite, and no float overflows."""
    problem = shape_problem(shape)
    if problem is not None:
        raise FitError(f"the model's shape cannot be used: {problem}")
    tp, pp = max(profile.tp, 1), max(profile.pp, 1)
    split = tp * pp
    labels = [f"TP {tp}"] * (tp > 1) + [f"PP {pp}"] * (pp > 1)
    if shape.format == "safetensors" and shape.float_params:
        weight_bytes = math.ceil(shape.float_params * _weight_dtype_bytes(profile, shape)) + shape.other_bytes
    else:
        weight_bytes = shape.weight_bytes
    context = profile_context(profile, shape)
    cache_dtype, k_bytes, v_bytes = _cache(profile, shape)
    # Tensor parallelism splits the KV heads (each GPU keeps at least one, replicated when
    # there are fewer heads than GPUs); pipeline parallelism splits the layers.
    heads = max(1, math.ceil(shape.n_head_kv / tp))
    layers = math.ceil(shape.n_layer / pp)
    per_token = layers * heads * (shape.head_dim_k * k_bytes + shape.head_dim_v * v_bytes)
    return Estimate(
        weight_bytes=weight_bytes,
        split=split,
        split_label=" x ".join(labels),
        kv_bytes_per_gpu=math.ceil(per_token * context),
        context=context,
        cache_dtype=cache_dtype,
        kv_bytes_per_token=per_token,
    )


# A GPU's or a host's memory, as a node reports it, past which it is not memory (1 EiB).
_MAX_MEMORY_MB = 2**40


def _memory_mb(mb: int, what: str) -> int:
    if not isinstance(mb, int) or not 0 <= mb <= _MAX_MEMORY_MB:
        shown = figure(mb) if isinstance(mb, int) else type(mb).__name__
        raise FitError(f"{what} reports {shown} MB of memory; no machine has that much")
    return mb


def usable_bytes(gpu: GPUInfo, profile: Profile) -> int:
    """What an engine of `profile` can allocate on `gpu`: its share of the card, less the reserve."""
    total = _memory_mb(gpu.memory_mb, f"GPU {gpu.index}") * MiB
    fraction = DEFAULT_FRACTION.get(profile.engine)
    raw = arg_value(profile.args, "--gpu-memory-utilization", "--mem-fraction-static")
    if raw is not None:
        with contextlib.suppress(ValueError):
            fraction = float(raw)
    if fraction is not None and 0 < fraction <= 1:
        return int(total * fraction)
    return max(0, total - RESERVE_MB * MiB)


def check(est: Estimate, gpu: GPUInfo, gpu_class: str, profile: Profile) -> str | None:
    """`None` when one shard's share fits `gpu`, else the refusal with the figures."""
    usable = usable_bytes(gpu, profile)
    if est.per_gpu <= usable:
        return None
    return f"{est.text()}, {gpu_class or gpu.name} has {gib(usable)} GiB usable"


# Of a CPU node's memory, what the OS, llmgw's agents and the engine's compute buffers keep
# (this share, and at least HOST_RESERVE_MB): an engine on the CPU holds its model and KV
# cache in the host's memory, and a model bigger than that pages from disk at every token.
HOST_RESERVE_FRACTION = 0.1
HOST_RESERVE_MB = 1024


def host_usable_bytes(memory_mb: int) -> int:
    total = _memory_mb(memory_mb, "the node") * MiB
    return max(0, total - max(int(total * HOST_RESERVE_FRACTION), HOST_RESERVE_MB * MiB))


def check_host(est: Estimate, memory_mb: int) -> str | None:
    """`None` when a CPU shard fits a node with `memory_mb` of memory (0: not known, no check),
    else the refusal with the figures. Only the one shard is counted: placement does not
    track what other CPU replicas on the node already hold."""
    if memory_mb <= 0:
        return None
    usable = host_usable_bytes(memory_mb)
    if est.per_gpu <= usable:
        return None
    return f"{est.text('of memory')}, the node has {gib(usable)} GiB usable of {gib(memory_mb * MiB)} GiB"


def check_shard(
    shape: ModelShape, profile: Profile, gpus: Sequence[GPUInfo] = (), memory_mb: int = 0
) -> str | None:
    """The one rule a shard of `profile` is fitted by, in placement before it is placed and on the
    node before its engine starts: `None` when the model `shape` describes fits, else the refusal
    with the figures.

    A GPU profile is fitted against the smallest of the GPUs the shard gets (they are of one
    class; a GPU that reports no memory is not checked), a CPU profile against the host's
    `memory_mb` (`check_host`; 0: not known, not checked).

    FitError where the shape, the profile's context or a reported memory is outside its
    bounds: the caller refuses the node (or the shard) in its words."""
    est = estimate(shape, profile)
    if not profile.gpu_class:
        return check_host(est, memory_mb)
    if not gpus:
        return None
    for gpu in gpus:
        _memory_mb(gpu.memory_mb, f"GPU {gpu.index}")
    smallest = min(gpus, key=lambda g: g.memory_mb)
    if smallest.memory_mb <= 0:
        return None
    return check(est, smallest, profile.gpu_class, profile)
