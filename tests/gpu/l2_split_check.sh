#!/usr/bin/env bash
# The MoE prefill GEMMs' claims by L2 partition (KDA_RT_MOE_L2_SPLIT, kernels_cu/moe_gemm_wg.cu L2_SPLIT, issue 11)
# and the tensor maps' L2 promotion (KDA_RT_TMA_L2_PROMOTION) in one device call, after the probe's grouping was
# made robust (forty-third session: the first probe found SM 0 astray and no grouping came out):
#   1. tests/kernels/test_l2_partition.py on the GPU (the probe must find two groups) and tests/gpu/probe_l2.py;
#   2. tests/gpu/bench_moe_gemm.py --ws (plain, WS, WS + MC, WS + L2_SPLIT, WS + MC + L2_SPLIT, bit-identity
#      checked) bf16 and w8a8 at 8192 and 16384 tokens, with the default promotion (256) and with 128;
#   3. the full 27-layer seed prefill (tests/gpu/bench_ab.py, TTFT max, 3 rounds): fp8 with
#      KDA_RT_MOE_L2_SPLIT:KDA_RT_TMA_L2_PROMOTION at 0:256, 1:256, 0:128, 1:128 (WS is fp8's default), then bf16
#      with KDA_RT_MOE_WS:KDA_RT_MOE_L2_SPLIT:KDA_RT_TMA_L2_PROMOTION at 0:0:256, 1:0:128, 1:1:128.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/l2_split_check.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== the L2 partition probe"
timeout 120 python -m pytest -q -s tests/kernels/test_l2_partition.py -p no:cacheprovider 2>&1 \
  | grep -E "latency|passed|failed|Error" | tail -6 | tee "$OUT/l2_split_tests.txt"
timeout 60 python tests/gpu/probe_l2.py --out "$OUT/l2_latency.npy" 2>&1 | tail -12 | tee "$OUT/l2_probe.txt"
for p in 256 128; do
  echo "== GEMM alone, L2 promotion $p ($SECONDS s)"
  KDA_RT_TMA_L2_PROMOTION=$p timeout 150 python tests/gpu/bench_moe_gemm.py --ws --tokens 8192,16384 2>&1 | tail -5 \
    | tee -a "$OUT/l2_split_gemm.txt"
  KDA_RT_TMA_L2_PROMOTION=$p timeout 120 python tests/gpu/bench_moe_gemm.py --ws --e4m3 --w8a8 --tokens 8192,16384 \
    2>&1 | tail -5 | tee -a "$OUT/l2_split_gemm.txt"
done
echo "== seed prefill, fp8 weights ($SECONDS s)"
timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 \
  --env KDA_RT_MOE_L2_SPLIT,KDA_RT_TMA_L2_PROMOTION --values 0:256,1:256,0:128,1:128 --rounds 3 2>/dev/null \
  | grep -v upload | tail -5 | tee -a "$OUT/l2_split_ab.txt"
if [ "$SECONDS" -lt 440 ]; then
  echo "== seed prefill, bf16 weights ($SECONDS s)"
  timeout $((570 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_WS,KDA_RT_MOE_L2_SPLIT,KDA_RT_TMA_L2_PROMOTION \
    --values 0:0:256,1:0:128,1:1:128 --rounds 3 2>/dev/null | grep -v upload | tail -4 | tee -a "$OUT/l2_split_ab.txt"
fi
echo "done $SECONDS s"
