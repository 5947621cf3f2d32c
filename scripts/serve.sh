#!/usr/bin/env bash
# Serve the default model (SmolLM2-135M-Instruct) on CPU with the ragged backend.
#   PORT=30000 SGL_RAGGED_PROFILE=uniform:0.3 ./scripts/serve.sh [extra launch_server args]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
SGL_RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export SGL_RAGGED_MODEL
exec python -m sglang.launch_server \
  --model-path "$SGL_RAGGED_MODEL" \
  --device cpu \
  --sleep-on-idle \
  --attention-backend ragged \
  --ragged-profile "${SGL_RAGGED_PROFILE:-uniform:0.3}" \
  --host 127.0.0.1 \
  --port "${PORT:-30000}" \
  "$@"
