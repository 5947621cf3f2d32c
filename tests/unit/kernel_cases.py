"""Random ragged storages and request plans for the kernel tests (small shapes: the CPU runs
the kernels in Triton's interpreter)."""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from sgl_ragged.attention_backend.impl import AttentionImpl
from sgl_ragged.attention_backend.plan import BatchPlan, RequestPlan
from sgl_ragged.attention_backend.torch_ref import TorchAttention
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.mem_pool.quant import QuantTier
from sgl_ragged.mem_pool.storage import RaggedStorage
from sgl_ragged.precision import LOW_PRECISIONS
from sgl_ragged.profile import BudgetProfile, ProfileTiers
from sgl_ragged.scoring import SnapKVScorer

P, D, H_KV, GQA = 8, 16, 4, 2
BUDGETS = (0.25, 0.5, 0.6, 0.75, 1.0)  # k = 4, 4, 5, 6, 8 slots of P = 8


@dataclass(frozen=True)
class Shape:
    page_size: int = P
    head_dim: int = D
    kv_heads: int = H_KV
    gqa: int = GQA


SMALL = Shape()
GPU = Shape(page_size=64, head_dim=128, kv_heads=8, gqa=4)  # serving shapes (Llama-3-8B-like)


@dataclass(frozen=True)
class Spec:
    """One request: sealed pages before the forward, staged tokens, new tokens."""

    sealed: int
    staged: int
    q_len: int
    seal: int = 0  # complete tail pages this forward seals (the rest stays staged)


def make_storage(profile: BudgetProfile, page_size: int, head_dim: int, num_pages: int,
                 num_staging_pages: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 precision: str = "bf16", **kwargs: Any) -> RaggedStorage:
    """A zeroed storage for ``profile`` (SnapKV scorer); ``kwargs`` go to RaggedStorage
    (``scale``, ``dynamic_rho``). Every test that needs a storage builds it here."""
    layout = RaggedLayout.from_profile(profile, page_size, head_dim, torch.finfo(dtype).bits // 8,
                                       precision=precision)
    return RaggedStorage(layout, num_pages, num_staging_pages, dtype, device, SnapKVScorer(),
                         **kwargs)


def random_storage(rng: random.Random, device: str, layers: int = 1, heads_per_group: int = 2,
                   num_pages: int = 48, num_stages: int = 24,
                   dtype: torch.dtype = torch.float32, shape: Shape = SMALL,
                   precision: str = "bf16", head_order: Sequence[int] | None = None) -> RaggedStorage:
    """Random per-head budgets, adjacent groups (or groups of consecutive heads of
    `head_order`, a permutation of the KV heads), rows and staging pages filled with noise
    (`precision`: the rows' low tier, docs/architecture.md, "Row tiers", and with H+L their high tier, with
    random codes and parameters)."""
    H = shape.kv_heads
    order = list(range(H)) if head_order is None else list(head_order)
    budgets = [[rng.choice(BUDGETS) for _ in range(H)] for _ in range(layers)]
    groups = [tuple(tuple(order[s:s + heads_per_group]) for s in range(0, H, heads_per_group))
              for _ in range(layers)]
    profile = BudgetProfile(model=None, budgets=budgets, groups=groups, source={"kind": "uniform"})
    if precision == "mixed":
        profile = _per_head_formats(profile, rng, shape.page_size)
    storage = make_storage(profile, shape.page_size, shape.head_dim, num_pages, num_stages,
                           dtype, device, precision)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for t in [*(x for rows in (storage.rows_k, storage.rows_v) for layer in rows for x in layer),
              *storage.stage_k, *storage.stage_v]:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))  # in place: row addresses stay
    for tier in (t for rows in (storage.low_rows, storage.high_rows) for layer in rows
                 for t in layer if t is not None):
        _randomize_tier(tier, gen)
    # What staged pages accumulated in earlier forwards (non-negative, like the real ones).
    stats = storage.stats
    for t in (stats.attn, stats.q_sum, stats.q_count):
        t.copy_(torch.rand(t.shape, generator=gen))
    stats.q_sq_sum.copy_(stats.q_sum.square() + torch.rand(
        stats.q_sum.shape, generator=gen).to(storage.device))
    return storage


def _per_head_formats(profile: BudgetProfile, rng: random.Random, page: int) -> BudgetProfile:
    """The profile with random per-group compositions and low formats, cycling through every
    format (--ragged-precision mixed)."""
    names = itertools.cycle(LOW_PRECISIONS)
    shares = [[(0.0, 0.0, "")] * len(layer) for layer in profile.budgets]
    for li, layer_groups in enumerate(profile.groups):
        for heads in layer_groups:
            hi, lo, fmt = rng.choice([1, 2, page // 2]), rng.choice([3, page // 2]), next(names)
            for h in heads:
                shares[li][h] = (hi / page, lo / page, fmt)
    tiers = ProfileTiers("mixed", *([[x[i] for x in row] for row in shares] for i in range(3)))
    return BudgetProfile(profile.model, profile.budgets, profile.groups, profile.source, tiers=tiers)


def _randomize_tier(tier: QuantTier, gen: torch.Generator) -> None:
    """Random codes, positive scales and zero points, in place. Scales are sized to the largest
    code value, as a quantizer sizes them to the data's range: every width dequantizes into
    about [-4, 4] (int4's codes times 0.05-0.15, zero points N(-1, 1)). With one scale range
    for every width, random 8-bit codes read back as values up to ~38 (fp8: ~36), far from any
    real row, where the kernels' bfloat16 outputs are 0.25 apart."""
    bits = tier.k_codes.shape[-1] * 8 // tier.k_scale.shape[-1]
    top = 240.0 if tier.k_zero is None else float(2**bits - 1)  # largest code value
    for codes in (tier.k_codes, tier.v_codes):
        codes.copy_(torch.randint(0, 256, codes.shape, generator=gen, dtype=torch.uint8))
    if tier.k_zero is None:  # fp8 codes: finite float8_e4m3fn values only (no 0x7f / 0xff), <= 240
        for codes in (tier.k_codes, tier.v_codes):
            codes.copy_(codes & 0xF7)
    for scale, zero in ((tier.k_scale, tier.k_zero), (tier.v_scale, tier.v_zero)):
        scale.copy_(((0.05 + torch.rand(scale.shape, generator=gen) * 0.1) * (15.0 / top)).half())
        if zero is not None:
            zero.copy_((torch.randn(zero.shape, generator=gen) - 1.0).half())


def random_plans(storage: RaggedStorage, specs: Sequence[Spec], rng: random.Random,
                 gap: int = 0, twins: Sequence[RaggedStorage] = ()) -> list[RequestPlan]:
    """Plans with distinct random pages and staging pages; `gap` unused q rows between
    requests (rows no request owns). The first `spec.seal` tail pages are sealed, the others
    stay staged; tail tokens carry random observation counts. The staging pages a request
    held before hold zeros past its staged tokens, as in a server (tail_batch's docstring:
    both staging writers zero them, and in-place forwards do not write them again); so do
    the same pages of `twins` (storages compared with this one)."""
    pages = list(range(1, storage.num_pages))
    stages = list(range(storage.num_staging_pages))
    rng.shuffle(pages)
    rng.shuffle(stages)
    dev, page = storage.device, storage.layout.page_size
    plans, q_start = [], gap
    for s in specs:
        tail = s.staged + s.q_len
        n_tail_pages = -(-tail // page)
        n_prior = -(-s.staged // page)
        sealed = [pages.pop() for _ in range(s.sealed)]
        tail_pages = [pages.pop() for _ in range(n_tail_pages)]
        held = [stages.pop() for _ in range(n_tail_pages)]  # [:n_prior] held before
        assert s.seal * page <= tail, "only complete pages can be sealed"
        tail_start = s.sealed * page
        if s.staged % page:  # the last held page is partly staged
            for stage in [t for st in (storage, *twins) for t in st.stage_k + st.stage_v]:
                stage[held[n_prior - 1], s.staged % page:] = 0
        plans.append(RequestPlan(
            q_start=q_start, prefix=tail_start + s.staged, seq_len=tail_start + tail,
            tail_start=tail_start, sealed_pages=torch.tensor(sealed, dtype=torch.long, device=dev),
            prior_stages=torch.tensor(held[:n_prior], dtype=torch.long, device=dev),
            tail_pages=torch.tensor(tail_pages, dtype=torch.long), num_seal=s.seal,
            after_stages=torch.tensor(held[s.seal:], dtype=torch.long, device=dev),
            tail_obs=torch.tensor([float(rng.randint(1, 9)) for _ in range(tail)], device=dev),
            obs_queries=min(4, s.q_len)))
        q_start += s.q_len + gap
    return plans


def random_qkv(plans: Sequence[RequestPlan], gen: torch.Generator, device: str,
               dtype: torch.dtype = torch.float32,
               shape: Shape = SMALL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, H_q, D], k, v [N, H, D] covering every plan's rows (and the gaps between them)."""
    n = max(p.q_start + p.q_len for p in plans) + 1
    H, d = shape.kv_heads, shape.head_dim
    q = torch.randn(n, H * shape.gqa, d, generator=gen).to(device, dtype)
    k = torch.randn(n, H, d, generator=gen).to(device, dtype)
    v = torch.randn(n, H, d, generator=gen).to(device, dtype)
    return q, k, v


def random_specs(rng: random.Random, n: int, decode: bool, page: int = P,
                 max_sealed: int = 3) -> list[Spec]:
    """n random requests for pages of `page` tokens: sealed pages (up to max_sealed), staged
    tokens (up to two pages), new tokens (1 for a decode batch, else up to three pages) and how
    many complete tail pages they seal."""
    specs = []
    for _ in range(n):
        staged = rng.randrange(2 * page)
        q_len = 1 if decode else rng.randint(1, 3 * page)
        specs.append(Spec(sealed=rng.randrange(max_sealed + 1), staged=staged, q_len=q_len,
                          seal=rng.randint(0, (staged + q_len) // page)))
    return specs


def batch_rows(plans: Sequence[RequestPlan], n: int) -> torch.Tensor:
    """[n] bool: the q rows some request owns."""
    owned = torch.zeros(n, dtype=torch.bool)
    for p in plans:
        owned[p.q_start : p.q_start + p.q_len] = True
    return owned


def reference_lse(storage: RaggedStorage, layer: int, plan: RequestPlan, q: torch.Tensor,
                  k_new: torch.Tensor, scale: float) -> torch.Tensor:
    """[q_len, H_q] float32 log-sum-exp of the logits the torch reference's softmax sees."""
    staged = plan.prefix - plan.tail_start
    tail_k = k_new
    if staged:
        tail_k = torch.cat([storage.staged_kv(layer, plan.prior_stages)[0][:staged], k_new])
    out = torch.empty(q.shape[0], q.shape[1])
    gqa = q.shape[1] // k_new.shape[1]
    q_pos = torch.arange(plan.prefix, plan.seq_len)[:, None]
    causal = torch.arange(plan.tail_start, plan.seq_len)[None, :] <= q_pos  # [q_len, T]
    for g, heads in enumerate(storage.head_index[layer]):
        sealed_k, _ = storage.sealed_kv(layer, g, plan.sealed_pages)  # [N_s, H_p, D]
        for j, h in enumerate(heads.tolist()):
            keys = torch.cat([sealed_k[:, j], tail_k[:, h]]).float().cpu()
            for qh in range(h * gqa, (h + 1) * gqa):
                logits = q[:, qh].float().cpu() @ keys.T * scale
                logits[:, sealed_k.shape[0]:].masked_fill_(~causal, float("-inf"))
                out[:, qh] = torch.logsumexp(logits, -1)
    return out


def storage_state(storage: RaggedStorage) -> list[torch.Tensor]:
    """Every tensor a forward may write: rows, staging pages and their statistics."""
    rows = [t for rows in (storage.rows_k, storage.rows_v) for layer in rows for t in layer]
    rows += [t for tiers in (storage.low_rows, storage.high_rows) for layer in tiers
             for tier in layer if tier is not None for t in tier.tensors()]
    stats = storage.stats
    return [*rows, *storage.stage_k, *storage.stage_v, stats.attn, stats.q_sum, stats.q_sq_sum,
            stats.q_count]


def assert_same_state(got: RaggedStorage, want: RaggedStorage) -> None:
    """Same rows, staging pages, statistics (float tolerance) and seal counters."""
    for i, (a, b) in enumerate(zip(storage_state(got), storage_state(want), strict=True)):
        if a.dtype == torch.uint8:  # quantized codes: a value on a rounding boundary may
            # round either way after float32 noise in its inputs; allow 1% of the bytes
            differ = (a != b).float().mean().item()
            assert differ <= 0.01, f"tensor {i}: {differ:.2%} of the codes differ"
            continue
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m, i=i: f"tensor {i}: {m}")
    assert got.counters == want.counters


def compare_with_reference(make_impl: Callable[[RaggedStorage], AttentionImpl],
                           specs: Sequence[Spec], decode: bool, seed: int, device: str,
                           layer: int = 0, gap: int = 0, precision: str = "bf16") -> None:
    """One forward through `make_impl(storage)` and the torch reference on twin random
    storages: outputs, rows, staging pages, statistics and counters agree."""
    impl_store, ref_store = (random_storage(random.Random(seed), device, layers=2, num_stages=64,
                                            precision=precision)
                             for _ in range(2))
    plans = random_plans(impl_store, specs, random.Random(seed + 1), gap=gap, twins=[ref_store])
    q, k, v = random_qkv(plans, torch.Generator().manual_seed(seed), device)
    outs = []
    for impl in make_impl(impl_store), TorchAttention(ref_store):
        batch = impl.prepare(BatchPlan(requests=list(plans)))
        outs.append(impl.forward(layer, batch, q, k, v, 1 / math.sqrt(D), decode))
    rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in plans])
    torch.testing.assert_close(outs[0][rows], outs[1][rows], atol=2e-5, rtol=1e-4)
    assert_same_state(impl_store, ref_store)
