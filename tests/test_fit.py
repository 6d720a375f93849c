"""The memory a shard needs, estimated from the weights' metadata, against what the real engines allocate."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec
import pytest

from llmgw_core.engines import GPUInfo, Profile
from llmgw_core.fit import FitError, ModelShape, check, estimate, read_shape
from tests.engine_memory import llama_memory, vllm_memory
from tests.test_launcher_llamacpp import llama_bin
from tests.test_vllm_real import needs_vllm_wheels
from tests.tiny_hf import write_tiny_hf_llama
from tests.tiny_model import write_tiny_llama

__all__ = ["llama_bin"]

GiB = 1024**3
MiB = 1024**2

# Llama-3-70B's attention in bf16: 80 layers, 8 KV heads of 128.
LLAMA_70B = ModelShape(
    format="safetensors",
    weight_bytes=int(141.1 * GiB),
    n_layer=80,
    n_head_kv=8,
    head_dim_k=128,
    head_dim_v=128,
    context_length=8192,
    float_params=int(70.6e9),
    dtype="bfloat16",
)
# The same in a GGUF (as stored: 141.1 GiB).
LLAMA_70B_GGUF = msgspec.structs.replace(LLAMA_70B, format="gguf", float_params=0)
L40S = GPUInfo(index=0, name="NVIDIA L40S", memory_mb=46068)


def profile(engine: str, *args: str, **kw: object) -> Profile:
    return msgspec.convert(
        {"name": "p", "engine": engine, "model_path": "/m", "args": list(args), **kw}, Profile
    )


def test_a_70b_at_32k_on_tp_4_needs_its_quarter_of_the_weights_and_of_the_kv_heads() -> None:
    est = estimate(LLAMA_70B, profile("vllm", "--max-model-len", "32k", tp=4))
    # 8 KV heads over 4 GPUs: 2 each. 80 layers x 2 heads x 128 x (K + V) x 2 bytes x 32768 tokens.
    assert est.kv_bytes_per_gpu == 80 * 2 * 128 * 2 * 2 * 32768
    assert est.weights_per_gpu == -(-int(70.6e9) * 2 // 4)
    assert est.text() == (
        "needs ~35.4 GiB per GPU (weights 131.5 GiB / TP 4 + KV cache 2.5 GiB at 32k context)"
    )


def test_a_node_whose_gpus_cannot_hold_the_share_is_refused_with_the_figures() -> None:
    est = estimate(LLAMA_70B_GGUF, profile("llamacpp", "-c", "32768", tp=2))
    assert check(est, L40S, "L40S-48G", profile("llamacpp", tp=2)) == (
        "needs ~75.5 GiB per GPU (weights 141.1 GiB / TP 2 + KV cache 5.0 GiB at 32k context), "
        "L40S-48G has 44.5 GiB usable"
    )
    # vLLM takes 90% of the card unless told otherwise; a 4 x 2 split fits one L40S.
    vllm = profile("vllm", "--max-model-len", "8192", tp=4, pp=2)
    est = estimate(LLAMA_70B, vllm)
    assert est.text() == (
        "needs ~16.8 GiB per GPU (weights 131.5 GiB / TP 4 x PP 2 + KV cache 0.3 GiB at 8k context)"
    )
    assert check(est, L40S, "L40S-48G", vllm) is None
    tight = profile("vllm", "--max-model-len", "8192", "--gpu-memory-utilization=0.3", tp=4, pp=2)
    assert check(est, L40S, "L40S-48G", tight) == (
        "needs ~16.8 GiB per GPU (weights 131.5 GiB / TP 4 x PP 2 + KV cache 0.3 GiB at 8k context), "
        "L40S-48G has 13.5 GiB usable"
    )


def test_the_context_defaults_to_the_models_and_the_cache_dtype_counts() -> None:
    assert estimate(LLAMA_70B, profile("vllm")).context == 8192
    assert estimate(LLAMA_70B, profile("llamacpp", "-c", "0")).context == 8192
    assert estimate(LLAMA_70B, profile("llamacpp", env={"LLAMA_ARG_CTX_SIZE": "4096"})).context == 4096
    bf16 = estimate(LLAMA_70B, profile("vllm"))
    fp8 = estimate(LLAMA_70B, profile("vllm", "--kv-cache-dtype", "fp8"))
    assert (bf16.cache_dtype, fp8.cache_dtype) == ("bfloat16", "fp8")
    assert fp8.kv_bytes_per_gpu * 2 == bf16.kv_bytes_per_gpu
    q8 = estimate(LLAMA_70B_GGUF, profile("llamacpp", "-ctk", "q8_0", "-ctv", "q8_0"))
    assert (q8.cache_dtype, q8.kv_bytes_per_token) == ("q8_0", 80 * 8 * 128 * 2 * 34 / 32)
    # Fewer KV heads than GPUs: each GPU keeps one, replicated.
    mqa = msgspec.structs.replace(LLAMA_70B, n_head_kv=1)
    assert estimate(mqa, profile("vllm", tp=8)).kv_bytes_per_token == 80 * 1 * 128 * 2 * 2


def test_a_gguf_shape_comes_from_its_header(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf", n_embd=256, n_head=4, n_head_kv=2, n_layer=3, n_ctx=2048)
    shape = read_shape(path)
    assert (shape.format, shape.n_layer, shape.n_head_kv, shape.head_dim_k, shape.head_dim_v) == (
        "gguf",
        3,
        2,
        64,
        64,
    )
    assert shape.context_length == 2048
    # Every tensor's bytes, and only those: the file is the header plus them.
    assert 0.9 * path.stat().st_size < shape.weight_bytes < path.stat().st_size


def test_a_split_gguf_missing_a_part_is_refused_with_the_names(tmp_path: Path) -> None:
    first = write_tiny_llama(tmp_path / "m-00001-of-00003.gguf")
    write_tiny_llama(tmp_path / "m-00003-of-00003.gguf")
    with pytest.raises(FitError) as e:
        read_shape(first)
    assert str(e.value) == f"{first}: split GGUF is missing m-00002-of-00003.gguf beside it"


def safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with `tensors`' header and its tensors' bytes unwritten (a sparse file):
    only the header is read."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = {"BF16": 2, "F32": 4, "I32": 4}[dtype] * int(__import__("math").prod(shape))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        # The tensors' bytes as a hole: the file is as long as its header says, and takes no disk.
        f.truncate(8 + len(raw) + offset)


def test_safetensors_shapes_come_from_the_headers_and_config_alone(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "max_position_embeddings": 131072,
                "torch_dtype": "float32",
            }
        )
    )
    # 16 GB of weights the files do not hold: reading them would fail.
    safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("F32", [65536, 32768])})
    safetensors(
        tmp_path / "model-00002-of-00002.safetensors", {"b": ("F32", [65536, 32768]), "q": ("I32", [8])}
    )
    shape = read_shape(tmp_path)
    assert (shape.n_layer, shape.n_head_kv, shape.head_dim_k, shape.context_length) == (32, 8, 128, 131072)
    assert (shape.weight_bytes, shape.float_params, shape.other_bytes) == (2 * 8 * GiB + 32, 4 * GiB, 32)
    # vLLM serves a float32 checkpoint in bf16 unless told otherwise.
    assert estimate(shape, profile("vllm")).weight_bytes == 8 * GiB + 32
    assert estimate(shape, profile("vllm", "--dtype", "float32")).weight_bytes == 16 * GiB + 32


def test_metadata_that_cannot_size_the_cache_is_refused_with_the_file_named(tmp_path: Path) -> None:
    safetensors(tmp_path / "model.safetensors", {"a": ("BF16", [4, 4])})
    with pytest.raises(FitError) as e:
        read_shape(tmp_path / "model.safetensors")
    assert str(e.value) == f"{tmp_path}/config.json: missing; the KV cache cannot be sized without it"
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(FitError) as e:
        read_shape(tmp_path)
    assert str(e.value) == (
        f"{tmp_path}/config.json: needs num_hidden_layers, num_attention_heads and hidden_size "
        "to size the KV cache"
    )
    (tmp_path / "bad.safetensors").write_bytes(struct.pack("<Q", 2**40) + b"{}")
    with pytest.raises(FitError) as e:
        read_shape(tmp_path / "bad.safetensors")
    assert str(e.value) == (
        f"{tmp_path}/bad.safetensors: header length {2**40} is not plausible; not a safetensors file"
    )


# ---- against the real engines ----

# Three shapes: layer counts, widths, GQA and weight types differ.
SHAPES = {
    "2x64-f32-mha": {},
    "8x512-f16-gqa4": {
        "n_embd": 512,
        "n_head": 8,
        "n_head_kv": 2,
        "n_ff": 1536,
        "n_layer": 8,
        "n_ctx": 4096,
        "dtype": "f16",
    },
    "16x256-q8_0-mqa": {
        "n_embd": 256,
        "n_head": 4,
        "n_head_kv": 1,
        "n_ff": 768,
        "n_layer": 16,
        "n_ctx": 2048,
        "dtype": "q8_0",
    },
}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shapes")
    return {name: write_tiny_llama(root / f"{name}.gguf", **kw) for name, kw in SHAPES.items()}  # type: ignore[arg-type]


def within(estimated: float, real: float, share: float = 0.10) -> bool:
    return abs(estimated - real) <= share * real


@pytest.mark.llama
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_estimate_is_within_10_percent_of_llama_cpps_buffers(
    llama_bin: str, shapes: dict[str, Path], name: str
) -> None:
    path = shapes[name]
    # A q8_0 cache needs heads of a multiple of 32; the 64-wide model's heads are 16.
    cache = ["-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"] if name != "2x64-f32-mha" else []
    args = ["-c", "1536", *cache]
    est = estimate(read_shape(path), profile("llamacpp", *args))
    real = llama_memory(llama_bin, path, args)
    assert within(est.weight_bytes, real.model_bytes), (est.weight_bytes / MiB, real.model_bytes / MiB)
    assert within(est.kv_bytes_per_gpu, real.kv_bytes), (est.kv_bytes_per_gpu / MiB, real.kv_bytes / MiB)


@pytest.mark.real_vllm
@pytest.mark.timeout(1200)
def test_the_estimate_is_within_10_percent_of_what_vllm_loads(tmp_path: Path) -> None:
    needs_vllm_wheels()  # skips where vLLM is not installed (fails under CI)
    model = write_tiny_hf_llama(tmp_path / "tiny-llama")
    real = vllm_memory(model, dtype="bfloat16", max_model_len=256)
    est = estimate(read_shape(model), profile("vllm", "--dtype", "bfloat16", "--max-model-len", "256"))
    assert within(est.weight_bytes, real.weight_bytes), (est.weight_bytes, real.weight_bytes)
    assert within(est.kv_bytes_per_token, real.kv_bytes_per_token), (
        est.kv_bytes_per_token,
        real.kv_bytes_per_token,
    )
