"""Pipeline parallelism end to end on the CPU: --pp-size 2, alone and with --tp-size 2, gives
the same greedy tokens as --pp-size 1 (float32) with a per-head precision profile whose layers differ in budgets and low
formats, each stage stores its own
layers' slice of the profile, both stages admit the same logical tokens, and a follow-up
request reuses the first one's sealed pages from the radix cache on both.

The default model ties its word embeddings, which SGLang 0.5.23's pipeline stages cannot serve
(server_args._check_pipeline refuses it); these servers run a tiny random-weight Llama with its
own lm_head, built locally. Its four layers split [0, 2) / [2, 4); its head groups are adjacent
pairs, so that the tensor-parallel ranks keep them (and their tiers).
"""

from __future__ import annotations

import os
import random
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sgl_ragged.budgets import adjacent_groups, split_ratios
from sgl_ragged.mem_pool.layout import RaggedLayout
from sgl_ragged.pp import slice_layers
from sgl_ragged.profile import BudgetProfile, ModelShape
from sgl_ragged.profile.tiers import ProfileTiers
from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_tiny_llama
from sgl_ragged.tp import slice_profile
from tests.e2e.conftest import INTEGRITY_ENV, cpu_bind, greedy, started_together

pytestmark = pytest.mark.e2e

LAYERS, KV_HEADS, HEAD_DIM, PAGE = 4, 4, 16, 64
# The first stage's layers keep more than the second's: their rows differ in bytes.
BUDGETS = ((0.9, 0.7, 0.3, 0.2), (0.6, 0.8, 0.25, 0.4), (0.3, 0.2, 0.25, 0.5), (0.2, 0.4, 0.15, 0.3))


# Per-head precision: each layer's low tier in its own format, so the stages' rows differ in
# formats too (the slots a page keeps: 4 at the model dtype, then the low share in codes).
FORMATS = ("int8", "int4", "int2", "int4")
LOW = (0.5, 0.75, 0.9, 0.6)


def _profile() -> BudgetProfile:
    groups = tuple(adjacent_groups(KV_HEADS, 2) for _ in BUDGETS)  # within tp-2 ranks' heads
    tiers = ProfileTiers("mixed", tuple((4 / PAGE,) * KV_HEADS for _ in range(LAYERS)),
                         tuple((lo,) * KV_HEADS for lo in LOW),
                         tuple((fmt,) * KV_HEADS for fmt in FORMATS))
    return BudgetProfile(ModelShape("LlamaForCausalLM", LAYERS, KV_HEADS, HEAD_DIM), BUDGETS, groups,
                         {"kind": "calibrated", "rho": 0.4},
                         split_ratios=split_ratios(BUDGETS, groups), tiers=tiers)


def _layout(profile: BudgetProfile) -> RaggedLayout:
    return RaggedLayout.from_profile(profile, PAGE, HEAD_DIM, 4, precision="mixed")


@pytest.fixture(scope="module")
def model_and_profile(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pp")
    model = save_tiny_llama(root / "model", layers=LAYERS, kv_heads=KV_HEADS, q_heads=4)
    profile = root / "profile.json"
    _profile().save(profile)
    return model, profile


# (pp size, tp size) of the server held to --pp-size 1: two stages, and two stages of two
# tensor-parallel ranks each (four ranks on this machine's cores in turn).
VARIANTS = {"pp2": (2, 1), "pp2-tp2": (2, 2)}


@pytest.fixture(scope="module", params=list(VARIANTS))
def servers(request: pytest.FixtureRequest, model_and_profile) -> dict[int, ServerProcess]:
    """{1: the --pp-size 1 server, 2: the variant's} over the tiny model, started together; one
    variant's pair at a time."""
    model, profile = model_and_profile
    log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs"))
    made = {}
    for key, (pp, tp) in ((1, (1, 1)), (2, VARIANTS[request.param])):
        args = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
                "--page-size", str(PAGE), "--chunked-prefill-size", "256", "--max-total-tokens",
                "4096", "--max-running-requests", "4", "--attention-backend", "ragged",
                "--ragged-profile", str(profile), "--pp-size", str(pp), "--tp-size", str(tp)]
        ranks = pp * tp
        env = {**INTEGRITY_ENV,
               **({"SGLANG_CPU_OMP_THREADS_BIND": cpu_bind(ranks, share=True)} if ranks > 1 else {})}
        made[key] = ServerProcess(args, env=env, log_path=log_dir / f"pp{pp}-tp{tp}.log",
                                  startup_timeout=900)
    with started_together(made):
        yield made


def test_stages_give_the_tokens_of_pp1(servers) -> None:
    rng = random.Random(0)
    for length in (40, 200, 333):  # within one page; sealed pages; a partial tail page
        ids = [rng.randrange(256) for _ in range(length)]
        tokens1, logprobs1, _ = greedy(servers[1], ids)
        tokens2, logprobs2, _ = greedy(servers[2], ids)
        assert tokens2 == tokens1, f"{length} prompt tokens"
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-3


def test_a_follow_up_reuses_the_sealed_prefix_on_both_stages(servers) -> None:
    rng = random.Random(1)
    first = [rng.randrange(256) for _ in range(300)]
    follow = first + [rng.randrange(256) for _ in range(70)]
    got = {}
    for pp, server in servers.items():
        greedy(server, first)
        got[pp] = greedy(server, follow)
    assert got[2].tokens == got[1].tokens
    # the first request's sealed pages (4 of its 300 + 24 tokens) come from the radix cache
    assert got[1].cached == got[2].cached == 4 * PAGE


def test_each_stage_holds_its_layers_and_all_admit_the_same_tokens(servers) -> None:
    log = servers[2].log_text()
    pools = {}
    for line in log.splitlines():
        if "Ragged KV cache:" in line:
            stage = int(re.search(r"PP(\d)", line).group(1))
            rank = int(m.group(1)) if (m := re.search(r"TP(\d)", line)) else 0
            pools[stage, rank] = (int(re.search(r"(\d+) logical tokens", line).group(1)),
                                  int(re.search(r"(\d+) bytes per logical page", line).group(1)))
    profile = _profile()
    tp = 1 + max(rank for _, rank in pools)
    want = {}
    for stage in (0, 1):
        layers = slice_layers(profile, 2 * stage, 2 * stage + 2)
        for rank in range(tp):
            want[stage, rank] = _layout(layers if tp == 1 else slice_profile(layers, tp, rank))
    assert {k: b for k, (_, b) in pools.items()} == {k: lay.row_bytes_per_page for k, lay in want.items()}
    assert want[0, 0].row_bytes_per_page != want[1, 0].row_bytes_per_page
    assert len({tokens for tokens, _ in pools.values()}) == 1, pools
    # the stages' (and ranks') rows are exactly the whole model's
    assert sum(b for _, b in pools.values()) == _layout(profile).row_bytes_per_page


def test_concurrent_requests_in_micro_batches_give_the_tokens_of_pp1(servers) -> None:
    """Four requests at once: the pipeline's stages run them as micro-batches (each stage plans
    its own forwards from the noted batch rows, checked against the tensor on the CPU), and
    their decode seals pages (each request's own scores). The prompts fit one prefill chunk
    together: where SGLang splits a prompt over chunks (by arrival, when others take part of a
    chunk), its first chunk's pages are sealed from that chunk's queries only, and the answer
    may differ from the prompt's served alone by design, pipeline or not."""
    rng = random.Random(2)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (40, 52, 60, 33)]  # 185 < 256
    alone = [greedy(servers[1], ids, 150, to_length="min_new_tokens").tokens for ids in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda ids: greedy(servers[2], ids, 150, to_length="min_new_tokens").tokens,
                                 prompts))
    assert together == alone
