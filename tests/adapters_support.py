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


def write_peft_lora(
    directory: Path,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    base: str = "org/base",
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
) -> Path:
    """A PEFT LoRA adapter's directory as `peft` saves one: adapter_config.json beside
    adapter_model.safetensors (a header naming one tensor, and its bytes)."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "base_model_name_or_path": base,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    header = json.dumps({"a.lora_A.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (directory / "adapter_model.safetensors").write_bytes(
        len(header).to_bytes(8, "little") + header + bytes(4)
    )
    return directory
