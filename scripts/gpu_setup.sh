# Sourced (not run) by scripts/gpu_serve.sh and scripts/gpu_multiturn.sh on a lent GPU machine
# (the device tool; its python3 has torch, Triton and transformers but no SGLang and no network):
# installs SGLang from the carried wheels (.whl/, ./scripts/gpu_wheels.sh 1 here) and this
# package into /tmp/sgl-site (PYTHONPATH), the import hook of sgl_kernel's pure-torch stand-in
# (sgl_ragged/compat), and builds the random-weight Llama-3.1-8B-shaped checkpoint on the GPU
# (sgl_ragged.testing.tiny_model). A warm machine keeps what an earlier call installed and built.
# Expects `out` (the results folder); takes a leading `--layers N` off the caller's arguments
# for the checkpoint (sourced without arguments, it shifts the caller's); sets `model`
# ($RAGGED_GPU_MODEL, default /tmp/llama-3.1-8b-random). With RAGGED_GPU_DRY_RUN=1 it installs
# and builds nothing (the scripts' check on a CPU, tests/unit/test_gpu_scripts.py).
site=/tmp/sgl-site
layers=()
if [[ "${1:-}" == --layers ]]; then layers=(--layers "$2"); shift 2; fi
model="${RAGGED_GPU_MODEL:-/tmp/llama-3.1-8b-random}"
mkdir -p "$out"
if [[ "${RAGGED_GPU_DRY_RUN:-0}" != 1 ]]; then
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
  python3 -c 'from sgl_ragged.compat.import_hook import write_import_hook as w; print(w())' \
    || python3 -c 'from sgl_ragged.compat.import_hook import PTH_LINE; open("'"$site"'/sitecustomize.py", "w").write(PTH_LINE + "\n")' \
    || exit 1
  python3 -c 'import torch, triton, transformers, sglang; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "sglang", sglang.__version__)' \
    | tee -a "$out/device.txt"
  [[ -f "$model/config.json" ]] || python3 -m sgl_ragged.testing.tiny_model "$model" "${layers[@]}" || exit 1
fi
