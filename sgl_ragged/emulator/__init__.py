"""The offline emulator: the model run without a server, as serving would compress its cache.

corpus.py (task texts) -> samples.py (token prompts) -> runner.py (HF model, post-RoPE Q/K/V
capture) -> chunks.py (serving's prefill chunks and their page statistics) -> compressed.py (the
next-token loss under page compression, in one masked forward; row tiers with both tiers
quantized through TierSelection.hi_fmt and mem_pool/tiers.py's compose_mixed; sglang_caches.py: SGLang's own quantized KV caches as baselines). Below the
budget sources (sgl_ragged/sources/) and calibration (sgl_ragged/calibrate/): it imports neither.
"""
