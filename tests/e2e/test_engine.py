"""SGLang's offline engine with the ragged backend: `sglang.Engine(..., attention_backend="ragged",
ragged_profile=...)`, the ragged flags as keywords (sgl_ragged/serving/engine_args.py).

A script, as a user writes one, runs the engine in its own process on a tiny random-weight
Llama in float32 at `uniform:1.0` (the rows are the full cache): its greedy tokens are
transformers', again from the radix cache, and a second engine of the same process that passes
no profile is refused for the want of one (the first one's keywords do not leak into it), as is
a bad keyword value, with the flag's own message.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sgl_ragged.testing.tiny_model import save_tiny_llama
from tests.e2e.conftest import INTEGRITY_ENV

pytestmark = pytest.mark.e2e

NEW_TOKENS = 16

SCRIPT = textwrap.dedent("""
    import json, sys
    import sglang as sgl

    def refusal(**kwargs):
        try:
            sgl.Engine(model_path=model, device="cpu", attention_backend="ragged", **kwargs)
        except ValueError as exc:
            return str(exc)
        return None

    if __name__ == "__main__":
        model, ids, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
        engine = sgl.Engine(model_path=model, device="cpu", dtype="float32", page_size=64,
                            max_total_tokens=2048, attention_backend="ragged",
                            ragged_profile="uniform:1.0", ragged_check_integrity=True)
        sampling = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        outs = [engine.generate(input_ids=ids, sampling_params=sampling) for _ in range(2)]
        engine.shutdown()
        print("RESULT " + json.dumps({
            "tokens": [o["output_ids"] for o in outs],
            "cached": [o["meta_info"]["cached_tokens"] for o in outs],
            "no_profile": refusal(),
            "bad_window": refusal(ragged_profile="uniform:0.5", ragged_window_pages=-1),
        }))
""")


def _transformers_greedy(model: Path, ids: list[int]) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS)
    return out[0, len(ids):].tolist()


def test_offline_engine_takes_the_ragged_flags_as_keywords(tmp_path: Path) -> None:
    model = save_tiny_llama(tmp_path / "llama")
    rng = random.Random(0)
    ids = [rng.randrange(3, 256) for _ in range(150)]  # two full pages and a partial one
    script = tmp_path / "engine_script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAGGED_PROFILE")}
    done = subprocess.run([sys.executable, str(script), str(model), json.dumps(ids),
                           str(NEW_TOKENS)], capture_output=True, text=True, timeout=900,
                          env={**env, **INTEGRITY_ENV}, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    want = _transformers_greedy(model, ids)
    assert result["tokens"] == [want, want]
    assert result["cached"] == [0, 128]
    assert "needs a budget profile" in result["no_profile"]
    assert "--ragged-window-pages must be >= 0, got -1" in result["bad_window"]
