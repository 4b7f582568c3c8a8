#!/usr/bin/env bash
# gemv_dense on 2-4 rows of x (moe_gemv.cu MROWS, prepared in the fifty-fifth session, never GPU-run: each weight pair
# widened once for every row, each row's sums bit for bit a one-row launch's), in one call:
#   1. the tests: tests/kernels/test_gemv_dense.py (2-4 rows against NumPy and the one-row launches, gemm.linear's
#      choice with KDA_RT_DENSE_GEMV_MAX_T) and tests/gpu/test_cuda_model.py -k fp8_decode_gemv (the engine at 3
#      sequences against the bf16 path on the e4m3 rows' values, eager and in graphs) (a failure stops the script);
#   2. KDA_RT_DENSE_GEMV_MAX_T (bf16): decode steps of 2-4 sequences run the wide projections gemv_dense takes at one
#      row (KDA q|k|v|f_a|g_a|b, MLA q|kv_a, the dense gate|up) on it instead of cuBLAS: bf16 replays of the full
#      27-layer shape at batch 2 and 4 with 4 and 1 (read at each gemm.linear call; the process starts with 4 so the
#      precompile builds every row count);
#   3. KDA_RT_FP8_DECODE_GEMV_MAX_T (fp8): steps of 2-4 sequences read those projections' e4m3 rows (~1.0 GB a step
#      less, as at one sequence: batch-1 replay 1.827 -> 1.638 ms): fp8 replays at batch 1, 2 and 4 with 4, 1 and 2.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/gemv_rows_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests gemv_rows_tests 300 tests/kernels/test_gemv_dense.py tests/gpu/test_cuda_model.py -k "gemv" -s
echo "== bf16 replays, KDA_RT_DENSE_GEMV_MAX_T 4 / 1 ($SECONDS s)"
KDA_RT_DENSE_GEMV_MAX_T=4 timeout $((330 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_DENSE_GEMV_MAX_T \
  --values 4,1 --prompts 0 --replays 2,4 --rounds 2 2> "$OUT/dense_gemv_rows_ab.err" \
  | tee "$OUT/dense_gemv_rows_ab.jsonl" | grep summary
echo "== fp8 replays, KDA_RT_FP8_DECODE_GEMV_MAX_T 4 / 1 / 2 ($SECONDS s)"
KDA_RT_FP8_DECODE_GEMV_MAX_T=4 timeout $((585 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 \
  --env KDA_RT_FP8_DECODE_GEMV_MAX_T --values 4,1,2 --prompts 0 --replays 1,2,4 --rounds 2 \
  2> "$OUT/fp8_gemv_rows_ab.err" | tee "$OUT/fp8_gemv_rows_ab.jsonl" | grep summary
