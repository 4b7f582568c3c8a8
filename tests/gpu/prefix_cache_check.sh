#!/usr/bin/env bash
# The fifty-seventh session's prefix caching (enable_prefix_caching), never GPU-run, in one call:
#   1. the tests (a failure stops the script): tests/gpu/test_request_shapes.py -k prefix_cache (the runner's
#      copy_slots / copy_pages on random bytes; a shared system prompt and a chat's second turn resumed from the
#      cache against the NumPy oracle, alone and with others running; a tiny pool (eviction, preemption); a resumed
#      request bit for bit against the uncached engine running the same chunks);
#   2. the full 27-layer shape in bf16, 32 prompts of 2048 tokens sharing their first 1536 (`bench --prefix-len`),
#      64 output tokens, cache on / off, two timed runs each (a burst: with the cache the first request stops at the
#      1536-token junction and the others wait that step and resume there; the second run's prompts are the first's,
#      so every request resumes at once).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/prefix_cache_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests prefix_tests 300 tests/gpu/test_request_shapes.py -k prefix_cache
for flag in --enable-prefix-caching --no-enable-prefix-caching; do
  [ "$SECONDS" -lt 420 ] || { echo "no time left for $flag"; exit 0; }
  echo "== bench $flag ($SECONDS s)"
  timeout $((590 - SECONDS)) python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights \
    --router-bias-std 0.05 --batch 32 --input-len 2048 --output-len 64 --prefix-len 1536 --num-iters 2 $flag \
    2>> "$OUT/prefix_bench.err" | tee -a "$OUT/prefix_bench.jsonl" | python -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    for i, r in enumerate(d.get('iters', [d])):
        print('run %d: elapsed %.3f s, TTFT max %.3f mean %.3f s, steps %d, resumed tokens %d' % (i, r['elapsed_s'],
              r['ttft_s_max'], r['ttft_s_mean'], r['num_steps'], r.get('prefix_cache_hit_tokens', 0)))"
done
