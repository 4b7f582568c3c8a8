#!/usr/bin/env bash
# KDA_RT_FP8_DECODE_GEMV_MAX_T (prepared in the fifty-fifth session, never GPU-run): fp8 decode steps of up to 2-4
# sequences run the dense projections as e4m3 GEMVs of that many x rows (moe_gemv.cu MROWS, each weight pair widened
# once for every row) instead of their bf16 weights (~1.0 GB a step less on the 48B shape, as at one sequence, where
# the batch-1 replay went 1.827 -> 1.638 ms), in one call:
#   1. the tests: tests/kernels/test_gemv_dense.py -k several_rows (2-4 rows against NumPy and bit for bit the one-row
#      launches), the one-row e4m3 cases, and tests/gpu/test_cuda_model.py -k fp8_decode_gemv (the engine at 3
#      sequences against the bf16 path on the e4m3 rows' values, eager and in graphs) (a failure stops the script);
#   2. fp8 decode graph replays of the full 27-layer shape at batch 1, 2 and 4 with MAX_T 4, 1 and 2 (the switch is
#      read at each forward; the process starts with 4 so the precompile builds every row count).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/fp8_gemv_rows_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests fp8_gemv_rows_tests 300 tests/kernels/test_gemv_dense.py tests/gpu/test_cuda_model.py \
  -k "several_rows or e4m3 or fp8_decode_gemv" -s
echo "== replays, fp8, KDA_RT_FP8_DECODE_GEMV_MAX_T 4 / 1 / 2 ($SECONDS s)"
KDA_RT_FP8_DECODE_GEMV_MAX_T=4 timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 \
  --env KDA_RT_FP8_DECODE_GEMV_MAX_T --values 4,1,2 --prompts 0 --replays 1,2,4 --rounds 2 \
  2> "$OUT/fp8_gemv_rows_ab.err" | tee "$OUT/fp8_gemv_rows_ab.jsonl" | grep summary
