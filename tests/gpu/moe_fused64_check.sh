#!/usr/bin/env bash
# The 64-row tiles of moe_decode_fused (KDA_RT_MOE_FUSED64, issue 12: bf16 decode batches of ~158-1370 tokens, which
# ran as two moe_grouped_gemm_tc launches streaming the weights at ~3.5 TB/s) in one device call:
#   1. tests/kernels/test_moe_block.py -k "fused_rows or fused64 or tc64 or decode64": the 64-row fused kernel against
#      NumPy and bit for bit the 64-row two-launch path (bf16, shared expert apart and in the stack), the e4m3 case on
#      it, and the 128-token graph replays (a wrong result stops the script: nothing is timed);
#   2. the full 27-layer model's decode graph replays (bench_ab.py --replays, 2K context), KDA_RT_MOE_FUSED64 0
#      against 1, 2 rounds, bf16 weights at batch 160, 192, 256 and 384;
#   3. fp8 at 512 and 768 (18-48 rows an expert: e4m3 stacks took 32-row fused tiles there; 64-row since this call),
#      KDA_RT_MOE_FUSED32:KDA_RT_MOE_FUSED64 auto:1 against 0:1 (the 64-row fused tiles), while the call's time lasts.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/moe_fused64_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== tests"
timeout 240 python -m pytest -q -x tests/kernels/test_moe_block.py -k "fused_rows or fused64 or tc64 or decode64" \
  -p no:cacheprovider -s 2>&1 | grep -E "rms rel|passed|failed|Error" | tee "$OUT/fused64_tests.txt" | tail -20
grep -q " passed" "$OUT/fused64_tests.txt" && ! grep -q "failed\|Error" "$OUT/fused64_tests.txt" \
  || { echo "moe_fused64_check.sh: the tests failed: nothing timed"; exit 1; }
echo "== decode replays, bf16 weights ($SECONDS s)"
timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_FUSED64 --values 0,1 --prompts 0 \
  --replays 160,192,256,384 --rounds 2 2> "$OUT/fused64_ab_bf16.err" | tee "$OUT/fused64_ab_bf16.jsonl" | grep summary
[ "$SECONDS" -lt 400 ] || exit 0
echo "== decode replays, fp8 weights ($SECONDS s)"
timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_FUSED32,KDA_RT_MOE_FUSED64 \
  --values auto:1,0:1 --prompts 0 --replays 512,768 --rounds 2 2> "$OUT/fused64_ab_fp8.err" \
  | tee "$OUT/fused64_ab_fp8.jsonl" | grep summary
