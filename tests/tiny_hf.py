"""A tiny random Llama in Hugging Face's layout (config, safetensors, tokenizer), for real vLLM tests.

Written by the test, never downloaded: hidden 256, two layers, four heads of 64
(vLLM's CPU attention refuses head sizes under 32), and a 512-token byte-level
BPE tokenizer trained on a few sentences. About 3 MB; it generates nonsense.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "the llama runs on a node",
    "hello world, the gateway is ready",
    "a replica has shards and every shard has a port",
    "placement puts the model where the gpus are free",
] * 8

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_tiny_hf_llama(
    directory: Path, *, seed: int = 0, num_hidden_layers: int = 2, num_key_value_heads: int = 4
) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>"]
    bpe.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=512,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        head_dim=64,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory
