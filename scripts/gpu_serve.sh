#!/usr/bin/env bash
# The mission's command on a lent GPU machine (the device tool; its python3 has torch, Triton
# and transformers but no SGLang and no network): install SGLang from the carried wheels and
# this package, with sgl_kernel's pure-torch stand-in (sgl_ragged/compat), build a random-weight
# Llama-3.1-8B-shaped checkpoint on the GPU, then bench.gpu_serve: a ragged server with decode
# CUDA graphs on and one with them off, the same greedy answers, integrity checks on.
# docs/gpu_serving.md has the whole procedure. Results go to $OUT (or ./results/gpu_serve).
#   here:        ./scripts/gpu_wheels.sh 1
#   device run:  carry [".whl"], PYTHONUNBUFFERED=1 ./scripts/gpu_serve.sh [--layers N] [bench.gpu_serve options]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_serve}"
site=/tmp/sgl-site
mkdir -p "$out"
layers=()
if [[ "${1:-}" == --layers ]]; then layers=(--layers "$2"); shift 2; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run ./scripts/gpu_wheels.sh 1 here and carry .whl" >&2; exit 1; }
if [[ ! -d "$site/sglang" ]]; then  # a warm machine keeps what an earlier call installed
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
  --target "$site" . || exit 1  # this package with its SGLang plugin entry point
export PYTHONPATH="$site"
# Every process SGLang spawns must resolve `import sgl_kernel` to the stand-in: the import hook
# in the interpreter's site-packages, or a sitecustomize on PYTHONPATH where that is read-only.
python3 -c 'from sgl_ragged.compat.sgl_kernel_cpu import write_import_hook as w; print(w())' \
  || python3 -c 'from sgl_ragged.compat.sgl_kernel_cpu import PTH_LINE; open("'"$site"'/sitecustomize.py", "w").write(PTH_LINE + "\n")' \
  || exit 1
python3 -c 'import torch, triton, transformers, sglang; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "sglang", sglang.__version__)' \
  | tee -a "$out/device.txt"
model=/tmp/llama-3.1-8b-random
[[ -f "$model/config.json" ]] || python3 -m sgl_ragged.testing.tiny_model "$model" "${layers[@]}" || exit 1
python3 -m bench.gpu_serve --model "$model" --out "$out" "$@"
