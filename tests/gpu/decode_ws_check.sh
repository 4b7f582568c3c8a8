#!/usr/bin/env bash
# moe_decode_fused's producer-warp form (kernels_cu/moe_gemm_tc.cu DEC_WS: one warp fills mbarrier-guarded stages,
# the weight rows by two tensor-map copies a step; KDA_RT_MOE_DECODE_WS, default 1 on sm_90+) against the plain form
# (0: every warp copies, a CTA-wide barrier a k step), in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k decode_fused and tests/kernels/test_tma_maps.py: both forms bit for bit
#      the two-launch path and against NumPy (1, 2, 3, 7 CTAs and the launcher's grid; bf16 and e4m3 weights);
#      nothing after it runs unless they passed (exit status 1);
#   2. tests/gpu/bench_moe_decode.py --e4m3 with KDA_RT_MOE_DECODE_WS = 0 and 1 (batch 2-64, bf16 and e4m3 columns;
#      the columns whose tile has no 128-byte k steps run the plain form either way);
#   3. the full 27-layer model's decode graphs (tests/gpu/bench_ab.py --env KDA_RT_MOE_DECODE_WS 0,1): fp8 at batch
#      8 and 32, bf16 at batch 32.
# H200, 2026-12-03 (then with forms 0 / 1 / 2: 64 kernel tests passed): e4m3 T = 32 292.4 -> 284.8 us, bf16 556.3 -> 533.4; replays fp8 batch 32
# 5.920 -> 5.785 ms, bf16 8.220 -> 8.037 (a bulk copy a weight row instead of the tensor maps: 3-4x slower, dropped).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/decode_ws_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== producer-warp decode MoE: kernel tests"
timeout 200 python -m pytest -q tests/kernels/test_moe_gemm_tc.py tests/kernels/test_tma_maps.py -k "decode_fused or maps" \
  -p no:cacheprovider > "$OUT/ws_tests.txt" 2>&1
rc=$?
tail -6 "$OUT/ws_tests.txt"
[ "$rc" -eq 0 ] || { grep -E "Error|assert|Timeout" "$OUT/ws_tests.txt" | head -20; echo "decode_ws_check.sh: tests failed"; exit 1; }
for v in 0 1; do
  echo "== moe_decode_fused, KDA_RT_MOE_DECODE_WS=$v ($SECONDS s)"
  KDA_RT_MOE_DECODE_WS=$v timeout 90 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 2,8,32,64 2>&1 | tail -8 \
    | tee "$OUT/ws_bench_$v.txt"
done
echo "== fp8 model decode ($SECONDS s)"
timeout 200 python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_DECODE_WS --values 0,1 --rounds 3 \
  --prompts 0 --replays 8,32 2>/dev/null | grep -v upload | tail -2 | tee "$OUT/ws_ab_fp8.txt"
echo "== bf16 model decode ($SECONDS s)"
timeout 150 python tests/gpu/bench_ab.py --env KDA_RT_MOE_DECODE_WS --values 0,1 --rounds 3 --prompts 0 \
  --replays 32 2>/dev/null | grep -v upload | tail -2 | tee "$OUT/ws_ab_bf16.txt"
echo "done $SECONDS s"
