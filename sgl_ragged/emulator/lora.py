"""A LoRA adapter merged into the model under calibration, as SGLang serves it.

SGLang (--lora-paths) adds `scaling * B @ A x` to each target projection's output, with
scaling = lora_alpha / r (SGLang 0.5.23's LoRAAdapter: also for an adapter saved with
use_rslora, which PEFT would scale by lora_alpha / sqrt(r)). Merged, that is W + scaling * B @ A:
the offline tools then see the keys, values and attention the server computes for requests of
that adapter. An adapter in PEFT's format: adapter_config.json and adapter_model.safetensors (or
adapter_model.bin), its keys `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def lora_record(lora: str | Path | None) -> dict[str, str]:
    """What a profile records of the adapter it was searched or calibrated for: its name."""
    return {"lora_name": Path(lora).name} if lora else {}


def check_profile_lora(record: Mapping[str, Any], lora: str | Path | None) -> None:
    """A profile calibrated for an adapter (its source `record` names it) is searched further
    only with that adapter: ValueError, saying what to pass, otherwise."""
    name = record.get("lora_name")
    if name is not None and (lora is None or Path(lora).name != name):
        given = f"--lora {lora}" if lora else "no --lora"
        raise ValueError(f"the profile was calibrated for LoRA adapter {name!r} (its source's "
                         f"lora_name), but {given}: pass --lora with that adapter's directory")


def _adapter_weights(path: Path) -> dict[str, torch.Tensor]:
    import torch

    if (path / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "adapter_model.safetensors"))
    if (path / "adapter_model.bin").is_file():
        return torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors or adapter_model.bin")


def merge_lora(model: Any, adapter: str | Path) -> int:
    """Add the adapter at `adapter` to `model`'s weights in place; returns how many projections
    it changed. ValueError where the adapter does not fit the model (a module it names that
    the model lacks, a shape that differs) or is not a plain LoRA SGLang serves."""
    import torch

    path = Path(adapter)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (a PEFT adapter directory "
                         "holds adapter_config.json and adapter_model.safetensors)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config['peft_type']}, not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path}: a DoRA adapter, which SGLang does not serve")
    scaling = float(config["lora_alpha"]) / float(config["r"])
    weights = _adapter_weights(path)
    pairs = sorted({key[: -len(_A)] for key in weights if key.endswith(_A)})
    others = sorted(k for k in weights if not k.endswith((_A, _B)))
    if others or len(weights) != 2 * len(pairs):
        raise ValueError(f"LoRA adapter {path}: weights other than lora_A / lora_B pairs "
                         f"({(others or sorted(weights))[:3]}...); only a plain LoRA is merged")
    modules = dict(model.named_modules())
    for key in pairs:
        name = key.removeprefix(_PREFIX)
        module = modules.get(name)
        if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ValueError(f"LoRA adapter {path} names {name}, which this model has no "
                             "weight for: an adapter for another architecture?")
        a, b = weights[key + _A].float(), weights[key + _B].float()
        delta = scaling * b @ a
        if delta.shape != module.weight.shape:
            raise ValueError(f"LoRA adapter {path}: {name}'s update is {list(delta.shape)}, its "
                             f"weight {list(module.weight.shape)}: an adapter for another model")
        with torch.no_grad():
            module.weight += delta.to(module.weight.device, module.weight.dtype)
    return len(pairs)
