#!/usr/bin/env bash
# Packed pages against the shipped int4 split kernel on a lent GPU (issue 21; docs/results.md,
# "Packed pages (session 35)"): with RAGGED_TRITON_PACK=1 (launch.packed_pages) the decode split
# kernel attends several low-tier pages at once, one per repeat of the query heads' rows, in
# the rows a 16-bit dot pads to. First the attention, backend and decode-graph tests at full
# shapes with packing on, then bench.decode_breakdown with it off and on in the same run
# (int4@0.3 beside drop-only at equal bytes, uniform splits; the shipped launches, 1 warp
# unpacked and 2 packed, and 4 warps / BLOCK_N 32 for both: sm_90 builds at D 128, packed 254
# registers and 33.5 warp instructions a token, unpacked 140 and 56.8).
# Results go to $OUT (or ./results/gpu_pack_ab): tests.txt, decode_breakdown.{md,json}.
# Arguments replace the breakdown's cases (default: --batch 16 64 --context 8192 65536).
#   device run:  PYTHONUNBUFFERED=1 ./scripts/gpu_pack_ab.sh      (about 70-100 s on an H200)
# RAGGED_GPU_DRY_RUN=1 prints the two commands and runs nothing (tests/unit/test_gpu_scripts.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_pack_ab}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cases=("$@")
((${#cases[@]})) || cases=(--batch 16 64 --context 8192 65536)
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 16)
tests=(python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}"
       tests/unit/test_kernels_attention.py tests/unit/test_kernels_backend.py
       tests/unit/test_cuda_graph.py)
bench=(python3 -m bench.decode_breakdown --out "$out" --precision int4 "${cases[@]}"
       --warmup 3 --repeats 10 --sweep shipped 4:32:1 --splits uniform --pack off on)
if [[ "${RAGGED_GPU_DRY_RUN:-0}" == 1 ]]; then
  echo "tests: RAGGED_TRITON_PACK=1 ${tests[*]}"
  echo "bench: ${bench[*]}"
  exit 0
fi
mkdir -p "$out"
rc=0
RAGGED_TRITON_PACK=1 "${tests[@]}" >"$out/tests.txt" 2>&1 || rc=1
tail -3 "$out/tests.txt"
"${bench[@]}" 2>&1 | tail -40 || rc=1
exit "$rc"
