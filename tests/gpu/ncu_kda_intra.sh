#!/usr/bin/env bash
# Where kda_prefill_intra's warps wait (issue 11): Nsight Compute on one launch of the KDA intra-chunk kernel
# at 32 x 2048 (bench_kda_prefill.py's random inputs), warp states, occupancy and per-SASS-line stall samples.
#   bash tests/gpu/ncu_kda_intra.sh [NUM_SEQS] [SEQLEN]     (default 32 2048; writes $OUT/ncu_kda_intra.ncu-rep)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
B=${1:-32} S=${2:-2048}
# launch 1 is the warm-up (compiles), launch 2 the one looked at
$NCU --clock-control none -k regex:kda_prefill_intra --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --import-source no \
  -f -o "$OUT/ncu_kda_intra" python -c "
import sys; sys.path.insert(0, 'tests/gpu')
import cupy, bench_kda_prefill as b
run = b.intra_only(b.make($B, $S))
run(); run(); cupy.cuda.Device().synchronize(); print('kda_prefill_intra ran twice')"
# the whole details page to a file; its headline rows here
$NCU --import "$OUT/ncu_kda_intra.ncu-rep" --page details --print-units base > "$OUT/ncu_kda_intra_details.txt"
grep -E "^  [a-z_]+|SM Frequency|Duration|Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|highest-utilized|Registers Per" \
  "$OUT/ncu_kda_intra_details.txt"
$NCU --import "$OUT/ncu_kda_intra.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_kda_intra_sass.csv" \
  && python tests/gpu/ncu_source_top.py "$OUT/ncu_kda_intra_sass.csv" --top 40
