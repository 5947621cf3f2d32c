"""serving/runtime.py: the scheduler process's one hand-off, built by a pure function."""

from __future__ import annotations

import pytest

from sgl_ragged.config import RaggedConfig
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import ModelShape, resolve_profile
from sgl_ragged.serving import runtime
from sgl_ragged.tp import slice_all

SHAPE = ModelShape(architecture="LlamaForCausalLM", num_layers=2, num_kv_heads=4, head_dim=16)


def _setup(tp_size: int = 1, tp_rank: int = 0, profile: str = "uniform:0.3"):
    return runtime.build_setup(RaggedConfig(profile=profile, window_pages=2), SHAPE, page_size=16,
                               dtype_bytes=2, max_running_requests=5, tp_size=tp_size,
                               tp_rank=tp_rank, attention_scale=0.25)


def test_build_setup_lays_out_every_rank_and_sizes_staging():
    setup = _setup(tp_size=2, tp_rank=1)
    whole = resolve_profile("uniform:0.3", SHAPE)
    want = tuple(RaggedLayout.from_profile(p, 16, 16, 2) for p in slice_all(whole, 2))
    assert setup.rank_layouts == want and setup.layout == want[1]
    assert setup.profile == slice_all(whole, 2)[1]
    assert setup.num_staging_pages == (5 + 1) * (2 + 1)
    assert setup.cell_size() == max(-(-lay.row_bytes_per_page // 16) for lay in want)
    budget = 10 * want[0].row_bytes_per_page
    assert setup.logical_pages(budget) == min(lay.num_logical_pages(budget, 18) for lay in want)
    assert setup.dynamic_rho is None and _setup(profile="dynamic:0.4").dynamic_rho == 0.4
    with pytest.raises(ValueError, match="tp_rank 2 outside the 2 tensor-parallel ranks"):
        _setup(tp_size=2, tp_rank=2)


def test_setup_is_published_once_and_read_after():
    runtime.clear_setup()
    with pytest.raises(RuntimeError, match="not resolved yet"):
        runtime.current_setup()
    try:
        assert runtime.publish_setup(_setup())
        assert not runtime.publish_setup(_setup())  # the same configuration again
        assert runtime.current_setup() == _setup()
        assert runtime.publish_setup(_setup(profile="uniform:0.5"))
    finally:
        runtime.clear_setup()
