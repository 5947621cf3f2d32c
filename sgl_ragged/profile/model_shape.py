"""The model facts a budget profile depends on (its fingerprint), read from a local checkpoint."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sgl_ragged.profile.validation import ProfileError


@dataclass(frozen=True)
class ModelShape:
    """The model facts a profile depends on (its fingerprint)."""

    architecture: str  # HF config architectures[0], e.g. "LlamaForCausalLM"
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.architecture, str) or not self.architecture:
            raise ProfileError(
                f"model architecture must be a non-empty string, got {self.architecture!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ProfileError(f"model {name} must be a positive int, got {value!r}")

    def differences(self, other: ModelShape) -> list[str]:
        """Lines "field: profile has X, model has Y" (self is the profile's side)."""
        return [
            f"{f.name}: profile has {getattr(self, f.name)}, model has {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]

    def describe(self) -> str:
        return (
            f"{self.architecture} with {self.num_layers} layers, "
            f"{self.num_kv_heads} KV heads, head_dim {self.head_dim}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Any) -> ModelShape:
        if not isinstance(data, dict):
            raise ProfileError(f"'model' must be an object or null, got {data!r}")
        names = [f.name for f in fields(cls)]
        if sorted(data) != sorted(names):
            raise ProfileError(f"'model' must have exactly the keys {names}, got {sorted(data)}")
        return cls(**{name: data[name] for name in names})


def model_shape(model_path: str, trust_remote_code: bool = False) -> ModelShape:
    """Architecture and KV geometry of a local HF checkpoint (its config.json)."""
    from transformers import AutoConfig

    outer = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    cfg = getattr(outer, "text_config", outer)  # a vision-language model's language model
    heads = cfg.num_attention_heads
    return ModelShape(
        architecture=(outer.architectures or cfg.architectures or ["unknown"])[0],
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
    )
