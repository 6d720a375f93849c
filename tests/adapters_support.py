"""A tiny LoRA adapter GGUF for `tiny_model.write_tiny_llama`'s model, as llama.cpp's
`convert_lora_to_gguf.py` writes one: `general.type` adapter, `adapter.type` lora,
`adapter.lora.alpha`, and `<weight>.lora_a` (ggml [n_in, rank]) / `<weight>.lora_b`
([rank, n_out]) for some of the base's 2-D weights."""

from __future__ import annotations

from pathlib import Path

from tests.tiny_model import WORDS

# The vocabulary of the tiny model: 3 control tokens, 256 bytes, the words.
N_VOCAB = 3 + 256 + len(WORDS)


def write_tiny_lora(
    path: Path,
    *,
    seed: int = 1,
    arch: str = "llama",
    n_embd: int = 64,
    n_layer: int = 2,
    rank: int = 4,
    alpha: float = 8.0,
    general_type: str | None = "adapter",
    adapter_type: str | None = "lora",
    strength: float = 1.0,
) -> Path:
    """Adapts every layer's attn_q and the output matrix, strongly enough (`strength`) that
    greedy decoding differs from the base's."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    if general_type is not None:
        writer.add_type(general_type)
    if adapter_type is not None:
        writer.add_string("adapter.type", adapter_type)
    writer.add_float32("adapter.lora.alpha", alpha)

    def pair(name: str, n_out: int, n_in: int) -> None:
        # numpy shapes are ggml's dimensions reversed.
        a = (rng.standard_normal((rank, n_in)) * strength).astype(np.float32)
        b = (rng.standard_normal((n_out, rank)) * strength).astype(np.float32)
        writer.add_tensor(f"{name}.lora_a", a)
        writer.add_tensor(f"{name}.lora_b", b)

    for i in range(n_layer):
        pair(f"blk.{i}.attn_q.weight", n_embd, n_embd)
    pair("output.weight", N_VOCAB, n_embd)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
