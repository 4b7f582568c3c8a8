#!/usr/bin/env bash
# Async scheduling of prefill and mixed steps (fifty-sixth session, never GPU-run: the step after a prefill or mixed
# step scheduled and launched before the host has its tokens, its leading rows fed the previous step's samples on
# the device), in one call:
#   1. the tests: tests/gpu/test_request_shapes.py (the async engine bit for bit against the synchronous one, every
#      launch after the first queued ahead, a prefill chunk beside device-fed decodes; chunked prompts, mixed steps,
#      preemption against the oracle) (a failure stops the script);
#   2. KDA_RT_ASYNC_PREFILL 1 / 0 (0: only steady decode steps launched ahead, the form before) in bf16: the seed
#      prefill's TTFT max (32 x 2048) and a 100 x 2048 / 128 run (admissions beside decodes: its elapsed and TTFT
#      max), 3 rounds, one model load;
#   3. the same in fp8 if time remains.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/async_prefill_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests async_prefill_tests 240 tests/gpu/test_request_shapes.py -k "not 32k"
echo "== bf16 A/B, KDA_RT_ASYNC_PREFILL 1 / 0 ($SECONDS s)"
timeout $((420 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_ASYNC_PREFILL --values 1,0 --rounds 3 \
  --decode 100:2048:128 2> "$OUT/async_prefill_ab.err" | tee "$OUT/async_prefill_ab.jsonl" | grep summary
[ "$SECONDS" -lt 430 ] || { echo "no time left for fp8"; exit 0; }
echo "== fp8 A/B ($SECONDS s)"
timeout $((590 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_ASYNC_PREFILL --values 1,0 \
  --rounds 2 2> "$OUT/async_prefill_ab_fp8.err" | tee "$OUT/async_prefill_ab_fp8.jsonl" | grep summary
