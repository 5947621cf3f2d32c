#!/usr/bin/env bash
# Packed pages against the shipped int4 split kernel on a lent GPU (issue 21; docs/results.md,
# "Packed pages (session 35)"): with RAGGED_TRITON_PACK=1 (launch.packed_pages) the decode split
# kernel attends several low-tier pages at once, one per repeat of the query heads' rows, in
# the rows a 16-bit dot pads to. First bench.decode_breakdown with packing off and on in the
# same run (int4@0.3 beside drop-only at equal bytes, the shipped launches: 1 warp unpacked, 2
# packed; uniform splits), then software pipelining (stages 2, never timed for codes: unpacked
# 1:32:2 and packed 2:32:2 beside the shipped launches, at 16 x 64K only; docs/results.md, "The
# int4 split kernel's launches, compiled (session 36)"), then the attention and decode-graph tests at full shapes with packing
# on (what making it the default would need; a timeout cuts these first), with the planning
# tests that only a GPU runs (planning behind the forward in flight, session 39).
# Results go to $OUT (or ./results/gpu_pack_ab): decode_breakdown.{md,json}, stages/ (the same
# for the pipelined launches), tests.txt.
# Arguments replace the first breakdown's cases (default: --batch 16 64 --context 8192 65536).
#   device run:  PYTHONUNBUFFERED=1 ./scripts/gpu_pack_ab.sh      (estimated 130-200 s on an H200)
# RAGGED_GPU_DRY_RUN=1 prints the three commands and runs nothing (tests/unit/test_gpu_scripts.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-results/gpu_pack_ab}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cases=("$@")
((${#cases[@]})) || cases=(--batch 16 64 --context 8192 65536)
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 16)
tests=(python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}"
       tests/unit/test_kernels_attention.py tests/unit/test_cuda_graph.py
       tests/unit/test_planning.py tests/unit/test_transfer.py)
bench=(python3 -m bench.decode_breakdown --out "$out" --precision int4 "${cases[@]}"
       --warmup 3 --repeats 10 --sweep shipped --splits uniform --pack off on)
stages=(python3 -m bench.decode_breakdown --out "$out/stages" --precision int4 --batch 16
        --context 65536 --warmup 3 --repeats 10 --sweep shipped 1:32:2 2:32:2 --splits uniform
        --pack off on)
if [[ "${RAGGED_GPU_DRY_RUN:-0}" == 1 ]]; then
  echo "bench: ${bench[*]}"
  echo "stages: ${stages[*]}"
  echo "tests: RAGGED_TRITON_PACK=1 ${tests[*]}"
  exit 0
fi
mkdir -p "$out"
rc=0
"${bench[@]}" 2>&1 | tail -40 || rc=1
"${stages[@]}" 2>&1 | tail -20 || rc=1
RAGGED_TRITON_PACK=1 "${tests[@]}" >"$out/tests.txt" 2>&1 || rc=1
tail -3 "$out/tests.txt"
exit "$rc"
