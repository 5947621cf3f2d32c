#!/usr/bin/env bash
# The mission's command on a lent GPU machine (the device tool; its python3 has torch, Triton
# and transformers but no SGLang and no network): install SGLang from the carried wheels and
# this package, with sgl_kernel's pure-torch stand-in (sgl_ragged/compat), build a random-weight
# Llama-3.1-8B-shaped checkpoint on the GPU (all of it scripts/gpu_setup.sh), then
# bench.gpu_serve: a ragged server with decode CUDA graphs and the overlap scheduler on and one
# with both off, the same greedy answers, integrity checks on.
# docs/gpu_serving.md has the whole procedure. Results go to $OUT (or ./results/gpu_serve).
#   here:        ./scripts/gpu_wheels.sh 1
#   device run:  carry [".whl"], PYTHONUNBUFFERED=1 ./scripts/gpu_serve.sh [--layers N] [bench.gpu_serve options]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_serve}"
source scripts/gpu_setup.sh  # takes a leading --layers N off the arguments
python3 -m bench.gpu_serve --model "$model" --out "$out" "$@"
