#!/usr/bin/env bash
# One device run of every GPU test: install (editable, the image's CuPy), the kernel and model
# tests, the request-shape tests (long prompts, chunked prefill, preemption), then the slow tests
# on a Kimi-Linear-48B-shaped 4-layer random checkpoint.  Logs land in $OUT.
# The whole gpu-marked set (842 tests, 2026-12-03) takes more than one device call: split it with
# PART=1 (tests/engine, tests/gpu and tests/kernels up to test_mla_store.py), PART=2 (the other kernel tests) or
# PART=3 (the slow 48B-shaped test alone), PART=engine (tests/engine and tests/gpu: after an engine change that
# touched no kernel); unset: all of it.  pytest's 40 slowest tests (--durations) are in
# $OUT/pytest_gpu.txt: where the GPU suite's time goes (NVRTC builds, host references, the GPU), to make it fit.
# Two ways to make it shorter, both optional:
# - the kernel cache: the run leaves $OUT/kcache.tar.xz (the cubins it built or loaded, when under 15 MiB;
#   tests/gpu/kcache.py); copy it to .kcache/ (git-ignored) and carry ".kcache": a later call (or session) loads every
#   kernel whose source, headers, options, arch and NVRTC version are unchanged instead of compiling it (the cache is
#   keyed by all of them).  Several calls' archives: `python tests/gpu/kcache.py merge .kcache/kcache.tar.xz
#   .kcache/kcache.tar.xz RETURNED...` keeps every cubin of them in the carried one.
# - XDIST=N runs the non-slow tests in N pytest-xdist processes (--dist loadfile: a file's tests in one process,
#   PART=2 --dist load: any test in any process;
#   pytest-xdist is on the device image); the kernel-builds summary line then counts only the main process (the
#   workers build).  H200, 2026-12-03, XDIST=4 with a carried cache: PART=2 502 passed in 354 s, PART=1 317 passed in
#   211 s, PART=3 16 s: the whole set in two calls (serially ~40% of it took 480 s).
#   2026-12-04: PART=1 353 tests in 241 s; PART=2 (628 tests) cut at ~524 by PYTEST_TIMEOUT=360 with XDIST=6 and loadfile.
# PYTEST_TIMEOUT=S stops the non-slow tests after S seconds and still packs the kernel cache (wrapping this script in
# `timeout` loses the cache of a run cut short: the fifty-third session's PART=2 call).
# The exit status is the tests' (the first failing pytest's), not the cache's.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=$PWD
mkdir -p "$OUT"
pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v -i "running pip as" | tail -5
# llguidance + jsonschema for the structured-output tests on the CUDA backend (not on the device image):
# carry .whl with .whl/extra/ filled by `pip download` (see the device README)
if ls .whl/extra/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/extra .whl/extra/*.whl
  export PYTHONPATH=$PYTHONPATH:/tmp/extra
fi
export KDA_RT_CACHE_DIR=${KDA_RT_CACHE_DIR:-$HOME/.cache/kda_rt}
if [ -f .kcache/kcache.tar.xz ]; then
  python tests/gpu/kcache.py unpack .kcache/kcache.tar.xz "$KDA_RT_CACHE_DIR"
fi
touch /tmp/kcache.stamp  # cubins touched after this were used by this run (compile_cubin touches a cache hit)
xdist=""
if [ -n "${XDIST:-}" ] && [ "$XDIST" -gt 4 ]; then
  # an 80 GB card (H100): six workers' memory starved one test's engine there (fifty-ninth session): four at most
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2> /dev/null | head -1)
  if [ -n "$mib" ] && [ "$mib" -lt 100000 ]; then
    echo "device_run.sh: ${mib} MiB of GPU memory: XDIST $XDIST -> 4"
    XDIST=4
  fi
fi
if [ -n "${XDIST:-}" ]; then
  # PART=2: test by test (its two largest files, test_moe_block.py and test_moe_gemm_tc.py, ~300 tests, each ran
  # alone in one worker past the call's end in the fifty-fourth session; their module fixtures then repeat a worker)
  dist=loadfile; [ "${PART:-all}" != 2 ] || dist=load
  # each worker's NumPy references get their share of the cores (BLAS threads in every worker oversubscribe them)
  threads=$(( $(nproc) / XDIST )); [ "$threads" -ge 1 ] || threads=1
  export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-$threads} OMP_NUM_THREADS=${OMP_NUM_THREADS:-$threads}
  if python -c "import xdist" 2> /dev/null; then xdist="-n $XDIST --dist $dist"
  else echo "device_run.sh: XDIST=$XDIST but pytest-xdist is not importable: a serial run"; fi
fi
rc=0
kernels=$(ls tests/kernels/test_*.py | sort)
case "${PART:-all}" in
  1) targets="tests/engine tests/gpu $(echo "$kernels" | awk '$0 <= "tests/kernels/test_mla_store.py"')" ;;
  engine) targets="tests/engine tests/gpu" ;;  # the engine's GPU tests alone (an engine change, no kernel change)
  2) targets=$(echo "$kernels" | awk '$0 > "tests/kernels/test_mla_store.py"') ;;
  3) targets="" ;;
  all) targets=tests ;;
  *) echo "device_run.sh: PART must be 1, 2, 3 or engine (or unset), got '$PART'" >&2; exit 2 ;;
esac
if [ "${PART:-all}" = all ] || [ "$PART" = 3 ]; then
  python tests/helpers/configs.py /tmp/k48.json 4
  python -m kda_rt.random_checkpoint --config /tmp/k48.json --out /tmp/k48 --seed 1 --fixed-routing > /dev/null &
  CK=$!
fi
if [ -n "$targets" ]; then
  # shellcheck disable=SC2086
  timeout "${PYTEST_TIMEOUT:-0}" python -m pytest -q -m "gpu and not slow" $targets -p no:cacheprovider -rs --durations=40 \
    $xdist ${PYTEST_ARGS:-} 2>&1 | tee $OUT/pytest_gpu.txt | tail -40
  rc=$?
fi
if [ -n "${CK:-}" ]; then
  wait $CK
  KDA_RT_TEST_48B_DIR=/tmp/k48 python -m pytest -q -m "gpu and slow" tests -s -p no:cacheprovider 2>&1 | tee $OUT/pytest_48b.txt | tail -12
  status=$?
  [ "$rc" -ne 0 ] || rc=$status
fi
# the cubins for the next call (carry ".kcache" with this file in .kcache/)
python tests/gpu/kcache.py pack "$KDA_RT_CACHE_DIR" "$OUT/kcache.tar.xz" /tmp/kcache.stamp $((15 * 1024 * 1024))
exit $rc
