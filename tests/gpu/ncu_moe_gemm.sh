#!/usr/bin/env bash
# Where the prefill MoE GEMMs' warps wait (issue 11): Nsight Compute on one launch of each wgmma grouped GEMM
# (moe_grouped_gemm_wg, gate/up then down) at T tokens, with warp-state and per-SASS-line stall samples.
#   bash tests/gpu/ncu_moe_gemm.sh [T]        (default 16384; writes $OUT/ncu_moe_gemm.ncu-rep)
#   KDA_RT_MOE_WS=1 KERNEL=moe_grouped_gemm_ws bash tests/gpu/ncu_moe_gemm.sh   (the warp-specialized form; TAG=ws
#   names its files ncu_moe_gemm_ws.*)
# Writes the details page (speed of light, warp states, scheduler) to $OUT and prints its headline rows, then
# the SASS lines with the most stall samples (tests/gpu/ncu_source_top.py).  Ran on the H200 on 2026-12-01
# (thirteenth session: docs/PERFORMANCE.md, "what the prefill kernels are bound by").
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
T=${1:-16384}
# launches 1-2 are the warm-up pair of run_once, 3-4 the pair looked at
KERNEL=${KERNEL:-moe_grouped_gemm_wg}
R="$OUT/ncu_moe_gemm${TAG:+_$TAG}"
$NCU --clock-control none -k "regex:$KERNEL" --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --import-source no \
  -f -o "$R" python tests/gpu/bench_moe_gemm.py --once --tokens "$T"
# the whole details page to a file; its headline rows here
$NCU --import "$R.ncu-rep" --page details --print-units base > "${R}_details.txt"
grep -E "^  [a-z_]+|SM Frequency|Duration|Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|highest-utilized|Registers Per" \
  "${R}_details.txt"
$NCU --import "$R.ncu-rep" --page source --print-source sass --csv > "${R}_sass.csv" \
  && python tests/gpu/ncu_source_top.py "${R}_sass.csv"
