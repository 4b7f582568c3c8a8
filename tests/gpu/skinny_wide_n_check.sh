#!/usr/bin/env bash
# KDA_RT_SKINNY_WIDE_MAX_N (prepared in the fifty-fourth session, never GPU-run): decode steps of 9-32 sequences send
# the wide projections (KDA q|k|v|f_a|g_a|b, 12576 outputs; MLA q|kv_a, 6720) to skinny_gemm_ws instead of cuBLAS,
# which streams them at ~74% of copy bandwidth in the batch-32 trace (0.33 ms a step against ~0.27 of bytes), in one
# device call:
#   1. the tests: tests/kernels/test_skinny_gemm.py -k past_max_n (both forms against NumPy, the form that ran checked);
#   2. decode graph replays of the full 27-layer shape at batch 16 and 32, the limit 4096 (default) against 13000.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/skinny_wide_n_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests skinny_wide_n_tests 200 tests/kernels/test_skinny_gemm.py -k past_max_n
echo "== replays, bf16, KDA_RT_SKINNY_WIDE_MAX_N 4096 / 13000 ($SECONDS s)"
timeout $((590 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_SKINNY_WIDE_MAX_N --values 4096,13000 \
  --prompts 0 --replays 16,32 --rounds 2 2> "$OUT/skinny_wide_n_ab.err" | tee "$OUT/skinny_wide_n_ab.jsonl" | grep summary
