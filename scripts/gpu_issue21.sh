#!/usr/bin/env bash
# Issue 21's device steps in ONE call (docs/results.md, "The one-call GPU plan"; it ran in session
# 34: "The H200 run (session 34)"): a session has 15
# device minutes in all, starts included, and a machine stays warm only 30 s after a call, so a
# second call would most likely start a fresh machine (a minute or more) without the SGLang
# install of the first. Phases run in order of what the issue needs first, each under `timeout`,
# its box cut to what is left of the budget (RAGGED_GPU_BUDGET_S, default 560 s, inside the
# call's 600 s with time to pack the results):
#   pv      gpu_codes_bisect.py pv: the values' dot on joined code planes at K 16 and 32       45 s
#   tests   every kernel test as shipped (gpu_check.sh's list) at full shapes, pytest -n 16    160 s
#   serve   the mission's command: gpu_serve.sh --layers 8 --precision int4 (decode graphs on
#           and off, the same greedy outputs, integrity checks on)                             230 s
#   bench   bench.decode_breakdown (shipped launch, uniform and AOT splits; it writes after
#           every case), then bench.decode_attention (beside the copy bandwidth), drop-only
#           and int4@0.3 at batch 4, 16 and 64 x 8K and 64K                                the rest
#   planes  the split-planes kernel (RAGGED_TRITON_PLANES=1): its attention tests, then the
#           breakdown at the shipped launch                                                 the rest
# SGLang's install and the checkpoint (scripts/gpu_setup.sh) build in the background from the
# start; `serve` waits for them. A phase cut short by its box stops with SIGINT (bench.gpu_serve
# then stops its servers) and every server left is killed before the next phase.
#   here:        ./scripts/gpu_wheels.sh 1
#   device run:  carry [".whl"], timeout_s 600, PYTHONUNBUFFERED=1 ./scripts/gpu_issue21.sh
# Everything lands in $OUT/issue21.tgz (a call brings back at most 8 files): phases.txt, each
# phase's output (<phase>.txt), pip_list.txt (the machine's packages, for
# scripts/device_replica.sh), setup.txt, check/ (the benchmarks' files), serve/, planes/; and
# summary.txt beside it. RAGGED_GPU_DRY_RUN=1 prints the phases and their boxes and runs nothing
# (tests/unit/test_gpu_scripts.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
budget="${RAGGED_GPU_BUDGET_S:-560}"
dry="${RAGGED_GPU_DRY_RUN:-0}"
work="${RAGGED_GPU_WORK:-/tmp/issue21}"
rm -rf "$work" && mkdir -p "$work/check" "$work/serve" "$work/planes"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
spent=0
rc=0

# phase NAME BOX COMMAND...: COMMAND under `timeout`, its box at most what the budget has left
# (BOX 0: all of it); a phase with under 20 s left is skipped. Its output goes to NAME.txt.
phase() {
  local name=$1 box=$2 left code began
  shift 2
  if [[ "$dry" == 1 ]]; then  # a dry run's clock: the boxes so far (not the real seconds)
    left=$((budget - spent))
  else
    left=$((budget - (SECONDS - start)))
  fi
  if ((box == 0 || box > left)); then box=$left; fi
  if ((box < 20)); then
    echo "$name: skipped, $left s of the budget left" | tee -a "$work/phases.txt"
    return
  fi
  if [[ "$dry" == 1 ]]; then
    local cmd="$*"
    echo "$name: box $box s: ${cmd//$'\n'/ }" | tee -a "$work/phases.txt"
    spent=$((spent + box))  # as if it ran its whole box
    return
  fi
  echo "== $name (box $box s): $*"
  began=$SECONDS
  timeout -s INT -k 15 "$box" "$@" >"$work/$name.txt" 2>&1
  code=$?
  if [[ "$name" == serve ]]; then  # servers run in sessions of their own: none may outlive it
    pkill -f sglang.launch_server 2>/dev/null && sleep 3
    pkill -9 -f 'sglang.launch_server|sglang::' 2>/dev/null
  fi
  ((code == 0)) || rc=1
  echo "$name: rc $code in $((SECONDS - began)) s (box $box s)" | tee -a "$work/phases.txt"
  tail -4 "$work/$name.txt"
}

setup=
if [[ "$dry" != 1 ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$work/device.txt"
  python3 -m pip list --format=freeze >"$work/pip_list.txt" 2>&1
  # SGLang from the carried wheels and the 8-layer checkpoint, beside the first phases.
  (out="$work/serve"; source scripts/gpu_setup.sh --layers 8 >"$work/setup.txt" 2>&1) &
  setup=$!
fi
xdist=()
python3 -c 'import xdist' 2>/dev/null && xdist=(-n 16)
TESTS=(tests/unit/test_kernels_aot.py tests/unit/test_kernels_attention.py
       tests/unit/test_kernels_seal.py tests/unit/test_kernels_backend.py
       tests/unit/test_tail_batch.py tests/unit/test_batched_torch.py tests/unit/test_cuda_graph.py
       tests/unit/test_planning.py tests/unit/test_transfer.py)
CASES=(--precision int4 --batch 4 16 64 --context 8192 65536 --warmup 3 --repeats 10)

phase pv 45 python3 scripts/gpu_codes_bisect.py pv
phase tests 160 python3 -m pytest -q -rs -p no:cacheprovider "${xdist[@]}" "${TESTS[@]}"
[[ -n "$setup" ]] && wait "$setup"
phase serve 230 env OUT="$work/serve" ./scripts/gpu_serve.sh --layers 8 --precision int4 \
  --cuda-graph-max-bs 8
phase bench 0 bash -c 'python3 -m bench.decode_breakdown --out "$0" "$@" --sweep shipped \
  --splits uniform aot && python3 -m bench.decode_attention --out "$0" "$@"' \
  "$work/check" "${CASES[@]}"
phase planes 0 bash -c 'RAGGED_TRITON_PLANES=1 python3 -m pytest -q -rs -p no:cacheprovider \
  "$@" tests/unit/test_kernels_attention.py && RAGGED_TRITON_PLANES=1 python3 -m \
  bench.decode_breakdown --out "$0" --precision int4 --batch 16 64 --context 8192 65536 \
  --warmup 3 --repeats 10 --sweep shipped --splits uniform' "$work/planes" "${xdist[@]}"

[[ "$dry" == 1 ]] && exit 0
{
  cat "$work/phases.txt"
  echo "## pv"; tail -20 "$work/pv.txt"
  echo "## kernel tests as shipped"; tail -3 "$work/tests.txt"
  echo "## serve"; cat "$work/serve/gpu_serve.md" 2>/dev/null || tail -20 "$work/serve.txt"
  cat "$work/check/decode_attention.md" "$work/check/decode_breakdown.md" \
    "$work/planes/decode_breakdown.md" 2>/dev/null
  echo "## split-planes tests"; grep -E 'passed|failed' "$work/planes.txt" | tail -2
  echo "## setup"; tail -4 "$work/setup.txt"
} >"$work/summary.txt" 2>&1
mkdir -p "${OUT:=results/gpu_issue21}"
cp "$work/summary.txt" "$OUT/"
tar czf "$OUT/issue21.tgz" -C "$work" .
cat "$work/summary.txt"
exit "$rc"
