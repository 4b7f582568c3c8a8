#!/usr/bin/env bash
# The fifty-sixth session's engine changes, never GPU-run, in one call:
#   1. the tests (a failure stops the script): tests/kernels/test_sampling.py (the sampling kernel's penalty row map
#      and update_counts' rows, new), tests/gpu/test_request_shapes.py but its 32K prompt (async scheduling of
#      prefill and mixed steps bit for bit against the synchronous engine, every launch after the first queued
#      ahead; KDA_RT_GPU_SAMPLING_EXTRAS=1 against the host sampler's penalised and banned tokens, also ahead; chunked
#      prompts, mixed steps, preemption against the oracle), tests/engine/test_structured_outputs.py (grammar rows'
#      steps launched ahead with their sampler held back, on the CUDA runner too);
#   2. KDA_RT_ASYNC_PREFILL 1 / 0 (0: only steady decode steps launched ahead, the form before) in bf16: the seed
#      prefill's TTFT max (32 x 2048) and a 100 x 2048 / 128 run (admissions beside decodes: its elapsed and TTFT
#      max), 3 rounds, one model load;
#   3. in fp8 if time remains: the seed prefill's TTFT max only (no decode run), 2 rounds.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/engine56_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests engine56_tests 330 tests/kernels/test_sampling.py tests/gpu/test_request_shapes.py \
  tests/engine/test_structured_outputs.py -k "not 32k"
echo "== bf16 A/B, KDA_RT_ASYNC_PREFILL 1 / 0 ($SECONDS s)"
timeout $((460 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_ASYNC_PREFILL --values 1,0 --rounds 3 \
  --decode 100:2048:128 2> "$OUT/async_prefill_ab.err" | tee "$OUT/async_prefill_ab.jsonl" | grep summary
[ "$SECONDS" -lt 470 ] || { echo "no time left for fp8"; exit 0; }
echo "== fp8 A/B ($SECONDS s)"
timeout $((590 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_ASYNC_PREFILL --values 1,0 \
  --rounds 2 2> "$OUT/async_prefill_ab_fp8.err" | tee "$OUT/async_prefill_ab_fp8.jsonl" | grep summary
