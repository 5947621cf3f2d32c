"""Random-weight checkpoints with a byte-level tokenizer (nothing downloaded): tiny ones of each
supported architecture for tests, and ones of a real model's shape for a lent GPU (scripts/gpu_serve.sh)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import LlamaConfig

# Llama-3.1-8B's shape (its config.json), for a random checkpoint of a real size on a GPU.
LLAMA_3_1_8B = {
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 131072, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}  # fmt: skip
# A plain-text chat template (the byte tokenizer has no special tokens), so that SGLang's
# /v1/chat/completions serves the checkpoints of a real shape (bench.multiturn on a GPU); the
# tiny ones have none (the calibration tests' samples stay plain text).
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _filler_word(n: int) -> str:
    """The n-th lowercase word in bijective base 26: a .. z, aa .. zz, aaa, ..."""
    letters = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        letters = chr(ord("a") + r) + letters
    return letters


def _save_byte_tokenizer(path: Path, vocab_size: int = 256, chat_template: str | None = None,
                         special_tokens: tuple[str, ...] = ()) -> int:
    """A byte-level BPE tokenizer without merges saved at path; its size. Encoding yields only
    the 256 byte tokens (one per byte) and `special_tokens`, which take the last ids; the ids
    between decode to filler words (a space and `_filler_word`): a random model's output ids
    span the whole vocabulary, and without them its answers would decode to nothing (no
    streamed text, no TTFT)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    vocab.update({"\u0120" + _filler_word(i): len(alphabet) + i  # \u0120: byte-level space
                  for i in range(vocab_size - len(alphabet) - len(special_tokens))})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    if special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    fast.chat_template = chat_template
    fast.save_pretrained(path)
    return len(fast)


def save_tiny_llama(path: Path, layers: int = 2, kv_heads: int = 2, q_heads: int = 4,
                    head_dim: int = 16, seed: int = 0) -> Path:
    """A random-weight Llama (hidden 64, head_dim 16 by default) saved as an HF checkpoint
    SGLang and transformers load; tests use it where the default model's 3 KV heads do not fit
    (tensor parallelism) or where any model will do."""
    return save_tiny_model(path, "LlamaForCausalLM", layers=layers, kv_heads=kv_heads,
                           q_heads=q_heads, head_dim=head_dim, seed=seed)


# transformers' config class of each architecture save_tiny_model builds, and the settings it
# needs beyond the shared shape: Mistral, Mixtral, Phi-3 and Starcoder2 without a sliding window
# (transformers would apply one; SGLang 0.5.23's models of these families attend over the
# whole history whatever the config says, stock backends too), Qwen2 with
# its q/k/v biases (transformers' default), Qwen3 and Olmo2 with their q/k norms (built in);
# the MoE models with 4 experts, 2 per token, in every layer (SGLang's CPU MoE runs
# `moe_forward_native` on them); Gemma ties its embeddings (SGLang's Gemma always does) and
# says exact GELU (SGLang's Gemma computes it whatever the config says); Granite's multipliers
# away from 1 (the attention one is the layer's softmax scale); Phi-3's pad token inside the
# tiny vocabulary; StableLM with its partial rotary embedding (a quarter of each head); Qwen2-MoE
# with its gated shared expert (its gate a Triton kernel in SGLang's model: compat/cpu_triton.py
# computes it on the CPU); OLMoE with its experts' own intermediate size and its q/k norms.
TINY_ARCHITECTURES = {
    "LlamaForCausalLM": ("LlamaConfig", {}),
    "MistralForCausalLM": ("MistralConfig", {"sliding_window": None}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"use_sliding_window": False}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"use_sliding_window": False}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "use_sliding_window": False}),
    "MixtralForCausalLM": ("MixtralConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "GemmaForCausalLM": ("GemmaConfig", {
        "hidden_act": "gelu", "hidden_activation": "gelu", "tie_word_embeddings": True}),
    "Phi3ForCausalLM": ("Phi3Config", {
        "sliding_window": None, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "Olmo2ForCausalLM": ("Olmo2Config", {}),
    "GraniteForCausalLM": ("GraniteConfig", {
        "attention_multiplier": 0.3, "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
        "logits_scaling": 4.0}),
    "StableLmForCausalLM": ("StableLmConfig", {"partial_rotary_factor": 0.25}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {"sliding_window": None}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": False, "use_sliding_window": False}),
    "OlmoeForCausalLM": ("OlmoeConfig", {
        "num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
        "norm_topk_prob": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "Glm4ForCausalLM": ("Glm4Config", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "CohereForCausalLM": ("CohereConfig", {"tie_word_embeddings": True, "logit_scale": 0.5}),
    "PhiForCausalLM": ("PhiConfig", {"partial_rotary_factor": 0.5}),
    "OlmoForCausalLM": ("OlmoConfig", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "GraniteMoeForCausalLM": ("GraniteMoeConfig", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "attention_multiplier": 0.3,
        "embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0}),
    "ArceeForCausalLM": ("ArceeConfig", {}),
    "Glm4MoeForCausalLM": ("Glm4MoeConfig", {
        "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "use_qk_norm": True}),
    "OPTForCausalLM": ("OPTConfig", {
        "ffn_dim": 128, "word_embed_proj_dim": 64, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}),
    "Qwen2VLForConditionalGeneration": ("Qwen2VLConfig", {
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}),
    "Qwen2_5_VLForConditionalGeneration": ("Qwen2_5_VLConfig", {
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}),
    "Qwen3VLForConditionalGeneration": ("Qwen3VLConfig", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3], "mrope_interleaved": True}}),
}  # fmt: skip

# Vision-language architectures: the vision tower of their tiny checkpoint (TINY_ARCHITECTURES
# holds the language model's settings), their processor, and the tokens it needs, which the
# byte tokenizer gets as special tokens (the last ids of the vocabulary). Each tower has 2
# blocks, and its patches merge 2 x 2 into one image token: 28 x 28 pixels from Qwen2-VL's and
# Qwen2.5-VL's 14-pixel patches (`in_chans` and `spatial_patch_size` are the names SGLang
# 0.5.23's Qwen2-VL reads), 32 x 32 from Qwen3-VL's 16-pixel ones. Qwen2.5-VL's tower attends
# in windows of 2 x 2 image tokens in its first block and over the whole image in its last;
# Qwen3-VL's first block also feeds the first decoder layer (deepstack). The image processors
# keep 4 to 256 image tokens (56 x 56 to 448 x 448 pixels; 64 x 64 to 512 x 512 for Qwen3-VL).
_QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                   "<|endoftext|>")
VISION_LANGUAGE = {
    "Qwen2VLForConditionalGeneration": {
        "vision": {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                   "mlp_ratio": 2, "patch_size": 14, "spatial_patch_size": 14,
                   "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                   "in_chans": 3},
        "processor": "Qwen2VLProcessor", "tokens": _QWEN_VL_TOKENS,
        "pixels": (56 * 56, 448 * 448),
    },
    "Qwen2_5_VLForConditionalGeneration": {
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                   "in_channels": 3, "in_chans": 3},
        "processor": "Qwen2_5_VLProcessor", "tokens": _QWEN_VL_TOKENS,
        "pixels": (56 * 56, 448 * 448),
    },
    "Qwen3VLForConditionalGeneration": {
        "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "num_position_embeddings": 64,
                   "deepstack_visual_indexes": [0], "in_channels": 3},
        "processor": "Qwen3VLProcessor", "video": "Qwen3VLVideoProcessor",
        "tokens": _QWEN_VL_TOKENS, "pixels": (64 * 64, 512 * 512),
    },
}  # fmt: skip
VISION_LANGUAGE_VOCAB = 320
# Every message's parts in order, back to back, an image as the model's placeholder (the
# processor expands it to the image's tokens): the tokenizer has no role tokens.
IMAGE_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}")

# Architectures whose tiny checkpoint has as many KV heads as query heads, whatever `kv_heads`
# says: SGLang 0.5.23's OLMoE sizes its k_norm for the query heads, and its Phi (phi-1 to 2) and
# OLMo (the first) models build as many KV heads as query heads, as OPT's config knows no other
# (all four are MHA models), so none of them can load a GQA checkpoint.
MHA_ONLY = frozenset({"OlmoeForCausalLM", "PhiForCausalLM", "OlmoForCausalLM", "OPTForCausalLM"})


# The sequence classifiers (config.SEQUENCE_CLASSIFIERS): two labels, a pad token for
# transformers' last-token pooling.
TINY_CLASSIFIERS = {
    "LlamaForSequenceClassification": ("LlamaConfig", {"num_labels": 2, "pad_token_id": 0}),
}


def save_tiny_model(path: Path, architecture: str = "LlamaForCausalLM", layers: int = 2,
                    kv_heads: int = 2, q_heads: int = 4, head_dim: int = 16, seed: int = 0) -> Path:
    """A random-weight checkpoint of one of `TINY_ARCHITECTURES` (hidden 64, an untied lm_head
    unless the architecture ties it) or `TINY_CLASSIFIERS` with the byte-level tokenizer."""
    import torch
    import transformers

    known = {**TINY_ARCHITECTURES, **TINY_CLASSIFIERS}
    if architecture not in known:
        raise ValueError(f"no tiny {architecture}; one of {sorted(known)}")
    config_name, extra = known[architecture]
    if architecture in VISION_LANGUAGE:
        return _save_tiny_vision_language(path, architecture, layers, kv_heads, q_heads,
                                          head_dim, seed)
    fields = _language_fields(architecture, _save_byte_tokenizer(path), layers, kv_heads,
                              q_heads, head_dim, 1024)
    config = getattr(transformers, config_name)(architectures=[architecture],
                                                **{**fields, **extra})
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).save_pretrained(path)
    return path


def _language_fields(architecture: str, vocab: int, layers: int, kv_heads: int, q_heads: int,
                     head_dim: int, max_positions: int) -> dict[str, object]:
    """The language model's shape every tiny checkpoint shares (hidden 64, untied lm_head)."""
    return dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=q_heads,
        num_key_value_heads=q_heads if architecture in MHA_ONLY else kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, initializer_range=0.2,
        tie_word_embeddings=False,
    )  # fmt: skip


def _save_tiny_vision_language(path: Path, architecture: str, layers: int, kv_heads: int,
                               q_heads: int, head_dim: int, seed: int) -> Path:
    """A random-weight vision-language checkpoint of `VISION_LANGUAGE` with its processor
    (image and video processors, the byte tokenizer with the vision tokens)."""
    import torch
    import transformers

    config_name, extra = TINY_ARCHITECTURES[architecture]
    spec = VISION_LANGUAGE[architecture]
    _save_byte_tokenizer(path, VISION_LANGUAGE_VOCAB, IMAGE_CHAT_TEMPLATE, spec["tokens"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in spec["tokens"]}
    tokenizer.eos_token = tokenizer.pad_token = "<|endoftext|>"
    text = dict(**_language_fields(architecture, VISION_LANGUAGE_VOCAB, layers, kv_heads,
                                   q_heads, head_dim, 4096),
                bos_token_id=None, eos_token_id=ids["<|endoftext|>"],
                pad_token_id=ids["<|endoftext|>"], **extra)
    config = getattr(transformers, config_name)(
        text_config=text, vision_config=spec["vision"], tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], architectures=[architecture])
    torch.manual_seed(seed)
    getattr(transformers, architecture)(config).save_pretrained(path)
    low, high = spec["pixels"]
    patch, merge = spec["vision"]["patch_size"], spec["vision"]["spatial_merge_size"]
    image = transformers.Qwen2VLImageProcessor(min_pixels=low, max_pixels=high,
                                               patch_size=patch, merge_size=merge)
    video = getattr(transformers, spec.get("video", "Qwen2VLVideoProcessor"))(
        patch_size=patch, merge_size=merge)
    getattr(transformers, spec["processor"])(
        image_processor=image, video_processor=video, tokenizer=tokenizer,
        chat_template=IMAGE_CHAT_TEMPLATE).save_pretrained(path)
    return path


def save_llama_shape(path: Path, shape: dict[str, object] = LLAMA_3_1_8B,
                     layers: int | None = None) -> LlamaConfig:
    """config.json (bfloat16) and the byte-level tokenizer (with CHAT_TEMPLATE) of a Llama of
    `shape` (`layers` overrides its layer count), without weights: what a server's KV budget and
    a workload's token counts read (`bench.multiturn --dry-run`)."""
    from transformers import LlamaConfig

    _save_byte_tokenizer(path, int(str(shape["vocab_size"])), CHAT_TEMPLATE)
    fields = {**shape, **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    config.save_pretrained(path)
    return config


def save_random_llama(path: Path, shape: dict[str, object] = LLAMA_3_1_8B, layers: int | None = None,
                      device: str = "cuda", seed: int = 0) -> Path:
    """A bfloat16 random-weight Llama of `shape` (`layers` overrides its layer count), built on
    `device` (an 8B model initializes in seconds on a GPU, minutes on a CPU), with the byte-level
    tokenizer (text encodes to ids below 256; the others decode to filler words)."""
    import torch
    from transformers import LlamaForCausalLM

    config = save_llama_shape(path, shape, layers)
    torch.manual_seed(seed)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(dtype)
    model.save_pretrained(path)
    return path


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def save_lora_adapter(model_path: Path, path: Path, rank: int = 4, alpha: int = 8,
                      targets: tuple[str, ...] = LORA_TARGETS, strength: float = 1.0,
                      seed: int = 0) -> Path:
    """A random LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors)
    for the Llama-layout checkpoint at `model_path`: rank-`rank` A and B on each layer's
    attention projections `targets`. B is not zero (a freshly trained adapter's is), so the
    adapter changes the model's keys and values, and so its greedy tokens; `strength` scales
    B (how far the adapted model moves from the base)."""
    import json

    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model_path) / "config.json").read_text())
    hidden, q_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // q_heads
    q, kv = q_heads * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (q, hidden)}  # (in, out)
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise ValueError(f"LoRA targets {unknown}: choose from {sorted(shapes)}")
    dtype = {"float32": torch.float32, "float16": torch.float16}.get(
        cfg.get("torch_dtype") or cfg.get("dtype"), torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(cfg["num_hidden_layers"]):
        for name in targets:
            n_in, n_out = shapes[name]
            key = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            weights[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen)
                                               / n_in ** 0.5).to(dtype)
            weights[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen)
                                               * strength / rank ** 0.5).to(dtype)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "bias": "none", "target_modules": list(targets),
        "base_model_name_or_path": str(model_path)}, indent=1))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description="Save a random-weight Llama-3.1-8B-shaped "
                                     "checkpoint (byte-level tokenizer; nothing downloaded).")
    parser.add_argument("path", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="default: the shape's 32")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    print(save_random_llama(args.path, layers=args.layers, device=args.device))


if __name__ == "__main__":
    main()
