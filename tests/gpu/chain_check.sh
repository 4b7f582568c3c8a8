#!/usr/bin/env bash
# moe_decode_fused with its items chained (kernels_cu/moe_gemm_tc.cu CHAIN, KDA_RT_MOE_CHAIN; issue 12: the
# batch 2-64 decode MoE kernel's copies pause between items) in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k fused and tests/kernels/test_moe_block.py: the chained kernel bit for
#      bit the two-launch path and against NumPy (1, 2, 3 and 7 CTAs: every item after the first chained); nothing
#      after it runs unless it passed (exit status 1);
#   2. tests/gpu/bench_moe_decode.py --fused and --e4m3 with KDA_RT_MOE_CHAIN=0 and 1 (batch 2-64);
#   3. the full 27-layer model's decode graphs (tests/gpu/bench_ab.py --env KDA_RT_MOE_CHAIN 0,1), fp8 at batch 8
#      and 32, bf16 at batch 32, with the floors of the experts routed.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/chain_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== chained items: kernel tests"
timeout 300 python -m pytest -q tests/kernels/test_moe_gemm_tc.py tests/kernels/test_moe_block.py -k "fused or block" \
  -p no:cacheprovider > "$OUT/chain_tests.txt" 2>&1
rc=$?
tail -6 "$OUT/chain_tests.txt"
[ "$rc" -eq 0 ] || { grep -E "Error|assert" "$OUT/chain_tests.txt" | head -20; echo "chain_check.sh: tests failed"; exit 1; }
for v in 0 1; do
  echo "== moe_decode_fused, KDA_RT_MOE_CHAIN=$v ($SECONDS s)"
  KDA_RT_MOE_CHAIN=$v timeout 150 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 2,8,32,64 2>&1 | tail -8 \
    | tee "$OUT/chain_bench_$v.txt"
done
echo "== fp8 model decode ($SECONDS s)"
timeout 200 python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_CHAIN --values 0,1 --rounds 3 --prompts 0 \
  --replays 8,32 2>/dev/null | grep -v upload | tail -2 | tee "$OUT/chain_ab_fp8.txt"
echo "== bf16 model decode ($SECONDS s)"
timeout 150 python tests/gpu/bench_ab.py --env KDA_RT_MOE_CHAIN --values 0,1 --rounds 3 --prompts 0 \
  --replays 32 2>/dev/null | grep -v upload | tail -2 | tee "$OUT/chain_ab_bf16.txt"
echo "done $SECONDS s"
