"""Every supported architecture served by the ragged backend, held to transformers' own forward.

`config.SUPPORTED_ARCHITECTURES` admits the families whose SGLang models call RadixAttention for
plain causal attention, each with its own head layout, q/k/v biases (Qwen2, Phi-3's fused
projections, GLM-4), q/k norms (Qwen3, Qwen3-MoE, Olmo2, OLMoE, GLM-4.5), partial rotary
embeddings (StableLM, Phi, GLM-4), softmax scale (Granite's and Granite-MoE's attention
multiplier), residual layout (Command-R's parallel attention and MLP), MLP (the experts of
Mixtral, Qwen3-MoE, OLMoE, Granite-MoE and GLM-4.5's with its dense first layer, Qwen2-MoE's with
its gated shared expert, Arcee's squared ReLU) and inputs (the images of Qwen2-VL, Qwen2.5-VL and
Qwen3-VL, placed by their multimodal rotary embedding).
Here a tiny random-weight checkpoint of each (sgl_ragged/testing/tiny_model.py) is served in
float32 at `uniform:1.0` (every token kept: the rows are the full cache) and its greedy tokens
and their log-probabilities are compared with transformers' eager forward of the same
checkpoint, an implementation that shares no code with SGLang or the plugin. The default
model covers Llama everywhere else; the others are only here. The servers start a group at a
time (`GROUPS`), each group's together, so that at most three are alive at once. The
vision-language model's server also answers prompts with images, against transformers too.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from sgl_ragged.config import SUPPORTED_ARCHITECTURES
from sgl_ragged.emulator.runner import hf_model_class
from sgl_ragged.testing.server import ServerProcess
from sgl_ragged.testing.tiny_model import TINY_ARCHITECTURES, VISION_LANGUAGE, save_tiny_model
from tests.e2e.conftest import INTEGRITY_ENV, greedy, started_together

pytestmark = pytest.mark.e2e

# Three servers at a time (about 2 GB each), as many as this module started before it had
# groups: the other shards' servers share the machine's 24 GB (DEVELOPERS.md).
GROUPS = (
    ("MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"),
    ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GemmaForCausalLM"),
    ("Phi3ForCausalLM", "Olmo2ForCausalLM", "GraniteForCausalLM"),
    ("StableLmForCausalLM", "Starcoder2ForCausalLM", "Qwen2MoeForCausalLM"),
    ("OlmoeForCausalLM", "Glm4ForCausalLM", "CohereForCausalLM"),
    ("PhiForCausalLM", "OlmoForCausalLM", "GraniteMoeForCausalLM"),
    ("ArceeForCausalLM", "Glm4MoeForCausalLM", "OPTForCausalLM"),
    # last, so the image tests after the loop over every architecture find them up
    ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
     "Qwen3VLForConditionalGeneration"),
)
ARCHITECTURES = tuple(arch for group in GROUPS for arch in group)
NEW_TOKENS = 24


def test_every_supported_architecture_has_a_tiny_model() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == set(TINY_ARCHITECTURES)
    assert sorted(ARCHITECTURES) == sorted(set(SUPPORTED_ARCHITECTURES) - {"LlamaForCausalLM"})
    # the image tests run after the loop over every architecture: on the last group, still up
    assert set(VISION) == set(VISION_LANGUAGE) == set(GROUPS[-1])


class _Groups:
    """The servers of one group at a time: asking for another group's architecture stops the
    running group and starts that one (the tests run in `ARCHITECTURES` order, so each group
    starts once)."""

    def __init__(self, root: Path) -> None:
        self.root, self.group, self.stack = root, None, contextlib.ExitStack()
        self.log_dir = Path(os.environ.get("RAGGED_TEST_LOGS", "/tmp/sgl-ragged-test-logs"))
        self.served: dict[str, tuple[Path, ServerProcess]] = {}

    def get(self, arch: str) -> tuple[Path, ServerProcess]:
        group = next(g for g in GROUPS if arch in g)
        if group != self.group:
            self.close()
            made = {}
            for name in group:
                model = save_tiny_model(self.root / name, name, layers=2, kv_heads=2, q_heads=4)
                args = ["--model-path", str(model), "--device", "cpu", "--dtype", "float32",
                        "--page-size", "64", "--chunked-prefill-size", "128",
                        "--max-total-tokens", "2048", "--max-running-requests", "2",
                        "--attention-backend", "ragged", "--ragged-profile", "uniform:1.0"]
                made[name] = ServerProcess(args, env=INTEGRITY_ENV,
                                           log_path=self.log_dir / f"arch-{name}.log",
                                           startup_timeout=900)
                self.served[name] = (model, made[name])
            self.stack.enter_context(started_together(made))
            self.group = group  # only once all of them are up
        return self.served[arch]

    def close(self) -> None:
        self.stack.close()
        self.served, self.group = {}, None


@pytest.fixture(scope="module")
def groups(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Groups]:
    served = _Groups(tmp_path_factory.mktemp("arch"))
    try:
        yield served
    finally:
        served.close()


def _reference(model_path: Path, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their log-probabilities, float32, eager attention."""
    import torch

    model = hf_model_class(model_path).from_pretrained(model_path, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            prompt = torch.tensor([ids])  # every position attended (id 0 is no padding here)
            gen = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0, eos_token_id=None)
            tokens = gen.sequences[0, len(ids):].tolist()
            logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                        for s, t in zip(gen.scores, tokens, strict=True)]
            out.append((tokens, logprobs))
    return out


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_full_cache_gives_transformers_tokens(groups: _Groups, arch: str) -> None:
    model, server = groups.get(arch)
    rng = random.Random(ARCHITECTURES.index(arch))
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (30, 150, 290)]  # 1, 3, 5 pages
    for ids, (tokens, logprobs) in zip(prompts, _reference(model, prompts), strict=True):
        # ignore_eos, not min_new_tokens: that one masks the EOS logit, which moves every
        # log-probability away from transformers' (its generate is told of no EOS)
        got = greedy(server, ids, NEW_TOKENS, to_length="ignore_eos")
        assert got.tokens == tokens, f"{arch}, {len(ids)} prompt tokens"
        assert max(abs(a - b) for a, b in zip(got.logprobs, logprobs, strict=True)) < 1e-3


# ---- Images: the vision-language models' group is the last (tests run in file order) ----
VISION = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
          "Qwen3VLForConditionalGeneration")
PREAMBLE = "a picture follows, and after it one question about what it shows: "  # 66 tokens
MARKED = "<|vision_start|><|image_pad|><|vision_end|>"  # 3 tokens; the processor expands the pad


def _image(seed: int) -> tuple[Any, str]:
    """A random 256 x 512 RGB image and its data URL: 9 x 18 image tokens of 28 x 28 pixels
    (Qwen2-VL, Qwen2.5-VL, after the processor's resize to 252 x 504), 8 x 16 of 32 x 32
    (Qwen3-VL)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (256, 512, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    buffer.seek(0)
    return Image.open(buffer), "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _image_prompt(question: str) -> str:
    return PREAMBLE + MARKED + question


def _image_tokens(arch: str) -> int:
    vision = VISION_LANGUAGE[arch]["vision"]
    side = vision["patch_size"] * vision["spatial_merge_size"]
    return round(256 / side) * round(512 / side)


def _vision_reference(model_path: Path, text: str, image: Any) -> tuple[int, list[int], list[float]]:
    """transformers' prompt length (image tokens expanded), greedy tokens and log-probabilities."""
    import torch
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_path)
    model = hf_model_class(model_path).from_pretrained(model_path, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                             eos_token_id=None)
    prompt = inputs["input_ids"].shape[1]
    tokens = gen.sequences[0, prompt:].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item()
                for s, t in zip(gen.scores, tokens, strict=True)]
    return prompt, tokens, logprobs


def _generate_with_image(server: ServerProcess, text: str, url: str) -> dict[str, Any]:
    reply = requests.post(f"{server.base_url}/generate", timeout=300, json={
        "text": text, "image_data": url, "return_logprob": True,
        "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("arch", VISION)
def test_images_give_transformers_tokens(groups: _Groups, arch: str) -> None:
    """An image prompt over 4 pages and 2 prefill chunks, the same image again under another
    question (its pages from the radix cache), and another image after the same preamble (which
    must not reuse the first image's pages) each give transformers' tokens."""
    model, server = groups.get(arch)
    first, first_url = _image(0)
    other, other_url = _image(1)
    cached = []
    for image, url, question in ((first, first_url, " what is in it?"),
                                 (first, first_url, " which colour is most common?"),
                                 (other, other_url, " what is in it?")):
        text = _image_prompt(question)
        prompt, tokens, logprobs = _vision_reference(model, text, image)
        got = _generate_with_image(server, text, url)
        meta = got["meta_info"]
        assert meta["prompt_tokens"] == prompt == len(text) - len(MARKED) + 2 + _image_tokens(arch)
        assert prompt > 3 * 64, question
        assert [t for _, t, _ in meta["output_token_logprobs"]] == tokens, question
        assert max(abs(lp - want) for (lp, _, _), want
                   in zip(meta["output_token_logprobs"], logprobs, strict=True)) < 1e-3
        cached.append(meta["cached_tokens"])
    image_end = len(PREAMBLE) + 1 + _image_tokens(arch) + 1  # the preamble, the image, its markers
    assert cached[1] >= 64 * (image_end // 64)  # the preamble's and the image's pages
    assert cached[2] < len(PREAMBLE) + 1  # at most the preamble: another image's pages differ


@pytest.mark.parametrize("arch", VISION)
def test_chat_completions_take_an_image(groups: _Groups, arch: str) -> None:
    """/v1/chat/completions with an image_url part: the image is expanded into its tokens
    through the checkpoint's chat template and the answer runs to max_tokens."""
    _, server = groups.get(arch)
    _, url = _image(2)
    reply = requests.post(f"{server.base_url}/v1/chat/completions", timeout=300, json={
        "model": "tiny", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": PREAMBLE},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": " what is in it?"}]}]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["choices"][0]["finish_reason"] == "length"
    # the template's text parts, the image's markers and its tokens
    assert body["usage"]["prompt_tokens"] == \
        len(PREAMBLE) + 2 + _image_tokens(arch) + len(" what is in it?")
