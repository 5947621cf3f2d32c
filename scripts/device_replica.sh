#!/usr/bin/env bash
# A copy, on this CPU machine, of what a lent GPU machine serves SGLang with: Python 3.12, its
# torch 2.11 / Triton 3.6 / transformers 5.17 / torchvision 0.26 (not the project venv's torch
# 2.14), SGLang and its missing dependencies from the carried wheels installed without their
# dependencies (scripts/gpu_wheels.txt bundle 1, as scripts/gpu_setup.sh installs them there),
# this package, and the sgl_kernel stand-in's import hook. Failures of version skew (SGLang built
# against torch 2.14, run on 2.11) show here without device time; CUDA-only paths do not.
#   ./scripts/device_replica.sh                     # build it (~3 GB, a few minutes), print its python
#   ./scripts/device_replica.sh python -m bench.multiturn --launch baseline ...   # run in it
# The venv lives at ${RAGGED_CACHE:-~/.cache/sgl-ragged}/device-replica-<hash of this script and
# gpu_wheels.txt>. The machine's packages: every version below is the H200 image's own, from
# the pip list a device call brought back in session 34 (docs/figures/h200-s34/pip_list.txt);
# MACHINE: what the tests and servers import directly, OTHERS: the image's packages that SGLang's
# server imports and bundle 1 leaves out, TESTS: the tests' extra packages, on the image too.
# numpy is the machine's 2.5.2: Triton 3.6's interpreter fails on numpy 2.5 (a 1-element loop
# bound is no longer a Python int), so to run the interpreter's kernel tests here pass
# RAGGED_REPLICA_NUMPY=2.3.5 (the project venv's; a venv of its own).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cache="${RAGGED_CACHE:-$HOME/.cache/sgl-ragged}"
numpy="${RAGGED_REPLICA_NUMPY:-2.5.2}"
hash=$( (cat scripts/device_replica.sh scripts/gpu_wheels.txt; echo "$numpy") | sha256sum | cut -c1-12)
venv="$cache/device-replica-$hash"
MACHINE=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 torchvision==0.26.0 "numpy==$numpy"
         huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 sentencepiece==0.2.2
         tiktoken==0.14.0 accelerate==1.15.0 aiohttp==3.14.3 requests==2.34.2 psutil==7.2.2
         pillow==12.3.0 pytest==9.1.1 pytest-xdist==3.8.0)
OTHERS=(uvloop==0.23.0 prometheus-client==0.26.0 einops==0.8.2 scipy==1.18.1
        python-dateutil==2.9.0.post0 xxhash==4.0.1 ninja==1.13.2 nvidia-ml-py==13.610.43
        numba==0.68.0 llvmlite==0.50.0 msgpack==1.2.3 pyyaml==6.0.3 jinja2==3.1.6
        regex==2026.9.3 tqdm==4.70.1 rich==15.0.0)
TESTS=(hypothesis==6.168.3 sortedcontainers==2.4.0)
if [[ ! -f "$venv/.complete" ]]; then
  py=$(command -v python3.12 || true)
  [[ -n "$py" ]] && "$py" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null \
    || py=$(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | head -1)
  [[ -n "$py" ]] || { echo "device_replica: no Python 3.12 here (the lent machine's version)" >&2; exit 1; }
  echo "[device_replica] building $venv (~3 GB)" >&2
  rm -rf "$venv" && "$py" -m venv "$venv"  # in place: a venv's scripts name their path
  "$venv/bin/pip" install -q "${MACHINE[@]}"
  "$venv/bin/pip" install -q --no-deps "${OTHERS[@]}" "${TESTS[@]}"
  ls .whl/sglang-*.whl >/dev/null 2>&1 || ./scripts/gpu_wheels.sh 1 >&2
  "$venv/bin/pip" install -q --no-index --no-deps --no-compile .whl/*.whl
  touch "$venv/.complete"
fi
# This checkout, editable, and the stand-in's hook (both cheap: every call).
"$venv/bin/pip" install -q --no-deps --no-build-isolation -e . >/dev/null
"$venv/bin/python" -c 'from sgl_ragged.compat.import_hook import write_import_hook as w; w()'
if [[ $# -eq 0 ]]; then
  echo "$venv/bin/python"
  exit 0
fi
export PATH="$venv/bin:$PATH"
unset PYTHONPATH
exec "$@"
