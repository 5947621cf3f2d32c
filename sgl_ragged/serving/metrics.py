"""Compression counters on SGLang's /metrics endpoint (with --enable-metrics).

SGLang exports scheduler-process metrics through prometheus_client's multiprocess mode, so
counters created here (in the scheduler) appear beside SGLang's own as `sglang:ragged_*`.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from sgl_ragged.mem_pool.storage import SealCounters


class RaggedMetrics:
    """Pushes the storage's SealCounters deltas and staging use to Prometheus."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.counters = {
            "pages_sealed": Counter("sglang:ragged_pages_sealed", "Logical pages compressed"),
            "tokens_sealed": Counter("sglang:ragged_tokens_sealed", "Logical tokens in sealed pages"),
            "entries_kept": Counter("sglang:ragged_entries_kept",
                                    "(token, KV head, layer) entries kept by sealing"),
            "entries_seen": Counter("sglang:ragged_entries_seen",
                                    "(token, KV head, layer) entries offered to sealing"),
        }
        self.integrity_checks = Counter("sglang:ragged_integrity_checks",
                                        "Pool integrity checks passed (--ragged-check-integrity 1)")
        self.integrity_violations = Counter("sglang:ragged_integrity_violations",
                                            "Pool integrity checks failed (the scheduler stops)")
        self.staging = Gauge("sglang:ragged_staging_pages_used", "Staging pages held by requests",
                             multiprocess_mode="mostrecent")
        self._last = SealCounters()

    def update(self, counters: SealCounters, staging_in_use: int) -> None:
        now, last = asdict(counters), asdict(self._last)
        for name, counter in self.counters.items():
            if now[name] > last[name]:
                counter.inc(now[name] - last[name])
        self._last = SealCounters(**now)
        self.staging.set(staging_in_use)

    def integrity(self, ok: bool) -> None:
        """Count one integrity check of the pool."""
        (self.integrity_checks if ok else self.integrity_violations).inc()


def make_metrics() -> RaggedMetrics | None:
    """Metrics when SGLang runs with --enable-metrics (its multiprocess dir is set), else None."""
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return None
    return RaggedMetrics()
