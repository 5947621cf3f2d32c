#!/usr/bin/env bash
# Issue 21's next device call (docs/results.md, "The H100 run (session 18)"), one call of about
# 6 minutes on an H100; carry [".whl"] (./scripts/gpu_wheels.sh 1 here) so that the SGLang
# install and the checkpoint for the next call (./scripts/gpu_serve.sh) build meanwhile.
#   device run:  PYTHONUNBUFFERED=1 ./scripts/gpu_issue21.sh        (timeout_s 420)
# Everything lands in one archive, $OUT/issue21.tgz (a call brings back at most 8 files):
# pip_list.txt, pv.txt, planes_tests.txt, check/ (gpu_check.sh's files), planes/ (the
# split-planes breakdown), w4/ (4 warps against the shipped launch); summary.txt beside it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=/tmp/issue21
rm -rf "$work" && mkdir -p "$work/planes"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# SGLang and the 8-layer checkpoint for gpu_serve.sh, on the side (a warm machine keeps them).
(out=/tmp/gpu_setup; source scripts/gpu_setup.sh --layers 8 >"$work/setup.txt" 2>&1) &
setup=$!
rc=0
# The machine's packages, for scripts/device_replica.sh (its list is inferred until this is read).
python3 -m pip list --format=freeze >"$work/pip_list.txt" 2>&1
python3 scripts/gpu_codes_bisect.py pv >"$work/pv.txt" 2>&1 || rc=1
RAGGED_TRITON_PLANES=1 python3 -m pytest -q -rs -p no:cacheprovider -n 4 \
  tests/unit/test_kernels_attention.py >"$work/planes_tests.txt" 2>&1 || rc=1
OUT="$work/check" ./scripts/gpu_check.sh --precision int4 --batch 16 64 --context 8192 65536 \
  --warmup 3 --repeats 10 -- --sweep shipped --splits uniform aot >/dev/null 2>&1 || rc=1
RAGGED_TRITON_PLANES=1 python3 -m bench.decode_breakdown --out "$work/planes" \
  --precision int4 --batch 16 64 --context 8192 65536 --warmup 3 --repeats 10 \
  --sweep shipped --splits uniform >"$work/planes/breakdown.txt" 2>&1 || rc=1
# One case at 4:32:1 beside the shipped launch's rows above: 12 warps per SM instead of 8, at 1.5x
# the instructions per token (sm_90 SASS, docs/results.md "Where an int4 tile's instructions
# go"): is the int4 split kernel latency- or issue-bound?
python3 -m bench.decode_breakdown --out "$work/w4" --precision int4 --batch 16 --context 65536 \
  --warmup 3 --repeats 10 --sweep shipped 4:32:1 --splits uniform >"$work/w4.txt" 2>&1 || rc=1
wait "$setup"
{
  cat "$work/pv.txt"
  echo "## split-planes kernel tests"; tail -3 "$work/planes_tests.txt"
  echo "## kernel tests as shipped"; tail -3 "$work/check/tests.txt"
  cat "$work/check/decode_attention.md" "$work/check/decode_breakdown.md" \
    "$work/planes/decode_breakdown.md" "$work/w4/decode_breakdown.md"
  echo "## setup"; tail -4 "$work/setup.txt"
} >"$work/summary.txt" 2>&1
mkdir -p "${OUT:=results/gpu_issue21}"
cp "$work/summary.txt" "$OUT/"
tar czf "$OUT/issue21.tgz" -C "$work" .
cat "$work/summary.txt"
exit "$rc"
