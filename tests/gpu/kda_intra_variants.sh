#!/usr/bin/env bash
# The KDA prefill intra kernel's variants of kernels_cu/kda_prefill.cu (issue 11) in one device call: each define of
# $AB (required: none is waiting to be measured since SCALE_SCAN was dropped, 2026-12-03; space-separated; a comma-joined entry flips several
# together, NAME=a:b:c builds one define at several values) built 0 and 1.  The thirty-fourth to thirty-eighth sessions measured and turned on CONV_ONE_ROUND,
# GATE_FAST, SCALE_UNROLL, ROW_NORM_SPREAD, EXP2_FTZ, CONV_PAIRS, T_HALVES, BETA_EARLY, COPY_ROWS, EARLY_LOOKUP,
# G_BALANCE, SILU_FAST, G_STAGED, ROW_SCATTER, T_ROWS = 2, LOOKUP_BOUNDS, GATE_POLY, PAD_FIXUP and E_SCAN.
#   1. each entry's kernel A/B (bench_kda_phases.py --ab, beta as the model passes it with --ldb 288: 5 interleaved
#      rounds a shape, outputs compared bit for bit, phase cycles of both builds);
#   2. the phases of 8 and of 132 tiles launched alone, twice, the second from warm L2 (--solo: are the copies slow
#      because a wave's CTAs all copy at once?);
#   3. the GPU tests of tests/kernels/test_kda_prefill.py (the variants test: each switch against the all-off build or
#      the build it stacks on);
#   4. with "model" as first argument and $MODEL_ENV set (0 / 1 KDA_RT_KDA_* switches, comma-joined, e.g.
#      KDA_RT_KDA_GATE_POLY,KDA_RT_KDA_E_SCAN; KDA_RT_KDA_T_ROWS takes 1, 2, 4 and is not one of them), the full
#      27-layer model's seed prefill with them all 0 / all 1 (bench_ab.py, fp8 weights, 3 rounds).
# Times (thirty-eighth session, call 38.1, 243 s in all with the install): each A/B ~15-20 s, the tests 133 s, the
# model A/B ~60 s (builds included).
#   AB="..." bash tests/gpu/kda_intra_variants.sh [model]   (from the repository root; writes $OUT/kda_intra_variants.txt)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
log="$OUT/kda_intra_variants.txt"
rm -f "$log"
for ab in ${AB:?"AB=\"DEFINE ...\" names the kda_prefill.cu defines to A/B"}; do
  echo "== --ab $ab --ldb 288" | tee -a "$log"
  timeout 100 python tests/gpu/bench_kda_phases.py --shapes 32x2048,8x2048,1x32768 --ldb 288 --ab "$ab" >> "$log" 2>&1
  grep -E "kernel [0-9.]+ ms|bit-identical" "$log" | tail -15
done
echo "== the copies alone (--solo 8,132, the default build)" | tee -a "$log"
timeout 60 python tests/gpu/bench_kda_phases.py --shapes 32x2048 --ldb 288 --solo 8,132 >> "$log" 2>&1
grep -E "alone|start: copies" "$log" | tail -6
timeout 300 python -m pytest -q tests/kernels/test_kda_prefill.py 2>&1 | tail -3 | tee -a "$log"
if [ "$1" = model ] && [ -n "$MODEL_ENV" ] && [ "$SECONDS" -gt 420 ]; then
  echo "== the model A/B skipped: ${SECONDS} s gone, the device's 600 s a call would not hold it" | tee -a "$log"
elif [ "$1" = model ] && [ -n "$MODEL_ENV" ]; then
  envs=$MODEL_ENV
  n=$(echo "$envs" | tr ',' '\n' | wc -l)
  zeros=$(yes 0 | head -n "$n" | paste -sd:) ones=$(yes 1 | head -n "$n" | paste -sd:)
  timeout 150 python tests/gpu/bench_ab.py --quantization fp8 --env "$envs" --values "$zeros,$ones" --rounds 3 \
    2>/dev/null | tee -a "$log" | grep summary
fi
