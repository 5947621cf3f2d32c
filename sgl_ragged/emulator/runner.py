"""The model under calibration, with every layer's post-RoPE Q, K, V captured.

The model runs uncompressed (the dynamic reference of TANGRAM Eq. 3): one causal forward over the
whole sample, which equals chunked prefill without compression. Capture works through a
transformers attention function registered for this runner, which records the tensors the
model's attention receives (queries and keys after RoPE, K/V before GQA repetition) and then
runs SDPA.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sgl_ragged.profile import model_shape

_RUNNER_IDS = itertools.count()


@dataclass(frozen=True)
class LayerQKV:
    """One layer's attention inputs for one sample, all float32 on the runner's device."""

    q: torch.Tensor  # [T, H_q, D] post-RoPE queries (unscaled)
    k: torch.Tensor  # [T, H_kv, D] post-RoPE keys
    v: torch.Tensor  # [T, H_kv, D] values


def hf_model_class(model_path: str | Path) -> Any:
    """The transformers auto class that loads a checkpoint with its head: a causal LM's, a
    vision-language model's (which runs its language model alone on text, without pixels), or
    a sequence classifier's (its score head)."""
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    config = AutoConfig.from_pretrained(model_path)
    if is_classifier(config):
        return AutoModelForSequenceClassification
    return AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM


def is_classifier(config: Any) -> bool:
    """Whether an HF config is a sequence classifier's (config.SEQUENCE_CLASSIFIERS)."""
    return any(a.endswith("ForSequenceClassification") for a in config.architectures or ())


class CaptureRunner:
    """Loads an HF causal LM and returns its per-layer Q/K/V for a token sequence."""

    def __init__(self, model_path: str | Path, device: str = "cpu", dtype: str = "float32",
                 lora: str | Path | None = None) -> None:
        """`lora`: a PEFT LoRA adapter directory, merged into the weights as SGLang serves it
        (emulator/lora.py): the model of that adapter's requests."""
        from transformers import AutoTokenizer

        self.device = torch.device(device)
        self._attn_name = f"sgl_ragged_capture_{next(_RUNNER_IDS)}"
        self._register()
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = hf_model_class(model_path).from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=self._attn_name
        ).to(self.device).eval()  # fmt: skip
        if lora is not None:
            from sgl_ragged.emulator.lora import merge_lora

            merge_lora(self.model, lora)
        self.shape = model_shape(str(model_path))  # the fingerprint the server checks
        self.classifier = is_classifier(self.model.config)
        self._captured: list[LayerQKV] = []
        self._capture = True
        self._attention: Any = None  # (layer_idx, q, k, v) -> out, replacing SDPA when set
        self._call_scale: float | None = None
        self.scale = self._attention_scale()

    @property
    def layers(self) -> Any:
        """The decoder layers (a vision-language model's are its language model's, OPT's its
        decoder's)."""
        decoder = self.model.model
        decoder = getattr(decoder, "language_model", decoder)
        return getattr(decoder, "decoder", decoder).layers

    def output_projection(self, layer_idx: int) -> torch.Tensor:
        """[hidden, H_q * D] float32 weight of a layer's attention output projection (`o_proj`;
        OPT's `out_proj`, Phi's `dense`)."""
        attention = self.layers[layer_idx].self_attn
        for name in ("o_proj", "out_proj", "dense"):
            if hasattr(attention, name):
                return getattr(attention, name).weight.detach().float()
        raise RuntimeError(f"layer {layer_idx}'s attention ({type(attention).__name__}) has no "
                           "output projection named o_proj, out_proj or dense")

    def logits(self, input_ids: torch.Tensor, attention: Any = None, start: int = 0) -> torch.Tensor:
        """[T - start, V] float32 next-token logits of input_ids [T] at positions start.. (the
        LM head runs on those only). ``attention``, if given, computes
        every layer's attention instead of SDPA: (layer_idx, q [H_q, T, D], k [H_kv, T, D],
        v [H_kv, T, D]) -> [H_q, T, D] (queries and keys after RoPE). ValueError for a
        sequence classifier, which has no next-token head."""
        self.require_lm_head()
        self._capture, self._attention = False, attention
        try:
            with torch.inference_mode():
                # The model's own head on the kept positions: its lm_head and what the model
                # does after it (Granite divides by logits_scaling).
                logits = self.model(input_ids=input_ids[None].to(self.device), use_cache=False,
                                    logits_to_keep=len(input_ids) - start).logits[0]
        finally:
            self._capture, self._attention = True, None
        return logits.float()

    def require_lm_head(self) -> None:
        """ValueError for a sequence classifier: the next-token losses need an LM head."""
        if self.classifier:
            raise ValueError(
                f"{self.shape.architecture} is a sequence classifier: it has no language-model "
                "head, and this tool measures next-token losses (BaKlaVa, the tier and "
                "precision searches, bench.offline_loss). Calibrate it with --source tangram or "
                "kvcompose (attention retention only), or run this on its base language model")

    def run(self, input_ids: torch.Tensor) -> list[LayerQKV]:
        """input_ids [T] int64 -> one LayerQKV per layer, in layer order."""
        self._captured = []
        with torch.inference_mode():
            # The decoder stack only: the LM head's logits are not needed.
            self.model.model(input_ids=input_ids[None].to(self.device), use_cache=False)
        captured, self._captured = self._captured, []
        if len(captured) != self.shape.num_layers:
            raise RuntimeError(
                f"captured {len(captured)} attention calls for {self.shape.num_layers} layers; "
                f"the model does not route attention through transformers' AttentionInterface"
            )
        return captured

    def _attention_scale(self) -> float:
        """The softmax scale the model hands its attention function, for the captured queries:
        most pass their `scaling` (Granite's attention multiplier), OPT multiplies its queries
        by it first and passes 1.0. Read from a one-token forward."""
        self.run(torch.zeros(1, dtype=torch.long))
        assert self._call_scale is not None
        return self._call_scale

    def _register(self) -> None:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import sdpa_mask

        def attend(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> Any:  # fmt: skip
            # query [1, H_q, T, D], key/value [1, H_kv, T, D] -> [T, H, D] float32
            if self._attention is not None:
                out = self._attention(module.layer_idx, query[0], key[0], value[0])
                return out[None].transpose(1, 2).contiguous().to(query.dtype), None
            scaling = kwargs.get("scaling")
            self._call_scale = float(query.shape[-1] ** -0.5 if scaling is None else scaling)
            if self._capture:
                self._captured.append(LayerQKV(*(x[0].transpose(0, 1).float() for x in (query, key, value))))
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

        AttentionInterface.register(self._attn_name, attend)
        AttentionMaskInterface.register(self._attn_name, sdpa_mask)

