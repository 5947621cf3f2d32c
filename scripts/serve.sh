#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct) on CPU with the ragged backend.
#   PORT=30000 RAGGED_PROFILE=uniform:0.3 ./scripts/serve.sh [extra launch_server args]
# The precision (and the rotation) is the profile's own (--ragged-precision auto: mixed for the
# default per-head profile, bf16 for uniform:<r> or a drop-only file); RAGGED_PRECISION or a
# later --ragged-precision picks another.
# The default: per-head precision at 0.3 of the bytes (each KV head's low tier in int8, int4 or
# int2 and its share of bf16 slots and dropped tokens as the shipped searched profile says, 51
# of 64 tokens kept per page on average:
# docs/results.md "Per-head precision, searched"), attended on their codes by the native CPU
# kernels (--ragged-attention auto). Uniform int4 rows of the same bytes (the previous default):
#   RAGGED_PROFILE=calib_profiles/smollm2-135m-instruct/int4-uniform-rho0.3.json ./scripts/serve.sh
# Drop-only rows instead (the calibrated SnapKV profile: fewer tokens, far less accurate):
#   RAGGED_PROFILE=calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json ./scripts/serve.sh
# OpenMP's idle workers spin some tens of microseconds (GOMP_SPINCOUNT=3000) before they sleep,
# where env.sh (tests, benchmarks) has them sleep at once: a decode step of 8 requests runs
# ~90 parallel regions (the dense layers' products, perf probe on GOMP_parallel), and
# waking a sleeping worker for each cost a single server x1.09-1.26 decode tokens/s (with the
# spin the small decode products also split over both cores: compat/cpu_gemm.dot_serial_macs;
# docs/results.md, "Decode's small products on both cores (session 33)"). On a machine shared
# with other busy processes (two decoding servers on 2 cores: x0.76 with it) pass
# GOMP_SPINCOUNT=0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export GOMP_SPINCOUNT="${GOMP_SPINCOUNT:-3000}"
DEFAULT_PROFILE="$RAGGED_ROOT/calib_profiles/smollm2-135m-instruct/mixed-uniform-rho0.3.json"
RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export RAGGED_MODEL
exec python -m sglang.launch_server \
  --model-path "$RAGGED_MODEL" \
  --device cpu \
  --sleep-on-idle \
  --attention-backend ragged \
  --ragged-profile "${RAGGED_PROFILE:-$DEFAULT_PROFILE}" \
  --ragged-precision "${RAGGED_PRECISION:-auto}" \
  --host 127.0.0.1 \
  --port "${PORT:-30000}" \
  "$@"
