#!/usr/bin/env bash
# Run the test suite in the pinned venv; arguments go to pytest.
#   ./scripts/test.sh                    # everything: three shards side by side (below)
#   ./scripts/test.sh tests/unit -k pool # a subset, one pytest process
#   RAGGED_TEST_SERIAL=1 ./scripts/test.sh  # everything in one process
# Without arguments the suite runs as three pytest processes at once (tests/conftest.py,
# RAGGED_TEST_SHARD): the unit tests in the foreground, the two halves of the end-to-end
# modules with their output in files, printed when they end. The exit status is the first
# nonzero one of the three (5 where a shard collected no tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export RAGGED_MODEL
if [[ $# -gt 0 || "${RAGGED_TEST_SERIAL:-0}" == 1 ]]; then
  exec python -m pytest -q "$@"
fi

out="$(mktemp -d /tmp/sgl-ragged-shards.XXXXXX)"
pids=()
for shard in e2e-a e2e-b; do
  RAGGED_TEST_SHARD=$shard python -m pytest -q -p no:cacheprovider --durations=15 >"$out/$shard.log" 2>&1 &
  pids+=("$!")
  echo "[test.sh] shard $shard started (pid $!, output in $out/$shard.log)"
done
stop_shards() { kill "${pids[@]}" 2>/dev/null || true; }
trap stop_shards INT TERM

start=$SECONDS
rc=0
RAGGED_TEST_SHARD=unit python -m pytest -q --durations=25 2>&1 | tee "$out/unit.log" || rc=$?
summary=("unit: rc $rc after $(( (SECONDS - start) / 60 )) min, $(tail -n 1 "$out/unit.log")")
i=0
for shard in e2e-a e2e-b; do
  shard_rc=0
  wait "${pids[$i]}" || shard_rc=$?
  i=$((i + 1))
  echo
  echo "[test.sh] ===== shard $shard (rc $shard_rc) ====="
  cat "$out/$shard.log"
  summary+=("$shard: rc $shard_rc, $(tail -n 1 "$out/$shard.log")")
  if [[ $rc -eq 0 ]]; then rc=$shard_rc; fi
done
echo
echo "[test.sh] all shards done after $(( (SECONDS - start) / 60 )) min:"
printf '[test.sh]   %s\n' "${summary[@]}"
exit "$rc"
