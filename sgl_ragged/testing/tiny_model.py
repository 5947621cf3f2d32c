"""A tiny random-weight Llama checkpoint with a byte-level tokenizer (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path


def save_tiny_llama(path: Path, layers: int = 2, kv_heads: int = 2, q_heads: int = 4,
                    head_dim: int = 16, seed: int = 0) -> Path:
    """A random-weight Llama (hidden 64, head_dim 16 by default) saved as an HF checkpoint
    SGLang and transformers load; tests use it where the default model's 3 KV heads do not fit
    (tensor parallelism) or where any model will do."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(alphabet), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=1024, initializer_range=0.2, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path
