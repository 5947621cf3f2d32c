"""Real SGLang servers, started once per test session (each start takes a minute or more)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from sgl_ragged.models.smollm2 import DEFAULT_PRECISION, DEFAULT_PROFILE, ensure_smollm2
from sgl_ragged.testing.server import ServerProcess

REPO = Path(__file__).resolve().parents[2]

PAGE = 64
CHUNK = 256
COMMON = ["--device", "cpu", "--page-size", str(PAGE), "--chunked-prefill-size", str(CHUNK),
          "--log-level", "info", "--enable-cache-report"]
# Every forward pass of a test server runs the pool's integrity check; a violation kills the
# scheduler, which the next request (and the health check) notices.
INTEGRITY_ENV = {"RAGGED_CHECK_INTEGRITY": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(os.environ.get("RAGGED_MODEL") or ensure_smollm2())


def cpu_bind(ranks: int, share: bool = False) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND giving each of `ranks` CPU scheduler processes (--tp-size,
    --dp-size, --pp-size) its own share of this process's cores: SGLang requires it on the CPU
    where ranks outnumber NUMA nodes. With `share`, ranks beyond the cores take them again in
    turn (rank r on core r mod cores: slower, for correctness checks of many ranks)."""
    cores = sorted(os.sched_getaffinity(0))
    if share and len(cores) < ranks:
        return "|".join(str(cores[r % len(cores)]) for r in range(ranks))
    if len(cores) < ranks:
        pytest.skip(f"{ranks} CPU ranks need {ranks} cores, this machine has {len(cores)}")
    share = len(cores) // ranks
    return "|".join(",".join(map(str, cores[r * share:(r + 1) * share])) for r in range(ranks))


@contextmanager
def started_together(servers: Mapping[Any, ServerProcess]) -> Iterator[Mapping[Any, ServerProcess]]:
    """Start `servers` at once (each start is mostly single-threaded imports), yield them, and
    stop every one at exit, started or not."""
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for future in [pool.submit(server.start) for server in servers.values()]:
                future.result()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def _start(request: pytest.FixtureRequest, args: list[str], name: str,
           env: dict[str, str] | None = None) -> ServerProcess:
    log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs"))
    server = ServerProcess(args, env={**INTEGRITY_ENV, **(env or {})},
                           log_path=log_dir / f"{name}.log", startup_timeout=900)
    server.start()
    request.addfinalizer(server.stop)
    return server


@pytest.fixture(scope="session")
def ragged_server(request: pytest.FixtureRequest, model_path: str) -> ServerProcess:
    """The ragged backend as the README serves it: per-head precision at 0.3 of the bytes (each
    KV head's low tier in int8, int4 or int2: smollm2.DEFAULT_PROFILE and DEFAULT_PRECISION), on the CPU default path (the native kernels for decode), with a small
    pool so that memory pressure (eviction, retraction) is reachable by a test: admission
    reserves only 0.21 (0.7 x 0.3) of a request's max_new_tokens, so requests that decode their
    whole budget run the pool out and decode retracts. The shared server of the serving, guard,
    fuzz, soak and example tests."""
    return _start(request, ["--model-path", model_path, *COMMON, "--attention-backend", "ragged",
                            "--ragged-profile", str(REPO / DEFAULT_PROFILE),
                            "--ragged-precision", DEFAULT_PRECISION, "--max-total-tokens", "4096",
                            "--max-running-requests", "8", "--schedule-conservativeness", "0.3",
                            "--enable-metrics"], "ragged")


@pytest.fixture(scope="session")
def oracle_pair(request: pytest.FixtureRequest, model_path: str) -> tuple[ServerProcess, ServerProcess]:
    """float32 servers for the ratio-1.0 oracle: ragged uniform:1.0 and stock torch_native (with
    hidden states and custom logit processors on, for the requests that ask for them)."""
    f32 = ["--model-path", model_path, *COMMON, "--dtype", "float32", "--max-total-tokens", "8192",
           "--max-running-requests", "4", "--disable-radix-cache",
           "--enable-return-hidden-states", "--enable-custom-logit-processor"]
    ragged = _start(request, [*f32, "--attention-backend", "ragged", "--ragged-profile", "uniform:1.0"],
                    "oracle-ragged")
    native = _start(request, [*f32, "--attention-backend", "torch_native"], "oracle-native")
    return ragged, native


def post(base_url: str, path: str, payload: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    req = urllib.request.Request(base_url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Greedy(NamedTuple):
    """A greedy /generate answer: output ids, their log-probabilities, cached prompt tokens."""

    tokens: list[int]
    logprobs: list[float]
    cached: int


def greedy(server: ServerProcess, ids: list[int], new_tokens: int = 24,
           to_length: str | None = None) -> Greedy:
    """Greedy /generate of prompt ids with log-probabilities. `to_length` decodes all
    `new_tokens`: "min_new_tokens" by masking the EOS logit (SGLang's min_new_tokens; that moves
    every log-probability a little), "ignore_eos" past EOS with the logits untouched."""
    if to_length not in (None, "min_new_tokens", "ignore_eos"):
        raise ValueError(f"to_length {to_length!r}: use None, 'min_new_tokens' or 'ignore_eos'")
    sampling: dict[str, Any] = {"max_new_tokens": new_tokens, "temperature": 0}
    if to_length == "min_new_tokens":
        sampling["min_new_tokens"] = new_tokens
    elif to_length == "ignore_eos":
        sampling["ignore_eos"] = True
    out = post(server.base_url, "/generate", {
        "input_ids": ids, "return_logprob": True, "sampling_params": sampling})
    pairs = out["meta_info"]["output_token_logprobs"]
    return Greedy([p[1] for p in pairs], [p[0] for p in pairs], out["meta_info"]["cached_tokens"])


def post_raw(base_url: str, path: str, payload: dict[str, Any], timeout: float = 300) -> str:
    """POST a JSON payload; the response body as text (for endpoints that answer no JSON)."""
    req = urllib.request.Request(base_url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read().decode()


def get(base_url: str, path: str, timeout: float = 60) -> str:
    with urllib.request.urlopen(base_url + path, timeout=timeout) as resp:
        return resp.read().decode()


def stream_lines(base_url: str, path: str, payload: dict[str, Any]) -> Iterator[str]:
    req = urllib.request.Request(base_url + path, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data:"):
                yield line[5:].strip()
