"""A fixed randomized Hadamard rotation per (layer, KV head), applied before a tier is quantized.

A leaf (imports only torch; docs/architecture.md, "Row tiers"). The rotation of head h of layer
l is R = diag(s) H / sqrt(D): s a vector of D random signs (+1 or -1) drawn from (seed, l, h),
H the D x D Sylvester Walsh-Hadamard matrix (D a power of two). R is orthogonal (R R^T = I), so
(q R) . (k R) = q . k and softmax(q K^T) (V R) R^T = softmax(q K^T) V: attention over rotated
keys and values, with the query rotated and the output rotated back, is attention over the
originals. What changes is quantization: a rotation spreads an outlier channel over every
channel, so per-token (value) and per-channel (key) scales see flatter data (QuaRot's idea).

Row vectors: ``apply(x)`` is x @ R on the last axis, ``invert(y)`` is y @ R^T; both run the
fast Walsh-Hadamard transform (D log D), never the dense matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ROTATION_SEED = 0  # the seed of the rotation the emulator and bench.offline_loss use
_MIX = 1_000_003  # a prime: (seed, layer, head) -> one generator seed


def check_head_dim(head_dim: int) -> None:
    """Raises unless head_dim is a power of two (a Walsh-Hadamard matrix of that size exists)."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {head_dim}; "
                         "use an unrotated precision (drop the 'r' suffix) for this model")


def fwht(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D]: x @ H / sqrt(D), H the Sylvester Walsh-Hadamard matrix (symmetric,
    so this is its own inverse). Computed in float32, returned in x's dtype."""
    d = x.shape[-1]
    check_head_dim(d)
    y = x.reshape(-1, d).float()
    h = 1
    while h < d:
        pairs = y.view(-1, d // (2 * h), 2, h)  # [M, blocks, 2, h]: entries i and i + h
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return (y / math.sqrt(d)).view(x.shape).to(x.dtype)


def hadamard(d: int) -> torch.Tensor:
    """[D, D] float32 normalized Sylvester Walsh-Hadamard matrix (dense; for tests and checks)."""
    check_head_dim(d)
    out = torch.ones(1, 1)
    while out.shape[0] < d:
        out = torch.cat([torch.cat([out, out], 1), torch.cat([out, -out], 1)], 0)
    return out / math.sqrt(d)


@dataclass(frozen=True)
class Rotation:
    """The rotations of every (layer, KV head) of a model with ``head_dim``, drawn from ``seed``."""

    head_dim: int
    seed: int = ROTATION_SEED

    def __post_init__(self) -> None:
        check_head_dim(self.head_dim)

    def signs(self, layer: int, heads: list[int]) -> torch.Tensor:
        """[len(heads), D] float32 of +1/-1: the random signs of each head of `layer`."""
        rows = []
        for h in heads:
            if layer < 0 or h < 0:
                raise ValueError(f"layer {layer} and head {h} must be non-negative")
            gen = torch.Generator().manual_seed((self.seed * _MIX + layer) * _MIX + h)
            bits = torch.randint(0, 2, (self.head_dim,), generator=gen)
            rows.append(bits.float() * 2 - 1)
        return torch.stack(rows)

    def matrix(self, layer: int, head: int) -> torch.Tensor:
        """[D, D] float32 R of one head (dense; for tests): x @ R is ``apply``."""
        return self.signs(layer, [head])[0][:, None] * hadamard(self.head_dim)

    def apply(self, x: torch.Tensor, layer: int, heads: list[int]) -> torch.Tensor:
        """x [..., H', D] (axis -2: the heads `heads` of `layer`) -> x @ R per head."""
        return fwht(x * self._signs_like(x, layer, heads))

    def invert(self, y: torch.Tensor, layer: int, heads: list[int]) -> torch.Tensor:
        """y [..., H', D] -> y @ R^T per head: ``invert(apply(x)) == x`` (up to rounding)."""
        return fwht(y) * self._signs_like(y, layer, heads)

    def _signs_like(self, x: torch.Tensor, layer: int, heads: list[int]) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2:] != (len(heads), self.head_dim):
            raise ValueError(f"expected [..., {len(heads)} heads, {self.head_dim}], got {list(x.shape)}")
        return self.signs(layer, heads).to(device=x.device, dtype=x.dtype)
