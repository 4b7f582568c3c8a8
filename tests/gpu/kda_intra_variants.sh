#!/usr/bin/env bash
# The KDA prefill intra kernel's default-off variants CONV_PAIRS (phase (a) two channels a thread; bit-identical) and
# T_HALVES (T's off-diagonal blocks by halves, 5 barriers instead of 8; fp32 sums in another order) of
# kernels_cu/kda_prefill.cu (issue 11), in one device call (the thirty-fourth session measured CONV_ONE_ROUND,
# GATE_FAST, SCALE_UNROLL, ROW_NORM_SPREAD and EXP2_FTZ with this script's first form and turned them on):
#   1. the GPU tests of tests/kernels/test_kda_prefill.py (the variants test: CONV_PAIRS bit for bit, T_HALVES and
#      everything together at the reference's bounds);
#   2. each one's kernel A/B and both together (bench_kda_phases.py --ab: 5 interleaved rounds a shape, outputs
#      compared bit for bit, phase cycles of both builds);
#   3. the phases of 8 and of 132 tiles launched alone (bench_kda_phases.py --solo: are the copies slow because a
#      wave's CTAs all copy at once?);
#   4. with "model" as first argument, the full 27-layer model's seed prefill with both off / on (bench_ab.py, fp8
#      weights, 3 rounds).
# Times from the thirty-fourth session: the tests ~75-100 s, each A/B ~10 s, the model A/B ~80 s (builds included).
#   bash tests/gpu/kda_intra_variants.sh [model]      (from the repository root; writes $OUT/kda_intra_variants.txt)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
log="$OUT/kda_intra_variants.txt"
rm -f "$log"
timeout 300 python -m pytest -q tests/kernels/test_kda_prefill.py 2>&1 | tail -3 | tee -a "$log"
for ab in CONV_PAIRS T_HALVES CONV_PAIRS,T_HALVES; do
  echo "== --ab $ab" | tee -a "$log"
  timeout 120 python tests/gpu/bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ab "$ab" >> "$log" 2>&1
  grep -E "kernel [0-9.]+ ms|bit-identical" "$log" | tail -9
done
echo "== the copies alone (--solo 8,132)" | tee -a "$log"
timeout 60 python tests/gpu/bench_kda_phases.py --shapes 32x2048 --solo 8,132 >> "$log" 2>&1
grep -E "alone|start: copies" "$log" | tail -6
if [ "$1" = model ]; then
  timeout 300 python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_KDA_CONV_PAIRS,KDA_RT_KDA_T_HALVES \
    --values 0:0,1:1 --rounds 3 2>/dev/null | tee -a "$log" | grep summary
fi
