#!/usr/bin/env bash
# GPU validation in one command, for a lent GPU machine (the tool library's `device` run) whose
# python3 has torch, Triton and pytest but no SGLang: the kernel, batched-path and decode-graph
# tests (the latter with a real torch.cuda.CUDAGraph) at full shapes on the GPU, then the
# decode-attention benchmark (FlashInfer's column only where FlashInfer is installed) and its
# per-kernel breakdown (bench.decode_breakdown).
# Results go to $OUT (or ./results/gpu_check). Arguments (--precision, --batch, --context, ...)
# go to both benchmarks; those after a `--` to bench.decode_breakdown alone (--programs-per-sm,
# --sweep, --splits). BASELINE=<dir from bench.triton_baseline, carried> also times that
# revision's kernels in bench.decode_attention, on the same rows.
#   device run:  PYTHONUNBUFFERED=1 ./scripts/gpu_check.sh
#   session 18's plan for issue 21 (docs/results.md, "The H100 run (session 18)"; carry the baseline):
#     BASELINE=results/triton-baseline-34f5807 PYTHONUNBUFFERED=1 ./scripts/gpu_check.sh \
#       --precision int4 --batch 4 16 64 --context 8192 65536 --warmup 3 --repeats 10 \
#       -- --programs-per-sm 2 4 --sweep shipped 2:16:3 1:16:2 --splits uniform aot
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/device.txt"
shared=()  # arguments for both benchmarks; the rest, after `--`, for the breakdown
while (($#)) && [[ $1 != -- ]]; do shared+=("$1"); shift; done
(($#)) && shift
rc=0
xdist=()  # compile the kernels in parallel where pytest-xdist is installed (the device image has it)
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 8)
python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" tests/unit/test_kernels_aot.py \
  tests/unit/test_kernels_attention.py tests/unit/test_kernels_seal.py \
  tests/unit/test_kernels_backend.py tests/unit/test_tail_batch.py \
  tests/unit/test_batched_torch.py tests/unit/test_cuda_graph.py tests/unit/test_planning.py \
  tests/unit/test_transfer.py 2>&1 | tee "$out/tests.txt" || rc=1
baseline=()
[[ -n ${BASELINE:-} ]] && baseline=(--baseline "$BASELINE")
python3 -m bench.decode_attention --out "$out" "${shared[@]}" "${baseline[@]}" 2>&1 \
  | tee "$out/bench.txt" || rc=1
python3 -m bench.decode_breakdown --out "$out" "${shared[@]}" "$@" 2>&1 \
  | tee "$out/breakdown.txt" || rc=1
exit "$rc"
