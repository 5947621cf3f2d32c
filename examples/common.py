"""What the example programs share: connecting to a server, a document to ask about, and the
server's prefix-cache counter."""

from __future__ import annotations

import argparse
import urllib.request

import sglang as sgl

# About 600 tokens: longer than several 64-token pages, so a shared prefix is sealed and cached.
DOCUMENT = " ".join(f"The code of item {i} is {1000 + 37 * i}." for i in range(50))


def code_of(item: int) -> str:
    """The answer DOCUMENT gives for `item`."""
    return str(1000 + 37 * item)


def connect(base_url: str, chat_template: str = "chatml") -> sgl.RuntimeEndpoint:
    """A RuntimeEndpoint made the default backend of `@sgl.function` programs. The default
    model (SmolLM2) speaks ChatML, which SGLang cannot infer from its local path."""
    backend = sgl.RuntimeEndpoint(base_url, chat_template_name=chat_template)
    sgl.set_default_backend(backend)
    return backend


def cached_tokens_total(base_url: str) -> float:
    """`sglang:cached_tokens_total` from /metrics (prompt tokens served from the radix cache;
    the server needs --enable-metrics)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sglang:cached_tokens_total"))


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--chat-template", default="chatml")
    return parser.parse_args()
