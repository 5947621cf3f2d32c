"""Torch forms, on CPU tensors, of the Triton kernels SGLang 0.5.23's model code launches itself.

Most of a model's CPU path goes through layers SGLang gives a torch form (`forward_native`),
but a few models call a Triton kernel straight from their own forward, whatever the attention
backend, and a CPU has no Triton driver ("0 active drivers"). The one a served family needs:

- Qwen2-MoE's shared expert gate (`sglang.kernels.ops.elementwise.elementwise`,
  `fused_gate_sigmoid_mul_add` and `fused_gate_sigmoid_mul`, both through
  `_launch_fused_gate_sigmoid_mul`): per token, sigmoid(hidden · w) times the shared expert's
  output, added to the routed experts' output in place or written to a new tensor. SGLang skips
  it only for its AMX CPU backend (sgl-kernel's CPU build, not on PyPI).

The AROUND hook computes exactly what the kernel does, in float32 (the dot product, the sigmoid,
the product and the add), rounded once into the output's dtype; tensors on another device go to
the kernel. Like cpu_gemm and cpu_ops, the plugin installs it in every SGLang process of the
environment, so a stock server there serves the same models.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TARGET", "gate_sigmoid_mul"]

TARGET = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"


def gate_sigmoid_mul(original: Any, hidden_states: torch.Tensor, gate_weight: torch.Tensor,
                     shared_output: torch.Tensor, output: torch.Tensor, *,
                     do_add: bool) -> None:
    """AROUND `_launch_fused_gate_sigmoid_mul`: output[t] = sigmoid(hidden[t] · w) *
    shared[t] (+ output[t] where `do_add`), in float32, on CPU tensors; else the kernel."""
    tensors = (hidden_states, gate_weight, shared_output, output)
    if any(t.device.type != "cpu" for t in tensors):
        return original(hidden_states, gate_weight, shared_output, output, do_add=do_add)
    tokens, hidden = hidden_states.shape
    if gate_weight.shape != (hidden,) or shared_output.shape != (tokens, hidden) \
            or output.shape != (tokens, hidden):
        raise ValueError(f"fused gate: hidden {tuple(hidden_states.shape)}, gate weight "
                         f"{tuple(gate_weight.shape)}, shared output {tuple(shared_output.shape)} "
                         f"and output {tuple(output.shape)} do not agree (want [T, H], [H], "
                         "[T, H], [T, H])")
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())
    result = gate[:, None] * shared_output.float()
    if do_add:
        result += output.float()
    output.copy_(result)
    return None
