# Sourced first by the device check scripts (run from the repository root): pipefail, unbuffered Python, $OUT (made;
# default /tmp/out) and PYTHONPATH (default the root), and `gate_tests NAME SECONDS PYTEST_ARGS...`, which runs
# `python -m pytest -q -p no:cacheprovider PYTEST_ARGS` under a timeout of SECONDS, keeps the last 40 lines of its
# output in $OUT/NAME.txt, prints the last 12, and ends the calling script (status 1, "nothing timed") unless pytest
# passed (its exit status: failures, errors, a timeout and no test collected all stop the script) and at least one
# test passed (every one skipped, e.g. on another GPU, stops it too).
gate_tests() {
  local name=$1 limit=$2
  shift 2
  if ! timeout "$limit" python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tail -40 | tee "$OUT/$name.txt" | tail -12 \
    || ! grep -q " passed" "$OUT/$name.txt"
  then
    echo "$(basename "$0"): the tests failed: nothing timed"
    exit 1
  fi
}

# `run_values LOG VAR STOP "V1 V2 .." CMD..`: CMD once for each value with VAR=value in its environment (for switches
# read once at start: one process a value), its stdout added to $OUT/LOG.jsonl and shown, its stderr to $OUT/LOG.err;
# none starts after STOP seconds of the call, each is bounded by its 590th second.
run_values() {
  local log=$1 var=$2 stop=$3 values=$4 v
  shift 4
  for v in $values; do
    [ "$SECONDS" -lt "$stop" ] || { echo "$(basename "$0"): no time left for $var=$v"; return 0; }
    echo "== $var=$v ($SECONDS s)"
    env "$var=$v" timeout $((590 - SECONDS)) "$@" 2>> "$OUT/$log.err" | tee -a "$OUT/$log.jsonl"
  done
}

set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
