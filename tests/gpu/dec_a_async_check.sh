#!/usr/bin/env bash
# moe_decode_fused's A rows by cp.async from the whole producer warp (KDA_RT_MOE_DEC_A_ASYNC, kernels_cu/moe_gemm_tc.cu
# DEC_A_ASYNC) and its items in reverse tile order (KDA_RT_MOE_DEC_REVERSE: the shared bin's full tiles first), both
# prepared in the fifty-second session and never GPU-run, in one device call:
#   1. tests/kernels/test_moe_block.py -k a_rows_async: bit for bit the bulk-copy form on 16-, 32- and 64-row tiles,
#      bf16 and e4m3, the reversed order too (both forms) (a wrong result stops the script: nothing is timed);
#   2. the full 27-layer model's decode graph replays (bench_ab.py, exact graphs, 2K context), bf16,
#      KDA_RT_MOE_DEC_A_ASYNC:KDA_RT_MOE_DEC_REVERSE:KDA_RT_MOE_FUSED64 0:0:e4m3 (the default until the fifty-third
#      session, which ran this with "auto", then e4m3 stacks alone), 1:0:e4m3 (16 / 32-row fused tiles at 32 and
#      128), 0:1:e4m3 and 1:1:1 (the fifty-third session's default) (the 64-row fused tiles at 256 and 384 too: do the cp.async rows
#      turn their +2-7% around?  A code reading put the bulk-copy form's per-row copies at ~50-65% of the producer's
#      time there);
#   3. fp8 at 32 and 768 (the e4m3 16- and 64-row fused tiles), 0 against 1, while the call's time lasts.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/dec_a_async_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests a_async_tests 200 tests/kernels/test_moe_block.py -k a_rows_async
echo "== bf16 replays ($SECONDS s)"
timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_DEC_A_ASYNC,KDA_RT_MOE_DEC_REVERSE,KDA_RT_MOE_FUSED64 \
  --values 0:0:e4m3,1:0:e4m3,0:1:e4m3,1:1:1 --prompts 0 --replays 32,128,256,384 --rounds 2 2> "$OUT/a_async_bf16.err" \
  | tee "$OUT/a_async_bf16.jsonl" | grep summary
[ "$SECONDS" -lt 420 ] || exit 0
echo "== fp8 replays ($SECONDS s)"
timeout $((585 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_DEC_A_ASYNC --values 0,1 \
  --prompts 0 --replays 32,768 --rounds 1 2> "$OUT/a_async_fp8.err" | tee "$OUT/a_async_fp8.jsonl" | grep summary
