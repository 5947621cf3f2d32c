"""LoRA adapters (--enable-lora --lora-paths) served by the ragged backend, held to stock SGLang.

An adapter on the attention projections changes the model's keys and values, so the KV pages a
request writes belong to its adapter: SGLang's radix cache keys them by adapter, and the ragged
pool must seal and serve them as it does the base model's. A tiny random-weight Llama in
float32 with two adapters (q/k/v/o, rank 4), ragged at `uniform:1.0` (the rows are the full
cache) beside stock `torch_native` with the same adapters: every request, with an adapter or
without, gets stock's greedy tokens and log-probabilities (within 1e-4), prefixes are reused
only within an adapter, and a batch mixing adapters gives what each request gets alone.

Neither server names --lora-backend: on --device cpu the environment picks `torch_native` where
SGLang's default would run Triton kernels (sgl_ragged/compat/cpu_lora.py).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import save_lora_adapter, save_tiny_llama
from tests.e2e.conftest import COMMON, INTEGRITY_ENV, Greedy, post, started_together

pytestmark = pytest.mark.e2e

ADAPTERS = (None, "a", "b")  # None: the base model
NEW_TOKENS = 16
ATOL = 1e-4  # float32 on both sides; the two backends sum attention in another order


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_llama(root / "llama")
    paths = [f"{name}={save_lora_adapter(model, root / name, seed=seed)}"
             for seed, name in enumerate(ADAPTERS[1:], start=1)]
    base = ["--model-path", str(model), *COMMON, "--dtype", "float32",
            "--max-total-tokens", "4096", "--max-running-requests", "4",
            "--enable-lora", "--lora-paths", *paths, "--max-loras-per-batch", "3"]
    logs = Path("/tmp/sgl-ragged-test-logs")
    with started_together({
        "ragged": ServerProcess([*base, "--attention-backend", "ragged",
                                 "--ragged-profile", "uniform:1.0"],
                                env=INTEGRITY_ENV, log_path=logs / "lora-ragged.log",
                                startup_timeout=900),
        "stock": ServerProcess([*base, "--attention-backend", "torch_native"],
                               env=INTEGRITY_ENV, log_path=logs / "lora-stock.log",
                               startup_timeout=900),
    }) as started:
        yield dict(started)


def _generate(server: ServerProcess, ids: list[int], adapter: str | None) -> Greedy:
    payload = {"input_ids": ids, "return_logprob": True,
               "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0,
                                   "ignore_eos": True}}
    if adapter is not None:
        payload["lora_path"] = adapter
    out = post(server.base_url, "/generate", payload)
    pairs = out["meta_info"]["output_token_logprobs"]
    return Greedy([p[1] for p in pairs], [p[0] for p in pairs], out["meta_info"]["cached_tokens"])


def _assert_same(got: Greedy, want: Greedy, what: str) -> None:
    assert got.tokens == want.tokens, what
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < ATOL, what


def test_every_adapter_gives_stock_tokens(servers) -> None:
    for seed, length in ((1, 40), (2, 150)):  # within one page; past two
        ids = _prompt(seed, length)
        outs = {}
        for adapter in ADAPTERS:
            outs[adapter] = _generate(servers["ragged"], ids, adapter)
            _assert_same(outs[adapter], _generate(servers["stock"], ids, adapter),
                         f"prompt of {length} tokens, adapter {adapter}")
        # The adapters are real: each moves the model's tokens away from the base's.
        assert len({tuple(o.tokens) for o in outs.values()}) == len(ADAPTERS)


def test_prefixes_are_reused_within_an_adapter_only(servers) -> None:
    ids = _prompt(3, 200)  # three full 64-token pages
    for name, server in servers.items():
        first = _generate(server, ids, "a")
        again = _generate(server, ids, "a")
        other = _generate(server, ids, "b")
        base = _generate(server, ids, None)
        assert (first.cached, again.cached, other.cached, base.cached) == (0, 192, 0, 0), name
        _assert_same(again, first, f"{name}: adapter a from its cached pages")
    for adapter in ADAPTERS:  # the third request of each adapter: every page cached
        _assert_same(_generate(servers["ragged"], ids, adapter),
                     _generate(servers["stock"], ids, adapter), f"cached, adapter {adapter}")


def test_a_batch_mixing_adapters(servers) -> None:
    jobs = [(_prompt(10 + i, 60 + 25 * i), ADAPTERS[i % 3]) for i in range(6)]
    alone = [_generate(servers["stock"], ids, adapter) for ids, adapter in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: _generate(servers["ragged"], *job), jobs))
    for (ids, adapter), got, want in zip(jobs, together, alone, strict=True):
        _assert_same(got, want, f"{len(ids)} tokens, adapter {adapter}, in a mixed batch")


def test_an_adapter_loaded_while_serving(servers, tmp_path) -> None:
    """/load_lora_adapter at run time (its weights staged as at startup), served as stock
    serves it, then /unload_lora_adapter."""
    model = servers["ragged"].args[servers["ragged"].args.index("--model-path") + 1]
    path = save_lora_adapter(Path(model), tmp_path / "c", seed=3)
    ids = _prompt(4, 90)
    outs = {}
    for name, server in servers.items():
        loaded = post(server.base_url, "/load_lora_adapter", {"lora_name": "c",
                                                              "lora_path": str(path)})
        assert loaded["success"], loaded
        outs[name] = _generate(server, ids, "c")
        assert outs[name].tokens != _generate(server, ids, None).tokens, name
        unloaded = post(server.base_url, "/unload_lora_adapter", {"lora_name": "c"})
        assert unloaded["success"] and "c" not in unloaded["loaded_adapters"], unloaded
    _assert_same(outs["ragged"], outs["stock"], "adapter c, loaded at run time")


def test_the_offline_tools_merge_an_adapter_as_sglang_serves_it(servers) -> None:
    """CaptureRunner with `lora` (what `sgl-ragged-calibrate --lora` calibrates): transformers
    with the adapter merged (emulator/lora.py) gives the servers' greedy tokens for it."""
    import torch

    from sgl_ragged.emulator.runner import CaptureRunner

    args = servers["stock"].args
    model = Path(args[args.index("--model-path") + 1])
    ids = _prompt(5, 70)
    served = _generate(servers["stock"], ids, "b")
    runner = CaptureRunner(model, lora=model.parent / "b")
    seq, logprobs = torch.tensor(ids), []
    for _ in range(NEW_TOKENS):
        step = torch.log_softmax(runner.logits(seq, start=len(seq) - 1)[-1], dim=-1)
        token = int(step.argmax())
        logprobs.append(float(step[token]))
        seq = torch.cat([seq, torch.tensor([token])])
    _assert_same(Greedy(seq[len(ids):].tolist(), logprobs, 0), served, "merged adapter b")
