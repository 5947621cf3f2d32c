#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct) on CPU with the ragged backend.
#   PORT=30000 SGL_RAGGED_PROFILE=uniform:0.3 ./scripts/serve.sh [extra launch_server args]
# The default profile is the shipped calibration (SnapKV, rho 0.3): docs/calibration.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
DEFAULT_PROFILE="$SGL_RAGGED_ROOT/calib_profiles/smollm2-135m-instruct/snapkv-rho0.3.json"
SGL_RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export SGL_RAGGED_MODEL
exec python -m sglang.launch_server \
  --model-path "$SGL_RAGGED_MODEL" \
  --device cpu \
  --sleep-on-idle \
  --attention-backend ragged \
  --ragged-profile "${SGL_RAGGED_PROFILE:-$DEFAULT_PROFILE}" \
  --host 127.0.0.1 \
  --port "${PORT:-30000}" \
  "$@"
