"""HTTP side of the multi-turn harness: one streamed chat request, timed, and a poller of the
server's Prometheus `/metrics` (SGLang needs `--enable-metrics`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

METRICS = {"sglang:num_running_reqs": "running", "sglang:num_queue_reqs": "queued",
           "sglang:token_usage": "token_usage", "sglang:num_used_tokens": "used_tokens"}


@dataclass
class RequestRecord:
    """One chat request as the client saw it; times are seconds from the run's start."""

    session: int
    turn: int
    task: str
    start: float  # request sent
    first_token_at: float | None = None  # first content token arrived
    done_at: float | None = None  # last byte arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    expected: str | None = None
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def latency(self) -> float | None:
        """Time to the last byte."""
        return None if self.done_at is None else self.done_at - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_at is None or self.done_at is None or self.output_tokens < 2:
            return None
        return (self.done_at - self.first_token_at) / (self.output_tokens - 1)


def chat_payload(messages: list[dict[str, Any]], max_tokens: int, model: str = "default") -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}


async def stream_chat(http: aiohttp.ClientSession, base_url: str, payload: dict[str, Any],
                      record: RequestRecord, t0: float) -> RequestRecord:
    """POST a streamed chat completion and fill `record` (times relative to `t0`)."""
    pieces: list[str] = []
    try:
        async with http.post(base_url + "/v1/chat/completions", json=payload) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return record
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                _absorb(json.loads(line[5:]), record, pieces, time.perf_counter() - t0)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.done_at = time.perf_counter() - t0
    record.text = "".join(pieces)
    return record


def _absorb(chunk: dict[str, Any], record: RequestRecord, pieces: list[str], now: float) -> None:
    """One SSE chunk: content deltas (the first sets TTFT) and the final usage."""
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if record.first_token_at is None:
                record.first_token_at = now
            pieces.append(content)
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = int(details.get("cached_tokens") or 0)


def parse_metrics(text: str) -> dict[str, float]:
    """Sum of each gauge in METRICS over its label sets, keyed by METRICS' short names."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            value = float(line.rsplit(" ", 1)[1])
            out[METRICS[name]] = out.get(METRICS[name], 0.0) + value
    return out


@dataclass
class MetricsPoller:
    """Polls `/metrics` every `interval` seconds into `samples` ([{"t": s, name: value}])."""

    base_url: str
    interval: float = 0.5
    samples: list[dict[str, float]] = field(default_factory=list)
    available: bool = True

    async def run(self, http: aiohttp.ClientSession, t0: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                async with http.get(self.base_url + "/metrics") as resp:
                    if resp.status != 200:
                        self.available = False
                        return
                    values = parse_metrics(await resp.text())
                self.samples.append({"t": time.perf_counter() - t0, **values})
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass
