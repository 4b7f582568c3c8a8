#!/usr/bin/env bash
# moe_decode_fused with a producer warp (kernels_cu/moe_gemm_tc.cu DEC_WS, KDA_RT_MOE_DECODE_WS = 1: a bulk copy a
# weight row, 2: two tensor-map copies a step; issue 12: the fp8 decode MoE kernel at 76% of a plain read stream's
# rate, its warps waiting on their own copies and a CTA-wide barrier every k step) in one device call:
#   1. tests/kernels/test_moe_gemm_tc.py -k decode_fused: every form bit for bit the two-launch path and against NumPy
#      (1, 2, 3, 7 CTAs and the launcher's grid; bf16 and e4m3 weights); nothing after it runs unless it passed
#      (exit status 1);
#   2. tests/gpu/bench_moe_decode.py --e4m3 with KDA_RT_MOE_DECODE_WS = 0, 1, 2 (batch 2-64, bf16 and e4m3 columns),
#      and with 2 three more e4m3 tiles (more stages or CTAs an SM, the copies no longer the computing warps' work);
#   3. the full 27-layer model's decode graphs (tests/gpu/bench_ab.py --env KDA_RT_MOE_DECODE_WS 0,1,2): fp8 at batch
#      8 and 32;
#   4. with KDA_RT_MOE_DECODE_WS = 2: tests/kernels/test_moe_block.py's MoE block in decode graphs (the fused GEMMs)
#      and tests/gpu/test_cuda_model.py's fp8 experts against the NumPy oracle and graph replay against eager;
#   5. bf16 at batch 32 (bench_ab).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/decode_ws_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== producer-warp decode MoE: kernel tests"
timeout 200 python -m pytest -q tests/kernels/test_moe_gemm_tc.py tests/kernels/test_tma_maps.py -k "decode_fused or maps" -p no:cacheprovider \
  > "$OUT/ws_tests.txt" 2>&1
rc=$?
tail -6 "$OUT/ws_tests.txt"
[ "$rc" -eq 0 ] || { grep -E "Error|assert|Timeout" "$OUT/ws_tests.txt" | head -20; echo "decode_ws_check.sh: tests failed"; exit 1; }
for v in 0 1 2; do
  echo "== moe_decode_fused, KDA_RT_MOE_DECODE_WS=$v ($SECONDS s)"
  KDA_RT_MOE_DECODE_WS=$v timeout 90 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 2,8,32,64 2>&1 | tail -8 \
    | tee "$OUT/ws_bench_$v.txt"
done
echo "== the tensor-map form's tiles ($SECONDS s)"
KDA_RT_MOE_DECODE_WS=2 timeout 90 python tests/gpu/bench_moe_decode.py --e4m3 --tokens 8,32 \
  --tiles "16,128,128,4,1,4,2;16,64,128,4,1,2,4;16,64,128,5,1,2,3" 2>&1 | tail -4 | tee "$OUT/ws_tiles.txt"
echo "== fp8 model decode ($SECONDS s)"
timeout 200 python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_DECODE_WS --values 0,1,2 --rounds 3 \
  --prompts 0 --replays 8,32 2>/dev/null | grep -v upload | tail -3 | tee "$OUT/ws_ab_fp8.txt"
echo "== the MoE block in decode graphs and the fp8 model, KDA_RT_MOE_DECODE_WS=2 ($SECONDS s)"
KDA_RT_MOE_DECODE_WS=2 timeout 150 python -m pytest -q tests/kernels/test_moe_block.py tests/gpu/test_cuda_model.py \
  -k "fused-gemms or fp8_experts or graph_replay" -p no:cacheprovider 2>&1 | tail -3 | tee "$OUT/ws_model_tests.txt"
echo "== bf16 model decode ($SECONDS s)"
timeout 150 python tests/gpu/bench_ab.py --env KDA_RT_MOE_DECODE_WS --values 0,1,2 --rounds 3 --prompts 0 \
  --replays 32 2>/dev/null | grep -v upload | tail -3 | tee "$OUT/ws_ab_bf16.txt"
echo "done $SECONDS s"
