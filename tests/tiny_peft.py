"""A tiny PEFT LoRA adapter for `tiny_hf.write_tiny_hf_llama`'s model, as `peft` saves one:
adapter_config.json beside adapter_model.safetensors, the weights named
`base_model.model.model.layers.<i>.self_attn.<q_proj|v_proj>.lora_<A|B>.weight`.

Written by the test, never trained: lora_A and lora_B are random (PEFT starts lora_B at zero,
which would leave the base's answers as they were), large enough that greedy decoding differs
from the base's, and `seed` makes two adapters differ from each other.
"""

from __future__ import annotations

import json
from pathlib import Path

from llmgw_core.adapter_peft import PeftConfig, read_peft

# The tiny Llama's shape (tiny_hf): hidden 256, heads of 64.
HIDDEN = 256
HEAD_DIM = 64
TARGETS = ("q_proj", "v_proj")


def write_tiny_peft_lora(
    directory: Path,
    *,
    seed: int = 1,
    rank: int = 8,
    alpha: float = 16.0,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 4,
    strength: float = 0.5,
    base: str = "tiny-llama",
) -> Path:
    """The adapter's directory at `directory`, read back with llmgw's own reader (`read_peft`,
    which raises PeftError where it is not one llmgw serves). The layer and head counts are
    `write_tiny_hf_llama`'s; `strength` is each weight's standard deviation: at 0.5 the adapted
    q and v are many times the base's, so the adapter decides what the model says."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = {"q_proj": num_attention_heads * HEAD_DIM, "v_proj": num_key_value_heads * HEAD_DIM}
    tensors: dict[str, np.ndarray] = {}
    for layer in range(num_hidden_layers):
        for target in TARGETS:
            name = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            # PEFT's shapes: lora_A [rank, in], lora_B [out, rank].
            a = rng.standard_normal((rank, HIDDEN)) * strength
            b = rng.standard_normal((out[target], rank)) * strength
            tensors[f"{name}.lora_A.weight"] = a.astype(np.float32)
            tensors[f"{name}.lora_B.weight"] = b.astype(np.float32)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "target_modules": list(TARGETS),
        "base_model_name_or_path": base,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    found: PeftConfig = read_peft(directory, max_rank=rank)
    assert (found.rank, found.target_modules) == (rank, TARGETS), found
    return directory
