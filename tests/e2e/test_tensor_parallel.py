"""Tensor parallelism end to end on the CPU: --tp-size 2 gives the same greedy tokens as
--tp-size 1 (float32), at uniform:1.0 (nothing dropped) and with a non-uniform profile sliced
per rank (one head per group, so both layouts keep exactly the same tokens per head).

The default model has 3 KV heads, which 2 ranks cannot share; these servers run a tiny
random-weight Llama with 4 KV heads built locally. SGLang's CPU tensor parallelism needs
SGLANG_CPU_OMP_THREADS_BIND (one core set per rank) where ranks outnumber NUMA nodes, and its
all-reduce goes through torch.distributed's gloo (sgl_ragged/compat/cpu_tp.py).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import pytest

from sgl_ragged.budgets import cluster_heads, split_ratios
from sgl_ragged.profile import BudgetProfile, ModelShape
from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_tiny_llama
from tests.e2e.conftest import INTEGRITY_ENV, cpu_bind, greedy, started_together

pytestmark = pytest.mark.e2e

LAYERS, KV_HEADS = 2, 4
# Ranks of tp 2 hold heads {0, 1} and {2, 3}: rank 0's rows are wider than rank 1's.
BUDGETS = ((0.9, 0.7, 0.3, 0.2), (0.6, 0.8, 0.25, 0.4))


def _profile(path: Path) -> Path:
    groups = tuple(cluster_heads(layer, 1) for layer in BUDGETS)
    BudgetProfile(ModelShape("LlamaForCausalLM", LAYERS, KV_HEADS, 16), BUDGETS, groups,
                  {"kind": "calibrated", "rho": 0.5}, split_ratios=split_ratios(BUDGETS, groups)
                  ).save(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The tiny model and the two profiles: {name: --ragged-profile}."""
    root = tmp_path_factory.mktemp("tp")
    model = save_tiny_llama(root / "model", layers=LAYERS, kv_heads=KV_HEADS, q_heads=4)
    return model, {"uniform": "uniform:1.0", "sliced": str(_profile(root / "profile.json"))}


@pytest.fixture(scope="module", params=["uniform", "sliced"])
def servers(request: pytest.FixtureRequest, tiny_model) -> tuple[str, dict[int, ServerProcess]]:
    """(profile name, {tp size: ragged server over the tiny model}), both started together; one
    profile's pair at a time (four servers at once, six ranks, beside test_scaling's servers in
    another shard took the machine to 21.8 of 24 GB, session 20)."""
    model, profiles = tiny_model
    name = request.param
    log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs"))
    made = {}
    for tp in (1, 2):
        args = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
                "--page-size", "64", "--chunked-prefill-size", "256", "--max-total-tokens",
                "4096", "--max-running-requests", "4", "--disable-radix-cache",
                "--attention-backend", "ragged", "--ragged-profile", profiles[name],
                "--ragged-heads-per-group", "1", "--tp-size", str(tp)]
        env = {**INTEGRITY_ENV, **({"SGLANG_CPU_OMP_THREADS_BIND": cpu_bind(tp)} if tp > 1 else {})}
        made[tp] = ServerProcess(args, env=env, log_path=log_dir / f"tp{tp}-{name}.log",
                                 startup_timeout=900)
    with started_together(made):
        yield name, made


def test_tp2_gives_the_tokens_of_tp1(servers) -> None:
    name, by_tp = servers
    rng = random.Random(0)
    for length in (40, 200, 333):  # within one page; sealed pages; a partial tail page
        ids = [rng.randrange(256) for _ in range(length)]
        tokens1, logprobs1, _ = greedy(by_tp[1], ids)
        tokens2, logprobs2, _ = greedy(by_tp[2], ids)
        assert tokens2 == tokens1, f"{name}, {length} prompt tokens"
        assert max(abs(a - b) for a, b in zip(logprobs1, logprobs2, strict=True)) < 1e-3


def test_tp2_ranks_hold_their_slices_and_agree_on_capacity(servers) -> None:
    name, by_tp = servers
    log = by_tp[2].log_text()
    lines = [line for line in log.splitlines() if "ragged capacity:" in line and "logical pages" in line]
    assert any("TP0" in line for line in lines) and any("TP1" in line for line in lines), lines
    # Same logical pages on both ranks although their rows differ in bytes (min over ranks).
    assert len({line.split("ragged capacity:")[1].split(" logical pages")[0] for line in lines}) == 1
    pools = [line for line in log.splitlines() if "Ragged KV cache:" in line]
    bytes_per_page = {re.search(r"(\d+) bytes per logical page", line).group(1) for line in pools}
    # each rank its own slice: the sliced profile's ranks differ in bytes, uniform:1.0's do not
    assert len(pools) == 2 and len(bytes_per_page) == {"sliced": 2, "uniform": 1}[name], pools
