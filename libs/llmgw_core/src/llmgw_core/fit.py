"""Whether a model fits a GPU, from the weights' own metadata, before any engine starts.

Two halves, kept apart so placement can decide without the files:

- `read_shape(path)` (an effect, on the node that holds the weights) reads only
  metadata: a GGUF's header through the `gguf` package (tensor sizes and types,
  the architecture's layer and head counts, its trained context), or each
  `.safetensors` file's header (the 8-byte length and the JSON after it, never a
  tensor's bytes) with the directory's `config.json`. It returns a `ModelShape`,
  a plain Struct that can travel on the bus.
- `estimate(shape, profile)` and `check(est, gpu, gpu_class, profile)` are pure:
  the memory one GPU of a shard needs (the weights split over TP x PP, plus the
  KV cache for the profile's context length in its cache dtype) and, against a
  GPU's usable memory, `None` or the refusal in figures:
  `needs ~23.7 GiB per GPU (weights 35.1 GiB / TP 2 + KV cache 6.1 GiB at 32k
  context), L40S-48G has 44.5 GiB usable`.

The estimate counts what the engines allocate up front for a model (llama.cpp's
model and KV buffers, vLLM's weights and one full-length sequence of KV cache),
not activations or the compute buffer, which the usable figure leaves room for.

Errors: `FitError` (a file that is not what its name says, a config without the
counts the cache needs); never retryable, the same bytes give the same answer.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from msgspec import Struct

from .engines import GPUInfo, Profile
from .events import ModelShape

__all__ = [
    "Estimate",
    "FitError",
    "ModelShape",
    "check",
    "check_host",
    "check_shard",
    "estimate",
    "read_shape",
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
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


class FitError(Exception):
    """Weights whose metadata cannot be read, or lack what the estimate needs."""

    retryable = False


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
        return math.ceil(self.weight_bytes / self.split)

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


# ---- reading the metadata (the only effects here) ----


def read_shape(path: str | Path) -> ModelShape:
    """The shape of the model at `path`: a `.gguf` file (its other splits found beside it),
    a `.safetensors` file, or a directory with `config.json` and `.safetensors` files."""
    p = Path(path)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if (p / "config.json").is_file():
            return _read_safetensors_dir(p)
        if ggufs:
            return _read_gguf(ggufs[0])
        raise FitError(f"{p}: no config.json and no .gguf file; cannot tell the model's shape")
    if p.suffix == ".gguf":
        return _read_gguf(p)
    if p.suffix == ".safetensors":
        return _read_safetensors_dir(p.parent, files=[p])
    raise FitError(f"{p}: neither a .gguf nor a .safetensors file nor a model directory")


def _read_gguf(path: Path) -> ModelShape:
    # Imported here, not at the top: gguf brings numpy, which placement (it imports this
    # module for the estimate) never needs. It is a dependency of llmgw-core.
    import gguf

    parts = _gguf_splits(path)
    weight_bytes = 0
    first: Any = None
    for part in parts:
        try:
            reader = gguf.GGUFReader(part)
        except (ValueError, OSError, struct.error) as exc:
            raise FitError(f"{part}: not a readable GGUF file: {exc}") from exc
        if first is None:
            first = reader
        weight_bytes += sum(int(t.n_bytes) for t in reader.tensors)

    def field(key: str) -> Any:
        f = first.fields.get(key)
        return None if f is None else f.contents()

    arch = field("general.architecture")
    if not isinstance(arch, str):
        raise FitError(f"{path}: no general.architecture in the GGUF header")

    def count(key: str, default: int | None = None) -> int:
        v = field(f"{arch}.{key}")
        if isinstance(v, list):  # per-layer counts: the cache is sized by the largest
            v = max(v) if v else None
        if v is None:
            if default is None:
                raise FitError(f"{path}: no {arch}.{key} in the GGUF header; cannot size the KV cache")
            return default
        return int(v)

    n_embd = count("embedding_length")
    n_head = count("attention.head_count")
    n_head_kv = count("attention.head_count_kv", n_head)
    head_k = count("attention.key_length", n_embd // max(n_head, 1))
    return ModelShape(
        format="gguf",
        weight_bytes=weight_bytes,
        n_layer=count("block_count"),
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=count("attention.value_length", head_k),
        context_length=count("context_length", 0),
    )


def _gguf_splits(path: Path) -> list[Path]:
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FitError(f"{path}: split GGUF is missing {', '.join(missing)} beside it")
    return parts


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header: its first 8 bytes (little-endian length) and that much JSON."""
    try:
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise FitError(f"{path}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER:
                raise FitError(f"{path}: header length {n} is not plausible; not a safetensors file")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise FitError(f"{path}: cannot read: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FitError(f"{path}: header is not JSON; not a safetensors file") from exc
    if not isinstance(header, dict):
        raise FitError(f"{path}: header is not a JSON object; not a safetensors file")
    return header


def _read_safetensors_dir(directory: Path, files: list[Path] | None = None) -> ModelShape:
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError as exc:
        raise FitError(f"{config_path}: missing; the KV cache cannot be sized without it") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise FitError(f"{config_path}: not readable JSON: {exc}") from exc
    if files is None:
        files = _weight_files(directory)
    if not files:
        raise FitError(f"{directory}: no .safetensors files")
    float_params = other = stored = 0
    for path in files:
        for name, t in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (start, end) = t["dtype"], t["shape"], t["data_offsets"]
                numel = math.prod(int(d) for d in shape)
            except (KeyError, TypeError, ValueError) as exc:
                raise FitError(f"{path}: tensor {name!r} has no dtype, shape or data_offsets") from exc
            stored += int(end) - int(start)
            if dtype in _ST_FLOATS:
                float_params += numel
            else:
                other += int(end) - int(start)
    return _shape_of_config(config, config_path, stored, float_params, other)


def _weight_files(directory: Path) -> list[Path]:
    # A repository may hold one model twice (`consolidated.safetensors` beside
    # `model-0000x-of-0000y.safetensors`); the index names the files the engines load.
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [directory / f for f in sorted(set(weight_map.values()))]
        except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise FitError(f"{index}: not a safetensors index (no weight_map)") from exc
    return sorted(directory.glob("*.safetensors"))


def _shape_of_config(
    config: dict[str, Any], where: Path, stored: int, float_params: int, other: int
) -> ModelShape:
    # Multimodal configs keep the language model's counts in `text_config`.
    text = config.get("text_config") or config

    def get(*keys: str) -> int | None:
        for key in keys:
            v = text.get(key, config.get(key))
            if isinstance(v, int) and v > 0:
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
    return ModelShape(
        format="safetensors",
        weight_bytes=stored,
        n_layer=n_layer,
        n_head_kv=get("num_key_value_heads", "num_kv_heads") or n_head,
        head_dim_k=head_dim,
        head_dim_v=head_dim,
        context_length=get("max_position_embeddings", "n_positions", "max_sequence_length") or 0,
        float_params=float_params,
        other_bytes=other,
        dtype=str(dtype),
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
    except ValueError:
        value = 0
    # llama.cpp's `-c 0` means the model's own context.
    return value if value > 0 else _CONTEXT_DEFAULT.get(profile.engine, shape.context_length)


def _tokens(raw: str) -> int:
    # vLLM accepts `32k` and `1m` for --max-model-len.
    s = raw.strip().lower()
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
    """The memory one GPU of a shard of `profile` needs for the model `shape` describes."""
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


def usable_bytes(gpu: GPUInfo, profile: Profile) -> int:
    """What an engine of `profile` can allocate on `gpu`: its share of the card, less the reserve."""
    total = gpu.memory_mb * MiB
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
    total = memory_mb * MiB
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
    `memory_mb` (`check_host`; 0: not known, not checked)."""
    est = estimate(shape, profile)
    if not profile.gpu_class:
        return check_host(est, memory_mb)
    if not gpus:
        return None
    smallest = min(gpus, key=lambda g: g.memory_mb)
    if smallest.memory_mb <= 0:
        return None
    return check(est, smallest, profile.gpu_class, profile)
