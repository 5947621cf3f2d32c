#!/usr/bin/env bash
# Run the test suite in the pinned venv; arguments go to pytest.
#   ./scripts/test.sh                    # everything: four shards side by side (below)
#   ./scripts/test.sh tests/unit -k pool # a subset, one pytest process
#   RAGGED_TEST_SERIAL=1 ./scripts/test.sh  # everything in one process
# Without arguments the suite runs as four pytest processes at once (tests/conftest.py,
# RAGGED_TEST_SHARD): unit-a in the foreground; unit-b and the two halves of the end-to-end
# modules with their output in files, printed when they end. The exit status is the first
# nonzero one of the four (5 where a shard collected no tests).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/env.sh
RAGGED_MODEL="$(python -m sgl_ragged.models.smollm2)"
export RAGGED_MODEL
if [[ $# -gt 0 || "${RAGGED_TEST_SERIAL:-0}" == 1 ]]; then
  exec python -m pytest -q "$@"
fi

out="$(mktemp -d /tmp/sgl-ragged-shards.XXXXXX)"
# A test server starts only with a quarter of the machine's memory available (or after 10
# minutes' wait): sgl_ragged/testing/server.py, MIN_AVAILABLE_ENV.
RAGGED_SERVER_MIN_AVAILABLE_GB="${RAGGED_SERVER_MIN_AVAILABLE_GB:-$(awk '/^MemTotal/ {printf "%.1f", $2 / 2^20 / 4}' /proc/meminfo)}"
export RAGGED_SERVER_MIN_AVAILABLE_GB
shards=(unit-b e2e-a e2e-b)  # in the background; unit-a in the foreground
pids=()
done_=()
for shard in "${shards[@]}"; do
  RAGGED_TEST_SHARD=$shard python -m pytest -q -p no:cacheprovider --durations=25 >"$out/$shard.log" 2>&1 &
  pids+=("$!")
  done_+=(0)
  echo "[test.sh] shard $shard started (pid $!, output in $out/$shard.log)"
done
stop_shards() { kill "${pids[@]}" 2>/dev/null || true; }
trap stop_shards INT TERM

# A shard's pytest result line ("N passed, ..."), else its last line: interpreter shutdown
# warnings may follow the result.
result_line() {
  grep -E '[0-9]+ (passed|failed|errors?)|no tests ran' "$1" | tail -n 1 | grep . || tail -n 1 "$1"
}

start=$SECONDS
rc=0
RAGGED_TEST_SHARD=unit-a python -m pytest -q --durations=25 2>&1 | tee "$out/unit-a.log" || rc=$?
summary=("unit-a: rc $rc after $(( (SECONDS - start) / 60 )) min, $(result_line "$out/unit-a.log")")
# The others: each one's output as soon as it ends; meanwhile a progress line a minute (so a
# run stopped from outside still shows where every shard was).
left=${#shards[@]}
while [[ $left -gt 0 ]]; do
  for i in "${!shards[@]}"; do
    [[ ${done_[$i]} -eq 1 ]] && continue
    kill -0 "${pids[$i]}" 2>/dev/null && continue
    shard_rc=0
    wait "${pids[$i]}" || shard_rc=$?
    done_[$i]=1
    left=$((left - 1))
    echo
    echo "[test.sh] ===== shard ${shards[$i]} (rc $shard_rc, $(( (SECONDS - start) / 60 )) min) ====="
    cat "$out/${shards[$i]}.log"
    summary+=("${shards[$i]}: rc $shard_rc after $(( (SECONDS - start) / 60 )) min, $(result_line "$out/${shards[$i]}.log")")
    if [[ $rc -eq 0 ]]; then rc=$shard_rc; fi
  done
  if [[ $left -gt 0 ]]; then
    sleep 60
    for i in "${!shards[@]}"; do
      [[ ${done_[$i]} -eq 1 ]] || echo "[test.sh] $(( (SECONDS - start) / 60 )) min, ${shards[$i]} running: $(tail -c 80 "$out/${shards[$i]}.log" | tr '\n' ' ')"
    done
  fi
done
echo
echo "[test.sh] all shards done after $(( (SECONDS - start) / 60 )) min:"
printf '[test.sh]   %s\n' "${summary[@]}"
exit "$rc"
