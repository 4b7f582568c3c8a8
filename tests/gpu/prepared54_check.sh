#!/usr/bin/env bash
# The fifty-fourth session's four prepared switches in one device call (each also has its own script, with more
# rounds: skip_pad_check.sh, fp8_decode_gemv_check.sh, mla_fused_combine_check.sh, skinny_wide_n_check.sh):
#   1. their tests in one pytest run (a failure stops the script: nothing is timed);
#   2. bf16 decode graph replays at batch 1, 8, 16 and 32 of KDA_RT_MLA_FUSED_COMBINE (0 / 1) and
#      KDA_RT_SKINNY_WIDE_MAX_N (4096 / 13000) on one model load: the default, each switch alone;
#   3. fp8 batch-1 replays of KDA_RT_FP8_DECODE_GEMV 1 / 0 (the process starts with it 1: the rows are made at upload);
#   4. KDA_RT_SKIP_PAD 2 against 1 (graph_pad_check.py --batches 96,160: read at start, one process each),
# each step while the call's time lasts.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/prepared54_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests prepared54_tests 240 tests/kernels/test_kda_decode.py tests/kernels/test_mla_attn.py \
  tests/kernels/test_skinny_gemm.py tests/kernels/test_gemv_dense.py tests/gpu/test_cuda_model.py \
  -k "skip_pad or skip_their_state or fused_combine or past_max_n or e4m3 or fp8_decode_gemv"
echo "== bf16 replays: MLA fused combine, skinny wide outputs ($SECONDS s)"
timeout $((400 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MLA_FUSED_COMBINE,KDA_RT_SKINNY_WIDE_MAX_N \
  --values 0:4096,1:4096,0:13000 --prompts 0 --replays 1,8,16,32 --rounds 2 2> "$OUT/prepared54_bf16.err" \
  | tee "$OUT/prepared54_bf16.jsonl" | grep summary
[ "$SECONDS" -lt 420 ] || exit 0
echo "== fp8 batch-1 replays: the e4m3 decode GEMVs ($SECONDS s)"
KDA_RT_FP8_DECODE_GEMV=1 timeout $((520 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 \
  --env KDA_RT_FP8_DECODE_GEMV --values 1,0 --prompts 0 --replays 1 --rounds 3 2> "$OUT/prepared54_fp8.err" \
  | tee "$OUT/prepared54_fp8.jsonl" | grep summary
run_values prepared54_pad KDA_RT_SKIP_PAD 500 "2 1" python tests/gpu/graph_pad_check.py --batches 160 --rounds 1
