#!/usr/bin/env bash
# Prefix caching (enable_prefix_caching; fifty-seventh session, first GPU-run in the fifty-eighth), in one call:
#   1. the tests (a failure stops the script): tests/gpu/test_request_shapes.py -k prefix_cache (the runner's
#      copy_slots / copy_pages on random bytes; a shared system prompt and a chat's second turn resumed from the
#      cache against the NumPy oracle, alone and with others running; a tiny pool (eviction, preemption); a resumed
#      request bit for bit against the uncached engine running the same chunks);
#   2. the full 27-layer shape in bf16, 32 prompts of 2048 tokens sharing their first 1536 (`bench --prefix-len`),
#      64 output tokens, cache on / off, two timed runs each (a burst: with the cache the first request stops at the
#      1536-token junction and the others wait that step and resume there; bench empties the cache before each run,
#      so both runs are such a burst);
#   3. the seed run (32 x 2048 / 512) and the serving workload (256 x 8192 / 1024) with the cache on, against the
#      headline rows without it (docs/PERFORMANCE.md, fifty-eighth session: 5.470 s, 40.4K tok/s): what the cache
#      costs a workload that shares nothing (each finished request's state copied into a snapshot), for its
#      default.
# TESTS=0 skips stage 1.  BENCH_ARGS adds bench flags to every bench run (e.g. "--quantization fp8": the full shape fits an 80 GB H100 in
# fp8 alone); BASELINE=1 runs stage 3 without the cache too, in the same call (on a GPU without headline rows).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/prefix_cache_check.sh
. tests/gpu/check_common.sh
echo "== tests"
[ "${TESTS:-1}" = 0 ] || gate_tests prefix_tests 300 tests/gpu/test_request_shapes.py -k prefix_cache
for flag in --enable-prefix-caching --no-enable-prefix-caching; do
  [ "$SECONDS" -lt 420 ] || { echo "no time left for $flag"; exit 0; }
  echo "== bench $flag ($SECONDS s)"
  timeout $((590 - SECONDS)) python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights \
    --router-bias-std 0.05 --batch 32 --input-len 2048 --output-len 64 --prefix-len 1536 --num-iters 2 $flag \
    ${BENCH_ARGS:-} \
    2>> "$OUT/prefix_bench.err" | tee -a "$OUT/prefix_bench.jsonl" | python -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    for i, r in enumerate(d.get('iters', [d])):
        print('run %d: elapsed %.3f s, TTFT max %.3f mean %.3f s, steps %d, resumed tokens %d' % (i, r['elapsed_s'],
              r['ttft_s_max'], r['ttft_s_mean'], r['num_steps'], r.get('prefix_cache_hit_tokens', 0)))"
done
[ "$SECONDS" -lt 330 ] || { echo "no time left for the headline workloads with the cache on"; exit 0; }
flags=--enable-prefix-caching; [ "${BASELINE:-0}" = 0 ] || flags="$flags --no-enable-prefix-caching"
for flag in $flags; do
  [ "$SECONDS" -lt 330 ] || { echo "no time left for the headline workloads with $flag"; exit 0; }
  echo "== seed and serving workloads with $flag ($SECONDS s)"
  ALSO=256:8192:1024 BENCH_ARGS="$flag ${BENCH_ARGS:-}" BENCH_TIMEOUT=$((590 - SECONDS)) bash tests/gpu/bench_full.sh ours
done
