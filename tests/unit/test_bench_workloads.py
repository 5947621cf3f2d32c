"""The multi-turn workload generator (bench/workloads.py) on tiny instances, no server."""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import pytest

from bench.servers import (
    GPU_ARGS,
    GPU_ENV,
    STOCK_KV_BYTES,
    Target,
    equal_budget,
    launch_args,
    launch_env,
)
from bench.tokens import approx_counter, local_counter
from bench.workloads import TASKS, WorkloadConfig, build_sessions, normalize, score_answer
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.profile import uniform_profile

TINY = WorkloadConfig(sessions=8, turns=3, context_tokens=400, seed=7)


def test_same_seed_same_sessions_other_seed_differs():
    a, b = build_sessions(TINY, approx_counter), build_sessions(TINY, approx_counter)
    assert a == b
    c = build_sessions(replace(TINY, seed=8), approx_counter)
    assert [s.context for s in a] != [s.context for s in c]


def test_tasks_round_robin_and_turn_counts():
    sessions = build_sessions(TINY, approx_counter)
    assert [s.task for s in sessions] == [TASKS[i % len(TASKS)] for i in range(8)]
    assert all(len(s.turns) == 3 for s in sessions)


def test_answers_are_in_the_context():
    for s in build_sessions(replace(TINY, sessions=16), approx_counter):
        for turn in s.turns:
            if s.task == "chat":
                assert turn.answer is None
            else:
                assert turn.answer and turn.answer in s.context


def test_questions_are_distinct_within_a_session():
    for s in build_sessions(TINY, approx_counter):
        questions = [t.question for t in s.turns]
        assert len(set(questions)) == len(questions)


def test_answer_is_unique_fact():
    """The key / name / symbol a question asks about occurs once, so the answer is unambiguous."""
    for s in build_sessions(TINY, approx_counter):
        if s.task == "chat":
            continue
        for turn in s.turns:
            subject = re.search(r'"([0-9a-f-]{36})"|of the ([a-z]+ [a-z]+)\?|(\w+_\d+)', turn.question)
            assert subject is not None
            assert s.context.count(next(g for g in subject.groups() if g)) == 1


@pytest.mark.parametrize("target", [200, 600, 1500])
def test_context_length_respected(target):
    cfg = WorkloadConfig(sessions=4, turns=2, context_tokens=target)
    for s in build_sessions(cfg, approx_counter):
        assert s.context_tokens == approx_counter(s.context)
        assert 0.85 * target <= s.context_tokens <= target * 1.05 + 20, (s.task, s.context_tokens)


def test_context_length_with_the_model_tokenizer(model_path):
    count = local_counter(model_path)
    for s in build_sessions(WorkloadConfig(sessions=4, turns=2, context_tokens=500), count):
        assert 420 <= count(s.context) <= 530, (s.task, count(s.context))


def test_sessions_share_contexts_when_asked():
    cfg = WorkloadConfig(sessions=8, turns=2, context_tokens=200, tasks=("kv", "code"),
                         sessions_per_context=2)
    sessions = build_sessions(cfg, approx_counter)
    contexts = [s.context for s in sessions]
    assert contexts[0] == contexts[2] and contexts[1] == contexts[3]
    assert contexts[0] != contexts[4] and len(set(contexts)) == 4


def test_messages_carry_history():
    s = build_sessions(TINY, approx_counter)[0]
    msgs = s.messages(2, ["first answer", "second answer"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[1]["content"].startswith(s.context) and s.turns[0].question in msgs[1]["content"]
    assert msgs[2]["content"] == "first answer" and msgs[5]["content"] == s.turns[2].question
    assert s.messages(0, [])[1] == msgs[1]  # turn 1's prompt is a prefix of turn 3's


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown tasks"):
        WorkloadConfig(tasks=("kv", "poetry"))
    with pytest.raises(ValueError, match="must be >= 1"):
        WorkloadConfig(turns=0)


@pytest.mark.parametrize(("output", "expected", "exact", "contains"), [
    ("4821", "4821", True, True),
    (" 4821.\n", "4821", True, True),
    ("The secret number is 4821.", "4821", False, True),
    ("48 21", "4821", False, False),
    ('"AB12-cd34"', "ab12-CD34", True, True),
    ("", "4821", False, False),
])
def test_score_answer(output, expected, exact, contains):
    assert score_answer(output, expected) == (exact, contains)


def test_normalize():
    assert normalize("  The  Value:\n'x-1_y'! ") == "the value x-1_y"


def test_equal_budget_matches_layout_arithmetic(model_path):
    """The ragged server gets the bytes of 16384 full tokens (256 full pages of 30 layers x 3
    heads x 64 dims, bf16) less (4 + 1) * (1 + 1) staging pages and the scratch page, at 20 of
    64 slots a page."""
    base = equal_budget(Target.parse("baseline"), model_path, 16384, 4)
    assert base == (16384, 1.0, 1.0)
    ragged = equal_budget(Target.parse("ragged:uniform:0.3"), model_path, 16384, 4)
    layout = RaggedLayout.from_profile(uniform_profile(0.3, 30, 3), 64, 64, 2)
    assert layout.full_bytes_per_page == 1474560 and layout.row_bytes_per_page == 460800
    staging = 11 * layout.staging_bytes_per_page()
    assert ragged.kv_tokens == (256 * 1474560 - staging) // 460800 * 64
    assert ragged.rho == 0.3 and ragged.retention == pytest.approx(20 / 64)
    assert 2.9 < ragged.kv_tokens / base.kv_tokens < 64 / 20


def test_target_parse():
    assert Target.parse("ragged:uniform:0.5").profile == "uniform:0.5"
    tiered = Target.parse("ragged@int4:uniform:0.3")
    assert (tiered.profile, tiered.precision) == ("uniform:0.3", "int4")
    args = launch_args(tiered, "m", 4096, max_running=4, chunk=256, device="cpu", extra=[])
    assert args[-6:] == ["--ragged-profile", "uniform:0.3", "--ragged-precision", "int4",
                         "--ragged-rotation", "none"]  # as labelled, never a profile's auto
    with pytest.raises(ValueError, match="baseline"):
        Target.parse("vllm")
    with pytest.raises(ValueError, match="unknown"):
        Target.parse("ragged@int3:uniform:0.3")
    rotated = Target.parse("ragged@int4r:uniform:0.3")  # int4 rows stored rotated
    assert (rotated.precision, rotated.rotated, tiered.rotated) == ("int4", True, False)
    args = launch_args(rotated, "m", 4096, max_running=4, chunk=256, device="cpu", extra=["--x"])
    assert args[-7:] == ["--ragged-profile", "uniform:0.3", "--ragged-precision", "int4",
                         "--ragged-rotation", "hadamard", "--x"]
    assert Target.parse("router:2:round_robin:ragged@mixedr:p.json").rotated
    with pytest.raises(ValueError, match="no quantized tier to rotate"):
        Target.parse("ragged@bf16r:uniform:0.3")


def test_equal_budget_of_tiered_rows(model_path):
    """int4 rows at 0.3 of the bytes (2 full + 62 int4 slots a page) hold about as many logical
    tokens as dropping at 0.3 (they cost no more bytes), with three times the tokens kept."""
    drop = equal_budget(Target.parse("ragged:uniform:0.3"), model_path, 16384, 4)
    int4 = equal_budget(Target.parse("ragged@int4:uniform:0.3"), model_path, 16384, 4)
    layout = RaggedLayout.from_profile(uniform_profile(0.3, 30, 3), 64, 64, 2, "int4")
    assert int4.retention == pytest.approx(layout.retention) and int4.retention <= drop.retention
    assert int4.kv_tokens >= drop.kv_tokens


def test_target_parse_router():
    t = Target.parse("router:2:cache_aware:ragged:uniform:0.3")
    assert (t.workers, t.policy, t.profile) == (2, "cache_aware", "uniform:0.3")
    assert t.label == "router:2:cache_aware:ragged:uniform:0.3"
    stock = Target.parse("router:3:round_robin:baseline")
    assert (stock.workers, stock.policy, stock.profile) == (3, "round_robin", None)
    assert Target.parse("baseline").policy is None
    tiered = Target.parse("router:2:cache_aware:ragged@int4:uniform:0.3")
    assert (tiered.workers, tiered.profile, tiered.precision) == (2, "uniform:0.3", "int4")
    for bad in ("router:2:cache_aware", "router:0:cache_aware:baseline",
                "router:two:cache_aware:baseline", "router:2:sticky:baseline"):
        with pytest.raises(ValueError, match="router:<N>:<policy>:<target>"):
            Target.parse(bad)
    with pytest.raises(ValueError, match="'baseline', 'baseline@<kv dtype>', 'ragged:<profile>'"):
        Target.parse("router:2:cache_aware:vllm")


def test_target_parse_stock_kv_dtype():
    fp8 = Target.parse("baseline@fp8_e4m3")
    assert (fp8.label, fp8.profile, fp8.kv_dtype) == ("baseline@fp8_e4m3", None, "fp8_e4m3")
    assert Target.parse("baseline").kv_dtype is None
    routed = Target.parse("router:2:round_robin:baseline@fp8_e5m2")
    assert (routed.workers, routed.profile, routed.kv_dtype) == (2, None, "fp8_e5m2")
    assert routed.label == "router:2:round_robin:baseline@fp8_e5m2"
    for bad in ("baseline@int4", "baseline@nvfp4", "baseline@auto", "baseline@fp8"):
        with pytest.raises(ValueError, match="use one of bf16, bfloat16, fp8_e4m3, fp8_e5m2"):
            Target.parse(bad)
    with pytest.raises(ValueError, match="baseline@<kv dtype>"):
        Target.parse("baseline@fp8_e4m3:uniform:0.3")


def test_stock_kv_dtypes_are_sglang_choices():
    """Every stock spelling is a value SGLang 0.5.23's --kv-cache-dtype accepts."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    choices = next(a.choices for a in parser._actions if "--kv-cache-dtype" in a.option_strings)
    assert set(STOCK_KV_BYTES) <= set(choices)


def test_equal_budget_of_stock_kv_dtypes(llama_8b_shape):
    """At the bytes of 16384 bfloat16 tokens, stock with 1-byte fp8 entries holds twice the
    tokens (every token kept: rho 1, half the bytes a page); bf16 entries change nothing."""
    model = str(llama_8b_shape)
    assert equal_budget(Target.parse("baseline"), model, 16384, 12) == (16384, 1.0, 1.0)
    for dtype in ("fp8_e4m3", "fp8_e5m2"):
        fp8 = equal_budget(Target.parse(f"baseline@{dtype}"), model, 16384, 12)
        assert fp8 == (32768, 1.0, 0.5)
    assert equal_budget(Target.parse("baseline@bf16"), model, 16384, 12) == (16384, 1.0, 1.0)
    odd = equal_budget(Target.parse("baseline@fp8_e4m3"), model, 1000, 12)
    assert odd.kv_tokens == 1984  # whole pages
    int4 = equal_budget(Target.parse("ragged@int4:uniform:0.3"), model, 16384, 12)
    assert int4.kv_tokens > 32768  # ragged int4@0.3 holds more than stock fp8 at these bytes


def test_launch_args_on_cuda_and_cpu():
    stock, fp8 = Target.parse("baseline"), Target.parse("baseline@fp8_e4m3")
    ragged = Target.parse("ragged@int4:uniform:0.3")

    def args(target, device):
        return launch_args(target, "m", 4096, max_running=12, chunk=256, device=device,
                           extra=["--x"])

    cpu = args(stock, "cpu")
    assert cpu[cpu.index("--attention-backend") + 1] == "torch_native"
    # SGLang stores fp8_e4m3 on a CPU only for its intel_amx backend (refused on any other)
    assert args(fp8, "cpu")[-5:-1] == ["--attention-backend", "intel_amx", "--kv-cache-dtype",
                                       "fp8_e4m3"]
    assert not set(GPU_ARGS) & set(cpu) and "--cuda-graph-max-bs-decode" not in cpu
    assert "--sleep-on-idle" not in cpu  # ServerProcess adds it for --device cpu
    assert cpu[-1] == "--x" and launch_env("cpu") == {}
    for target in (stock, fp8, ragged):
        gpu = args(target, "cuda")
        assert gpu[gpu.index("--device") + 1] == "cuda" and "--sleep-on-idle" not in gpu
        assert gpu[gpu.index("--max-total-tokens") + 1] == "4096"
        assert gpu[gpu.index("--cuda-graph-max-bs-decode") + 1] == "12"
        assert " ".join(GPU_ARGS) in " ".join(gpu) and gpu[-1] == "--x"
    assert args(stock, "cuda")[-3:-1] == ["--attention-backend", "triton"]
    assert args(fp8, "cuda")[-5:-1] == ["--attention-backend", "triton", "--kv-cache-dtype",
                                        "fp8_e4m3"]
    assert "--kv-cache-dtype" not in args(stock, "cuda") + args(ragged, "cuda")
    assert args(ragged, "cuda")[-9:-1] == ["--attention-backend", "ragged", "--ragged-profile",
                                           "uniform:0.3", "--ragged-precision", "int4",
                                           "--ragged-rotation", "none"]
    assert launch_env("cuda") == GPU_ENV and GPU_ENV["SGLANG_USE_CPU_ENGINE"] == "0"
    with pytest.raises(ValueError, match="cpu or cuda"):
        args(stock, "xpu")


def test_gpu_serve_shares_the_gpu_settings():
    from bench import gpu_serve

    assert gpu_serve.GPU_ENV is GPU_ENV and gpu_serve.GPU_ARGS is GPU_ARGS


def test_gpu_env_names_a_radix_tree_core_sglang_has():
    # The lent machine's torch is not the one SGLang's Rust tree core was built against: GPU
    # servers take the pure-Python core, by a name SGLang's registry must still know.
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import (
        registered_tree_core_backends,
    )

    core = GPU_ENV["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"]
    assert core == "python" and core in registered_tree_core_backends()
