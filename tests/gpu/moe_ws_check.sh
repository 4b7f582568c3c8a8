#!/usr/bin/env bash
# The prefill MoE GEMM's warp-specialized forms (kernels_cu/moe_gemm_wg.cu WS and MC, issue 11) in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k b_tma: the plain kernel's cp.async, B_TMA, B_TMA + A_TMA, WS and WS + MC
#      builds bit for bit on every tile, width and format of the test (a protocol deadlock would hang: the step runs
#      under a timeout, and nothing after it runs unless it passed);
#   2. tests/gpu/bench_moe_gemm.py --ws: plain, WS and WS + MC interleaved, bf16 and w8a8, 8192 and 16384 tokens;
#   3. the full 27-layer seed prefill (bench_ab.py, TTFT max, 3 rounds) with KDA_RT_MOE_WS:KDA_RT_MOE_MC at 0:0, 1:0
#      and 1:1, fp8 then bf16 weights, while the call's time lasts;
#   4. tests/gpu/ncu_l2_fabric.sh: the L2 units' load of each form, if time is left.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/moe_ws_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== WS / MC tests"
timeout 240 python -m pytest -q tests/kernels/test_moe_gemm_tc.py -k b_tma -p no:cacheprovider 2>&1 | tail -15 \
  | tee "$OUT/moe_ws_tests.txt" || { echo "moe_ws_check.sh: the tests failed or hung: nothing timed"; exit 1; }
echo "== GEMM alone ($SECONDS s)"
timeout 150 python tests/gpu/bench_moe_gemm.py --ws --tokens 8192,16384 2>&1 | tail -6 | tee "$OUT/moe_ws_gemm.txt"
timeout 120 python tests/gpu/bench_moe_gemm.py --ws --e4m3 --w8a8 --tokens 8192,16384 2>&1 | tail -6 \
  | tee -a "$OUT/moe_ws_gemm.txt"
for q in fp8 bf16; do
  [ "$SECONDS" -lt 420 ] || break
  echo "== seed prefill, $q weights ($SECONDS s)"
  quant=""; [ "$q" = fp8 ] && quant="--quantization fp8"
  # shellcheck disable=SC2086
  timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py $quant --env KDA_RT_MOE_WS,KDA_RT_MOE_MC \
    --values 0:0,1:0,1:1 --rounds 3 2>/dev/null | grep -v upload | tail -4 | tee -a "$OUT/moe_ws_ab.txt"
done
if [ "$SECONDS" -lt 480 ]; then
  echo "== L2 units ($SECONDS s)"
  timeout $((590 - SECONDS)) bash tests/gpu/ncu_l2_fabric.sh 16384 2>&1 | tee "$OUT/moe_l2_fabric.txt"
fi
echo "done $SECONDS s"
