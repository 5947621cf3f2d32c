"""A fixed randomized Hadamard rotation per (layer, KV head), applied before a tier is quantized.

A leaf (imports only torch; docs/architecture.md, "Row tiers"). The rotation of head h of layer
l is R = diag(s) H / sqrt(D): s a vector of D random signs (+1 or -1) drawn from (seed, l, h),
H the D x D Sylvester Walsh-Hadamard matrix (D a power of two). R is orthogonal (R R^T = I), so
(q R) . (k R) = q . k and softmax(q K^T) (V R) R^T = softmax(q K^T) V: attention over rotated
keys and values, with the query rotated and the output rotated back, is attention over the
originals. What changes is quantization: a rotation spreads an outlier channel over every
channel, so per-token (value) and per-channel (key) scales see flatter data (QuaRot's idea).

Row vectors: ``apply(x)`` is x @ R on the last axis, ``invert(y)`` is y @ R^T; both run the
fast Walsh-Hadamard transform (D log D), never the dense matrix. The server's rotated rows
(`HeadRotations`, --ragged-rotation hadamard) run the same transform in one native call per
tensor on the CPU where the native kernels are built (cuda_ext/elementwise.cpp
`hadamard_heads`), else one batched product by the dense matrices (a GPU, CUDA graphs: fewer
small ops in a decode step than the torch transform). Imports only torch (and, for that call,
sgl_ragged.native when a HeadRotations is built for the CPU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

ROTATION_SEED = 0  # the seed of the rotation the emulator and bench.offline_loss use
_MIX = 1_000_003  # a prime: (seed, layer, head) -> one generator seed


def check_head_dim(head_dim: int,
                   fix: str = "use an unrotated precision (drop the 'r' suffix) for this model",
                   ) -> None:
    """Raises unless head_dim is a power of two (a Walsh-Hadamard matrix of that size exists);
    the message ends with `fix`, what the caller's user should do instead."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {head_dim}; {fix}")


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
        """[D, D] float32 R of one head (dense; tests and the server's `HeadRotations`): x @ R
        is ``apply``."""
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


ROTATIONS = ("none", "hadamard")
"""--ragged-rotation's values: rows stored as computed, or every row rotated (`HeadRotations`)."""


def check_rotation(name: str, flag: str = "--rotation") -> None:
    """ValueError naming `flag` unless `name` is one of ROTATIONS."""
    if name not in ROTATIONS:
        raise ValueError(f"{flag} {name!r} is unknown; choose one of {list(ROTATIONS)}")


def rotation_of(name: str, head_dim: int, fix: str) -> Rotation | None:
    """The rotation a ROTATIONS name stands for at this head_dim (None for "none"); ValueError
    for an unknown name, or ending with `fix` for a head_dim it cannot rotate."""
    check_rotation(name)
    if name == ROTATIONS[0]:
        return None
    check_head_dim(head_dim, fix)
    return Rotation(head_dim)


class HeadRotations:
    """The server's rotated rows (--ragged-rotation hadamard): every key and value a layer
    stores is x @ R of its (layer, KV head), queries are rotated by their KV head's R and the
    output rotated back, so every attention path (reference, batched, native, Triton) runs
    unchanged on rotated rows and computes the same attention (R is orthogonal).

    The hi slots, the staged pages and the new tokens are rotated too: rounding them to the
    model dtype in the rotated basis is the one difference from the emulator's `TierSelection`
    (which rotates only the quantized tiers). Page scores are unchanged wherever a scorer reads
    only dot products and norms (`Scorer.rotation_invariant`).

    ``layers`` and ``kv_heads`` are the global indices of the rows this rank stores (a pipeline
    stage's layers, a tensor-parallel rank's heads), so every rank rotates a head as the
    emulator and a single-rank server do.

    On the CPU, where the native kernels are built, each tensor is rotated in one call of the
    fast transform (`hadamard_heads`: rotation.py's fwht, D log D, float32, one rounding);
    elsewhere (a GPU: CUDA graphs capture it) by one batched product with dense float32
    [H_kv, D, D] matrices per layer. ``native`` forces the choice (None: the native call on a
    CPU device where it is built)."""

    def __init__(self, rotation: Rotation, layers: Sequence[int], kv_heads: Sequence[int],
                 device: str | torch.device = "cpu", native: bool | None = None) -> None:
        self.rotation = rotation
        self.layers = tuple(layers)
        self.kv_heads = tuple(kv_heads)
        self.kernels = _native_kernels(device) if native is not False else None
        if native and self.kernels is None:
            raise ValueError(f"HeadRotations(native=True) needs the native kernels on a CPU "
                             f"device, got {device}")
        self.signs = [rotation.signs(layer, list(self.kv_heads)) for layer in self.layers]
        self.matrices = [torch.stack([rotation.matrix(layer, h) for h in self.kv_heads]).to(device)
                         for layer in self.layers]  # [H_kv, D, D] each
        self.transposed = [m.transpose(1, 2).contiguous() for m in self.matrices]

    def rotate(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        """x [T, H, D] of local layer `layer` (keys and values: H = H_kv; queries: H a multiple,
        head h belonging to KV head h // (H / H_kv)) -> x @ R per head, in x's dtype."""
        if self.kernels is not None:
            _check_heads(x, *self.signs[layer].shape)
            return self.kernels.hadamard_heads(_heads_packed(x), self.signs[layer], False)
        return _per_kv_head(x, self.matrices[layer])

    def restore(self, y: torch.Tensor, layer: int) -> torch.Tensor:
        """y [T, H_q, D] (an attention output over rotated values) -> y @ R^T per head."""
        if self.kernels is not None:
            _check_heads(y, *self.signs[layer].shape)
            return self.kernels.hadamard_heads(_heads_packed(y), self.signs[layer], True)
        return _per_kv_head(y, self.transposed[layer])


def _native_kernels(device: str | torch.device) -> Any:
    """The native module where `device` is the CPU and the kernels are built, else None."""
    if torch.device(device).type != "cpu":
        return None
    from sgl_ragged import native

    return native.load() if native.available() else None


def _heads_packed(x: torch.Tensor) -> torch.Tensor:
    """x, or a copy whose tokens' heads are contiguous (what hadamard_heads reads)."""
    if x.dim() == 3 and x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def _check_heads(x: torch.Tensor, h_kv: int, d: int) -> None:
    if x.dim() != 3 or x.shape[1] % h_kv or x.shape[2] != d:
        raise ValueError(f"expected [T, a multiple of {h_kv} heads, {d}], got {list(x.shape)}")


def _per_kv_head(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    _check_heads(x, mats.shape[0], mats.shape[-1])
    t, h, d = x.shape
    h_kv = mats.shape[0]
    g = h // h_kv
    grouped = x.float().view(t, h_kv, g, d).transpose(0, 1).reshape(h_kv, t * g, d)
    out = torch.bmm(grouped, mats)
    return out.view(h_kv, t, g, d).transpose(0, 1).reshape(t, h, d).to(x.dtype)
