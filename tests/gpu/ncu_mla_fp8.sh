#!/usr/bin/env bash
# What bounds the FP8 MLA prefill attention (mla_prefill_attn_fp8, KDA_RT_MLA_FP8): Nsight Compute on one launch,
# the second 16384-query chunk of one 32768-token prompt (keys up to 32K), with warp-state and per-SASS-line stall
# samples.
#   bash tests/gpu/ncu_mla_fp8.sh        (writes $OUT/ncu_mla_fp8.ncu-rep and the details page)
# bench_mla_prefill.py --fp8 launches the fp8 kernel 4 times a chunk (a warm-up call, then 3 rounds): launch 8 is the
# last of the second chunk.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
$NCU --clock-control none -k regex:mla_prefill_attn_fp8 --launch-skip 7 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --section ComputeWorkloadAnalysis --section InstructionStats --import-source no \
  -f -o "$OUT/ncu_mla_fp8" python tests/gpu/bench_mla_prefill.py --fp8 --shapes 1x32768-chunks-16384
$NCU --import "$OUT/ncu_mla_fp8.ncu-rep" --page details --print-units base > "$OUT/ncu_mla_fp8_details.txt"
grep -E "^  [a-z_]+|SM Frequency|Duration|Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|highest-utilized|Registers Per|Pipe" \
  "$OUT/ncu_mla_fp8_details.txt"
$NCU --import "$OUT/ncu_mla_fp8.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_mla_fp8_sass.csv" \
  && python tests/gpu/ncu_source_top.py "$OUT/ncu_mla_fp8_sass.csv"
