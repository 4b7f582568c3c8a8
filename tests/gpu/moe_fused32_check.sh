#!/usr/bin/env bash
# The 32-row tiles of moe_decode_fused (KDA_RT_MOE_FUSED32, issue 12: decode batches of ~115-1370 tokens) in one
# device call:
#   1. tests/kernels/test_moe_block.py -k "fused32 or T256": the 32-row fused kernel against NumPy and bit for bit the
#      32-row two-launch path (bf16), the e4m3 case on it, and the 256-token cases of the default paths (a wrong
#      result stops the script: nothing is timed);
#   2. the full 27-layer model's decode graph replays (bench_ab.py --replays, 2K context), KDA_RT_MOE_FUSED32 0
#      against 1, 2 rounds, bf16 weights at batch 128 and 256 (the fiftieth session's bf16 run stopped at its first
#      batch-512 replay, its stderr not kept: likely memory, ~98 GB of weights and ~28 GB of KDA state and latent
#      cache for 512 sequences; stderr now in $OUT), then fp8 at 128, 256, 512 and 768, while the call's time lasts.  Fiftieth session (H200): fp8 11.59 -> 13.05, 18.48 -> 19.80, 33.58 -> 33.51, 48.28 -> 47.22 ms.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/moe_fused32_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== tests"
timeout 200 python -m pytest -q -x tests/kernels/test_moe_block.py -k "fused32 or T256" -p no:cacheprovider -s 2>&1 \
  | grep -E "rms rel|passed|failed|Error" | tee "$OUT/fused32_tests.txt" | tail -20
grep -q " passed" "$OUT/fused32_tests.txt" && ! grep -q "failed\|Error" "$OUT/fused32_tests.txt" \
  || { echo "moe_fused32_check.sh: the tests failed: nothing timed"; exit 1; }
for q in bf16 fp8; do
  [ "$SECONDS" -lt 380 ] || break
  echo "== decode replays, $q weights ($SECONDS s)"
  # fp8 also at 768 (27 rows an expert: the e4m3 stacks' 64-row widening tiles today)
  quant=""; replays=128,256; [ "$q" = fp8 ] && quant="--quantization fp8" && replays=128,256,512,768
  # shellcheck disable=SC2086
  timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py $quant --env KDA_RT_MOE_FUSED32 --values 0,1 --prompts 0 \
    --replays $replays --rounds 2 2> "$OUT/fused32_ab_$q.err" | tee "$OUT/fused32_ab_$q.jsonl" | grep summary
done
