#!/usr/bin/env bash
# f16 products for the e4m3 expert GEMMs of moe_gemm_tc.cu (KDA_RT_MOE_F16P, kernels_cu/moe_gemm_tc.cu F16P; issue
# 12, fp8 decode: the fused decode kernel is issue-bound on its four conversions a pair of codes) in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k "decode_fused_e4m3 or small": f16 products bit for bit the bf16
#      products' outputs, the two-launch path's and NumPy's (rows at 2^50, 2^40, 2^-40, zeros; the 16-, 64- and
#      128-row tiles); nothing after it runs unless it passed (the script's exit status: 1);
#   2. tests/gpu/test_cuda_model.py -k fp8 with KDA_RT_MOE_F16P=1: the fp8 model against the NumPy oracle;
#   3. tests/gpu/bench_moe_decode.py --e4m3: moe_decode_fused with bf16 and f16 products, batch 2-64;
#   4. the full 27-layer fp8 model's decode (tests/gpu/bench_ab.py --env KDA_RT_MOE_F16P 0,1): graph replays at
#      batch 8 and 32 and a 32 x 2048 -> 64 run, with the floors of the experts routed.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/f16p_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== f16 products: kernel tests"
timeout 240 python -m pytest -q tests/kernels/test_moe_gemm_tc.py -k "decode_fused_e4m3 or small" -p no:cacheprovider \
  > "$OUT/f16p_tests.txt" 2>&1
rc=$?
tail -8 "$OUT/f16p_tests.txt"
[ "$rc" -eq 0 ] || { grep -E "Error|assert" "$OUT/f16p_tests.txt" | head -20; echo "f16p_check.sh: tests failed"; exit 1; }
echo "== the fp8 model against the oracle, f16 products ($SECONDS s)"
KDA_RT_MOE_F16P=1 timeout 200 python -m pytest -q tests/gpu/test_cuda_model.py -k fp8 -p no:cacheprovider 2>&1 \
  | tail -4 | tee "$OUT/f16p_model_tests.txt"
echo "== moe_decode_fused ($SECONDS s)"
timeout 150 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 2,8,32,64 2>&1 | tail -8 | tee "$OUT/f16p_bench.txt"
echo "== fp8 model decode ($SECONDS s)"
timeout $((SECONDS < 500 ? 580 - SECONDS : 80)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_F16P --values 0,1 \
  --rounds 3 --prompts 0 --replays 8,32 --decode 32:2048:64 2>/dev/null | grep -v upload | tail -3 \
  | tee "$OUT/f16p_ab.txt"
echo "done $SECONDS s"
