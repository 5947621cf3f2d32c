#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct) on CPU with the ragged backend.
#   PORT=30000 RAGGED_PROFILE=uniform:0.3 ./scripts/serve.sh [extra launch_server args]
# The default: int4 row tiers at 0.3 of the bytes (every token kept, the best 2 of a page at
# bf16, the rest in int4: the shipped tier profile, docs/results.md "Precision before
# dropping"), attended on their codes by the native CPU kernels (--ragged-attention auto).
# Drop-only rows instead (the calibrated SnapKV profile: fewer tokens, far less accurate):
#   RAGGED_PROFILE=calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json \
#     ./scripts/serve.sh --ragged-precision bf16    # later flags win
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DEFAULT_PROFILE="$RAGGED_ROOT/calib_profiles/smollm2-135m-instruct/int4-uniform-rho0.3.json"
RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export RAGGED_MODEL
exec python -m sglang.launch_server \
  --model-path "$RAGGED_MODEL" \
  --device cpu \
  --sleep-on-idle \
  --attention-backend ragged \
  --ragged-profile "${RAGGED_PROFILE:-$DEFAULT_PROFILE}" \
  --ragged-precision int4 \
  --host 127.0.0.1 \
  --port "${PORT:-30000}" \
  "$@"
