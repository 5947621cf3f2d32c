"""bench.decode_step: every step of a served decode forward is timed, on a storage whose
bookkeeping is a server's (the planner plans it without error, nothing is sealed or newly
staged by the step, so every round sees the same state), and its output is the backend's."""

from __future__ import annotations

import pytest
import torch

from bench import decode_step
from bench.cpu_attention import TAIL
from sgl_ragged import native
from sgl_ragged.attention_backend.native_impl import NativeAttention
from sgl_ragged.attention_backend.planner import plan_batch
from sgl_ragged.profile import BudgetProfile

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.reason()}")


def test_every_step_is_timed():
    profile = BudgetProfile.load(decode_step.DEFAULT_PROFILE)
    (result,) = decode_step.measure(profile, 3, 128, "mixed", warmup=0, repeats=2)
    assert result["batch"] == 3 and result["layers"] == profile.num_layers
    assert result["build"] == "current" and result["rotation"] == "none"
    assert all(result[f"{step}_s"] > 0 for step in decode_step.STEPS if step != "rotate")
    assert result["rotate_s"] == 0  # rows stored as computed: nothing to rotate
    assert result["total_s"] >= result["attend_s"]
    table = decode_step.markdown([result], decode_step.DEFAULT_PROFILE.name)
    assert "| 3 | 128 | mixed | none | current |" in table and "Baseline / current" not in table


def test_rotated_rows_time_their_rotations():
    """--rotation hadamard: every layer's q, k, v rotated and the output rotated back, timed as
    their own step (the server's RaggedAttention.forward around the kernel)."""
    profile = BudgetProfile.load(decode_step.DEFAULT_PROFILE)
    for rotation in ("hadamard", decode_step.DENSE_ROTATION):
        (result,) = decode_step.measure(profile, 2, 128, "mixed", warmup=0, repeats=2,
                                        rotation=rotation)
        assert result["rotation"] == rotation and result["rotate_s"] > 0
        assert all(result[f"{step}_s"] > 0 for step in decode_step.STEPS)
        table = decode_step.markdown([result], decode_step.DEFAULT_PROFILE.name)
        assert f"| 2 | 128 | mixed | {rotation} | current |" in table


class _Recording:
    """A stand-in for another build: the current module's functions, each call recorded."""

    def __init__(self, module) -> None:
        self.module, self.calls = module, []

    def __getattr__(self, name: str):
        function = getattr(self.module, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return function(*args, **kwargs)

        call.__doc__ = function.__doc__
        return call


def test_a_baseline_build_runs_the_kernels_in_alternating_rounds():
    """--baseline: the baseline's kernels (staging read-back, attention, window statistics) run
    in rounds alternating with this build's, both rows and their ratios in the table."""
    profile = BudgetProfile.load(decode_step.DEFAULT_PROFILE)
    baseline = _Recording(native.load())
    current, base = decode_step.measure(profile, 2, 128, "mixed", warmup=1, repeats=3,
                                        baseline=baseline)
    assert (current["build"], base["build"]) == ("current", "baseline")
    layers = profile.num_layers
    assert baseline.calls.count("attend") == 4 * layers  # warm-up and repeats, every layer
    assert baseline.calls.count("window_stats") == 4 * layers
    assert baseline.calls.count("gather_pages") + baseline.calls.count("copy_rows") >= 4 * layers
    table = decode_step.markdown([current, base], decode_step.DEFAULT_PROFILE.name)
    assert "| 2 | 128 | mixed | none | baseline |" in table
    ratio = table.split("Baseline / current")[1].splitlines()[-1]
    assert ratio.startswith("| 2 | 128 | x") and ratio.count("| x") == len(decode_step.STEPS) + 1
    assert ratio.count("| - |") == 1  # rotate: no rotation, no ratio


def test_a_build_from_before_per_group_formats_is_wrapped():
    """bench.cpu_attention.baseline_module: a build whose attend takes one format for every
    group goes behind _SharedFormat (its other functions as they are), and none reads a
    quantized high tier."""
    from bench import cpu_attention

    class Old:
        def attend(self):
            """attend(arg0: torch.Tensor, ..., arg6: torch.Tensor, ...)"""

        def window_stats(self):
            return "stats"

    int4 = cpu_attention.build_case(BudgetProfile.load(cpu_attention.DEFAULT_PROFILE), 1, 128,
                                    True, "int4")[0]
    wrapped = cpu_attention.baseline_module(Old(), int4)
    assert isinstance(wrapped, cpu_attention._SharedFormat) and wrapped.window_stats() == "stats"
    high = cpu_attention.build_case(BudgetProfile.load(cpu_attention.DEFAULT_PROFILE), 1, 128,
                                    True, "int8+int4")[0]
    assert cpu_attention.baseline_module(Old(), high) is None
    assert cpu_attention.baseline_module(native.load(), high) is native.load()


def test_the_served_case_is_a_steady_decode_step():
    """The planner finds each request's sealed run and its one staged page, stages nothing new
    and seals nothing; the forward's staging state after a round is the state before it."""
    profile = BudgetProfile.load(decode_step.DEFAULT_PROFILE)
    storage, req_to_token, (q, k, v) = decode_step.served_case(profile, 2, 128, "mixed")
    prefix = 128 + TAIL
    plan = plan_batch(req_to_token, storage, [0, 1], [prefix] * 2, [prefix + 1] * 2, 1, 32)
    assert [p.num_seal for p in plan.requests] == [0, 0]
    assert all(p.tail_start == 128 and p.prior_stages.numel() == 1 for p in plan.requests)
    assert all((p.after_stages >= 0).all() for p in plan.requests)  # no new staging page
    free_stages = list(storage.free_stage)
    impl = NativeAttention(storage)
    before = [t.clone() for t in storage.stage_k + storage.stage_v]
    decode_step.step_seconds(impl, req_to_token, 128, (q, k, v), 0.125)
    after = [t.clone() for t in storage.stage_k + storage.stage_v]
    decode_step.step_seconds(impl, req_to_token, 128, (q, k, v), 0.125)
    assert storage.free_stage == free_stages  # nothing staged or unstaged by the rounds
    assert all(torch.equal(a, b) for a, b in zip(after, storage.stage_k + storage.stage_v,
                                                 strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # it staged
