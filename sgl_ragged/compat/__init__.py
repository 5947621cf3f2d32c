"""Compatibility layers between SGLang 0.5.23 and the machines it runs on here (sgl_kernel_cpu,
import_hook, cpu_tp, cpu_gemm, cpu_ops, cpu_triton, cpu_lora, cpu_start, dual_gemm), and
shared_tokenizer, which spares a scheduler a second load of its tokenizer."""

from __future__ import annotations

import os


def env_choice(name: str, choices: dict[str, str], default: str = "auto") -> str:
    """Environment variable `name` (unset or empty: `default`), one of `choices` (value ->
    what it does); ValueError naming them all for any other value."""
    value = os.environ.get(name, default) or default
    if value not in choices:
        raise ValueError(f"{name}={value} is not a choice: set it to "
                         + "; ".join(f"{k} ({v})" for k, v in choices.items()))
    return value
