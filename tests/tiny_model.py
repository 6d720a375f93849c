"""A tiny random llama model in GGUF, written with the `gguf` package, for real llama.cpp tests.

Two layers, 64-wide, a byte-fallback SentencePiece vocabulary: it loads in
milliseconds and generates (nonsense) tokens for any prompt.
"""

from __future__ import annotations

from pathlib import Path

WORDS = ["▁the", "▁a", "▁llama", "▁gpu", "▁node", "▁hello", "▁world", "▁is", "▁ready", "▁fast"]


def write_tiny_llama(
    path: Path,
    *,
    seed: int = 0,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int | None = None,
    n_ff: int = 128,
    n_layer: int = 2,
    n_ctx: int = 512,
    dtype: str = "f32",
) -> Path:
    """`dtype` (f32, f16 or q8_0) is the matrices' type; norms stay f32, as llama.cpp wants."""
    import gguf
    import numpy as np

    n_head_kv = n_head if n_head_kv is None else n_head_kv
    head_dim = n_embd // n_head
    tokens: list[str] = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += WORDS
    types += [gguf.TokenType.NORMAL] * len(WORDS)
    scores = [0.0] * 3 + [-1000.0] * 256 + [-float(i) for i in range(len(WORDS))]
    n_vocab = len(tokens)

    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def matrix(name: str, *shape: int) -> None:
        w = weights(*shape)
        if dtype == "q8_0":
            q = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, q), raw_dtype=q)
        else:
            writer.add_tensor(name, w.astype(np.float16) if dtype == "f16" else w)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw-tiny-llama")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}[dtype]
    writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    # numpy shapes are ggml's dimensions reversed.
    matrix("token_embd.weight", n_vocab, n_embd)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    matrix("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", n_embd, n_embd)
        matrix(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, n_embd)
        matrix(f"blk.{i}.attn_output.weight", n_embd, n_embd)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        matrix(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
        matrix(f"blk.{i}.ffn_down.weight", n_embd, n_ff)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
