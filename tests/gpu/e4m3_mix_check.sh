#!/usr/bin/env bash
# The e4m3 expert weights' conversion mixes in moe_gemm_tc.cu (kernels_cu/e4m3.cuh E4M3_CVT 2 and 3: part of the pairs
# by bit moves, the rest by the conversion unit, so that the F2FP pipe does not bind the fused decode kernel alone;
# issue 12, fp8 decode) in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k decode_fused_e4m3: every way (0-3) bit for bit against the two-launch path
#      and against NumPy (nothing after it runs unless it passed);
#   2. tests/gpu/bench_moe_decode.py --e4m3: moe_decode_fused in graph replays, every way, batch 2-64;
#   3. the full 27-layer fp8 model's decode (tests/gpu/bench_ab.py --env KDA_RT_E4M3_CONVERT 1,2,3): graph replays at
#      batch 8 and 32 and a 32 x 2048 -> 64 run, with the floors of the experts routed.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/e4m3_mix_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== e4m3 conversion tests"
timeout 240 python -m pytest -q tests/kernels/test_moe_gemm_tc.py -k decode_fused_e4m3 -p no:cacheprovider 2>&1 \
  | tail -6 | tee "$OUT/e4m3_mix_tests.txt" | grep -q " passed" && ! grep -q "failed" "$OUT/e4m3_mix_tests.txt" \
  || { cat "$OUT/e4m3_mix_tests.txt"; echo "e4m3_mix_check.sh: the tests failed: nothing timed"; exit 1; }
cat "$OUT/e4m3_mix_tests.txt"
echo "== moe_decode_fused ($SECONDS s)"
timeout 150 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 2,8,32,64 2>&1 | tail -8 | tee "$OUT/e4m3_mix_bench.txt"
echo "== fp8 model decode ($SECONDS s)"
timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_E4M3_CONVERT --values 1,2,3 \
  --rounds 3 --prompts 0 --replays 8,32 --decode 32:2048:64 2>/dev/null | grep -v upload | tail -14 \
  | tee "$OUT/e4m3_mix_ab.txt"
echo "done $SECONDS s"
