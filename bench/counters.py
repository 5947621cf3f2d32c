"""What the server itself counts: Prometheus counters on `/metrics` (`--enable-metrics`) and the
scheduler's live pool figures on `/v1/loads`. The soak (and the tests) report these, never the
client's guesses."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import NamedTuple

# Short name -> Prometheus counter (summed over label sets). SGLang's own and the plugin's.
COUNTERS = {
    "requests": "sglang:num_requests_total",  # requests the server finished (any reason)
    "aborted": "sglang:num_aborted_requests_total",  # aborts (client disconnects) it handled
    "retracted": "sglang:num_retracted_requests_total",  # decode retractions (pool ran out)
    "evicted_tokens": "sglang:evicted_tokens_total",  # radix-cache slots freed by eviction
    "pages_sealed": "sglang:ragged_pages_sealed_total",
    "integrity_checks": "sglang:ragged_integrity_checks_total",
    "integrity_violations": "sglang:ragged_integrity_violations_total",
}


def _get(base_url: str, path: str, timeout: float = 60.0) -> str:
    with urllib.request.urlopen(base_url + path, timeout=timeout) as resp:
        return resp.read().decode()


def parse_counters(text: str, names: dict[str, str] = COUNTERS) -> dict[str, float]:
    """Every `names` entry (short name -> Prometheus counter; COUNTERS unless given) in a
    /metrics page, summed over its label sets (0 when absent), keyed by its short name."""
    by_metric = {metric: short for short, metric in names.items()}
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in by_metric:
            out[by_metric[name]] += float(line.rsplit(" ", 1)[1])
    return out


def counters(base_url: str) -> dict[str, float]:
    """The server's COUNTERS now."""
    return parse_counters(_get(base_url, "/metrics"))


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """after - before, per counter."""
    return {name: round(after[name] - before[name]) for name in before}


class PoolState(NamedTuple):
    """The scheduler's pool and queues (from /v1/loads), in logical tokens."""

    max_total_tokens: int
    used_tokens: int  # held by requests (the radix cache's evictable tokens are not counted)
    running: int
    waiting: int

    @property
    def free_tokens(self) -> int:
        """Tokens a new request can get: free plus evictable."""
        return self.max_total_tokens - self.used_tokens


def pool_state(base_url: str) -> PoolState:
    load = json.loads(_get(base_url, "/v1/loads"))["loads"][0]
    return PoolState(int(load["max_total_num_tokens"]), int(load["num_used_tokens"]),
                     int(load["num_running_reqs"]), int(load["num_waiting_reqs"]))


def wait_idle(base_url: str, idle_used: int = 0, timeout: float = 120.0) -> PoolState:
    """Poll until nothing runs or waits and requests hold `idle_used` tokens (the idle server's
    figure), or `timeout` passes; returns the last state seen (the caller judges it)."""
    deadline = time.monotonic() + timeout
    state = pool_state(base_url)
    while ((state.running or state.waiting or state.used_tokens != idle_used)
           and time.monotonic() < deadline):
        time.sleep(0.2)
        state = pool_state(base_url)
    return state
