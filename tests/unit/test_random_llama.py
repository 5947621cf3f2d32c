"""Random-weight checkpoints of a real model's shape (sgl_ragged.testing.tiny_model), as
scripts/gpu_serve.sh builds them on a GPU: here on the CPU at a shrunken size."""

from __future__ import annotations

from pathlib import Path

import torch

from sgl_ragged.testing.tiny_model import LLAMA_3_1_8B, save_random_llama


def test_random_llama_keeps_the_shape_in_bfloat16(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    small = {**LLAMA_3_1_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    save_random_llama(tmp_path, shape=small, layers=2, device="cpu")
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.num_hidden_layers == 2 and config.num_key_value_heads == 2
    assert config.head_dim == 64
    assert config.rope_parameters["rope_theta"] == LLAMA_3_1_8B["rope_theta"]  # transformers 5
    model = AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16)
    weights = dict(model.named_parameters())
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 64, 256)
    assert all(w.dtype == torch.bfloat16 for w in weights.values())
    assert torch.get_default_dtype() == torch.float32  # restored
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer("hello")["input_ids"]
    assert ids and max(ids) < 256
    assert torch.isfinite(model(torch.tensor([ids])).logits).all()
    # every id of the vocabulary decodes to text (a random model's answers stream), text encodes
    # to byte tokens only, and chat requests render
    assert len(tokenizer) == 512
    assert tokenizer.decode([256, 257, 256 + 26, 511]) == " a b aa iv"
    filler_text = tokenizer(" a b aa iv")["input_ids"]
    assert len(filler_text) == len(" a b aa iv") and max(filler_text) < 256
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|user|>\nhi\n<|assistant|>\n"


def test_shape_is_llama_3_1_8b() -> None:
    assert (LLAMA_3_1_8B["num_hidden_layers"], LLAMA_3_1_8B["num_key_value_heads"],
            LLAMA_3_1_8B["head_dim"], LLAMA_3_1_8B["hidden_size"]) == (32, 8, 128, 4096)
