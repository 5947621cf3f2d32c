"""Token counters that size workload contexts: a local HF tokenizer, a server's /tokenize, or a
character estimate (tests, no model needed)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

TokenCounter = Callable[[str], int]


def approx_counter(text: str) -> int:
    """About four characters per token (English prose; no tokenizer needed)."""
    return -(-len(text) // 4)


def local_counter(model_path: str | Path) -> TokenCounter:
    """Counts with the tokenizer of a local HF checkpoint (`tokenizer.json`, else transformers)."""
    path = Path(model_path)
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path))
    return lambda text: len(hf.encode(text, add_special_tokens=False))


def server_counter(base_url: str) -> TokenCounter:
    """Counts with a running SGLang server's `/tokenize` endpoint."""

    def count(text: str) -> int:
        body = json.dumps({"prompt": text, "add_special_tokens": False}).encode()
        req = urllib.request.Request(base_url + "/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(json.loads(resp.read())["count"])

    return count


def make_counter(spec: str | None, *, model: str | None, base_url: str | None) -> TokenCounter:
    """`--tokenizer` resolution: "approx", "server", a checkpoint path, or (None) the model's
    local tokenizer when a model path is known, else the server's."""
    if spec == "approx":
        return approx_counter
    if spec == "server" or (spec is None and model is None):
        if base_url is None:
            raise ValueError("--tokenizer server needs --base-url; pass --model or --tokenizer PATH")
        return server_counter(base_url)
    return local_counter(spec or model or "")
