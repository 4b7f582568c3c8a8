#!/usr/bin/env bash
# The KDA prefill intra kernel's default-off variants (kernels_cu/kda_prefill.cu CONV_ONE_ROUND, GATE_FAST,
# SCALE_UNROLL, ROW_NORM_SPREAD, EXP2_FTZ; issue 11), all in one device call:
#   1. their GPU tests (tests/kernels/test_kda_prefill.py: bit-identity of three to the default build, the reference's
#      bounds for all, the fast softplus over a sweep);
#   2. each one's kernel A/B and all five together (bench_kda_phases.py --ab: 5 interleaved rounds a shape, outputs
#      compared bit for bit, phase cycles of both builds);
#   3. with "model" as first argument, the full 27-layer model's seed prefill with all five switches off / on
#      (bench_ab.py, fp8 weights, 3 rounds).
# Estimated from this session's calls: ~4-6 minutes for 1 and 2 (the tests ~220 s, each A/B ~20-40 s), ~2.5 more for 3:
# near the device's 10-minute limit a call, so run "model" as a second call if the first one was long.
#   bash tests/gpu/kda_intra_variants.sh [model]      (from the repository root; writes $OUT/kda_intra_variants.txt)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
log="$OUT/kda_intra_variants.txt"
all=CONV_ONE_ROUND,GATE_FAST,SCALE_UNROLL,ROW_NORM_SPREAD,EXP2_FTZ
timeout 400 python -m pytest -q tests/kernels/test_kda_prefill.py 2>&1 | tail -3 | tee -a "$log"
for ab in CONV_ONE_ROUND GATE_FAST SCALE_UNROLL ROW_NORM_SPREAD EXP2_FTZ $all; do
  echo "== --ab $ab" | tee -a "$log"
  timeout 200 python tests/gpu/bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ab "$ab" >> "$log" 2>&1
  grep -E "kernel [0-9.]+ ms|bit-identical" "$log" | tail -9
done
if [ "$1" = model ]; then
  envs=KDA_RT_KDA_CONV_ONE_ROUND,KDA_RT_KDA_GATE_FAST,KDA_RT_KDA_SCALE_UNROLL,KDA_RT_KDA_ROW_NORM_SPREAD,KDA_RT_KDA_EXP2_FTZ
  timeout 300 python tests/gpu/bench_ab.py --quantization fp8 --env "$envs" --values 0:0:0:0:0,1:1:1:1:1 --rounds 3 \
    2>/dev/null | tee -a "$log" | grep summary
fi
