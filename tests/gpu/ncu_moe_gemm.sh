#!/usr/bin/env bash
# Where the prefill MoE GEMMs' warps wait (issue 11): Nsight Compute on one launch of each wgmma grouped GEMM
# (moe_grouped_gemm_wg, gate/up then down) at T tokens, with warp-state and per-SASS-line stall samples.
#   bash tests/gpu/ncu_moe_gemm.sh [T]        (default 16384; writes $OUT/ncu_moe_gemm.ncu-rep)
# Prints the details page (speed of light, warp states, scheduler) and the SASS lines with the most stall
# samples (tests/gpu/ncu_source_top.py).  Not yet run on the GPU when written (2026-12-01): if an ncu option
# or a CSV column name differs on the machine's ncu, fix it here.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
T=${1:-16384}
# launches 1-2 are the warm-up pair of run_once, 3-4 the pair looked at
$NCU --clock-control none -k regex:moe_grouped_gemm_wg --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --import-source no \
  -f -o "$OUT/ncu_moe_gemm" python tests/gpu/bench_moe_gemm.py --once --tokens "$T"
$NCU --import "$OUT/ncu_moe_gemm.ncu-rep" --page details --print-units base
$NCU --import "$OUT/ncu_moe_gemm.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_moe_gemm_sass.csv" \
  && python tests/gpu/ncu_source_top.py "$OUT/ncu_moe_gemm_sass.csv"
