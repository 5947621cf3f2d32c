#!/usr/bin/env bash
# Issue 21 step 5b's req/s table on a lent GPU machine, in one call: after scripts/gpu_setup.sh
# (SGLang from the carried wheels, the sgl_kernel stand-in, the random Llama-3.1-8B-shaped
# checkpoint; a warm machine after scripts/gpu_serve.sh skips most of it), bench.multiturn
# starts four servers at once (--start-together: the GPU holds them all) and measures them one
# after the other at the KV bytes of a 16384-token stock bf16 pool
# (2 GiB: 32 layers x 8 KV heads x 128 x K,V x 2 B = 128 KiB a token), in this order, so that a
# timeout still leaves the headline pair: stock `triton` bf16 (16384 tokens), ragged int4@0.3
# (47296 logical tokens), stock `triton` with --kv-cache-dtype fp8_e4m3 (32768) and ragged
# drop-only bf16@0.3 (46656). Workload: 12 users, 12 sessions x 4 turns over ~2800-token chat
# contexts (byte tokenizer: a token a byte), 32 answer tokens (about 150 bytes of history each);
# the 12 live histories hold about 34K tokens at the first turn, 42K at the last: 4-5 fit the
# stock pool, 9-10 the fp8 one, all of them the ragged ones (`RAGGED_GPU_DRY_RUN=1` prints the
# plan and installs nothing; tests/unit/test_gpu_scripts.py checks it).
# Random weights answer nonsense: accuracy is not measured (the chat task is unscored), only
# req/s, TTFT, TPOT and the prefix hit rate.
# Device time, ESTIMATED: setup on a warm machine about 20 s (cold: + about 1-2 min, the wheels
# and the checkpoint); the four starts together about as long as one (session 34 measured one
# server of 2 layers up in 83-107 s and one of 8 in 154 s, one after the other: about 6 minutes
# for four; a server that fails beside the others starts again alone after them); each run
# 10-40 s (stock recomputes about 150K prompt tokens, ragged about 40K, at an assumed 5K
# prefill tokens/s); each stop up to 20 s: about 4-5 minutes at 2 layers. bench.multiturn
# writes after each server: a timeout keeps the finished rows.
# Results go to $OUT (or ./results/gpu_multiturn): multiturn.md/.json (plots where matplotlib
# imports), multiturn.txt, logs/ (the servers'), device.txt. Extra arguments go to
# bench.multiturn (a later --sessions, --turns, ... wins; a --launch adds a fifth server).
#   here:        ./scripts/gpu_wheels.sh 1
#   device run:  carry [".whl"], timeout_s 540,
#                PYTHONUNBUFFERED=1 ./scripts/gpu_multiturn.sh [--layers N] [bench.multiturn options]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_multiturn}"
source scripts/gpu_setup.sh  # takes a leading --layers N off the arguments
dry=()
[[ "${RAGGED_GPU_DRY_RUN:-0}" == 1 ]] && dry=(--dry-run)
python3 -m bench.multiturn --device cuda --model "$model" \
  --launch baseline --launch ragged@int4:uniform:0.3 \
  --launch baseline@fp8_e4m3 --launch ragged:uniform:0.3 \
  --kv-budget-tokens 16384 --max-running-requests 12 --chunked-prefill-size 4096 \
  --tasks chat --sessions 12 --turns 4 --context-tokens 2800 --concurrency 12 \
  --max-tokens 32 --seed 0 --start-together --out "$out" "${dry[@]}" "$@" 2>&1 \
  | tee "$out/multiturn.txt"
