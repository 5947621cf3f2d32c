"""Every SGLang adapter of sgl-ragged; the core (mem_pool, attention_backend, kernels, scoring,
profile, budgets) imports nothing from here and nothing from SGLang at module level.

plugin.py (the `sglang.srt.plugins` entry point and its hook tables) installs server_args.py
(launch-time flags, defaults and checks; main process), scheduler_hooks.py (capacity, pool
classes, sealing before tree insertion, final-chunk flags; scheduler process) and
guard_hooks.py (the request guard, sgl_ragged/guard; main process). runtime.py is the one
hand-off between SGLang's factories in a scheduler process (`ServingSetup`); pool.py and
backend.py are SGLang's KV pool, allocator and attention backend over the core; metrics.py
puts the backend's counters on /metrics.
"""
