#!/usr/bin/env bash
# Where kda_prefill_intra's warps wait (issue 11): Nsight Compute on one launch of the KDA intra-chunk kernel
# at 32 x 2048 (bench_kda_prefill.py's random inputs), warp states, occupancy and per-SASS-line stall samples.
#   [DEFINES="E_SCAN=0,GATE_POLY=0"] bash tests/gpu/ncu_kda_intra.sh [NUM_SEQS] [SEQLEN]
#   (default 32 2048, the kernel file's defaults; writes $OUT/ncu_kda_intra.ncu-rep)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
B=${1:-32} S=${2:-2048}
# DEFINES as Python keyword arguments of intra_only (NAME=value, comma-joined)
KW=$(echo "${DEFINES:-}" | tr ',' '\n' | grep . | sed 's/^/, /' | tr -d '\n')
# the intra kernel launched twice: launch 1 is the warm-up (compiles), launch 2 the one looked at
RUN="import sys; sys.path.insert(0, 'tests/gpu')
import cupy, bench_kda_prefill as b
run = b.intra_only(b.make($B, $S)$KW)
run(); run(); cupy.cuda.Device().synchronize(); print('kda_prefill_intra ran twice')"
$NCU --clock-control none -k regex:kda_prefill_intra --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section InstructionStats --import-source no \
  -f -o "$OUT/ncu_kda_intra" python -c "$RUN"
# the whole details page to a file; its headline rows here
$NCU --import "$OUT/ncu_kda_intra.ncu-rep" --page details --print-units base > "$OUT/ncu_kda_intra_details.txt"
grep -E "^  [a-z_]+|Executed Ipc|SM Busy|SM Frequency|Duration|Throughput|Issue Slots Busy|Eligible Warps|Active Warps Per|highest-utilized|Registers Per" \
  "$OUT/ncu_kda_intra_details.txt"
$NCU --import "$OUT/ncu_kda_intra.ncu-rep" --page source --print-source sass --csv > "$OUT/ncu_kda_intra_sass.csv" \
  && python tests/gpu/ncu_source_top.py "$OUT/ncu_kda_intra_sass.csv" --top 40 --regions
# pipe utilizations (a separate launch; metric names differ between ncu versions, so a failure here is reported only)
$NCU --clock-control none -k regex:kda_prefill_intra --launch-skip 1 --launch-count 1 --metrics \
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,\
sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,\
sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_issued.avg.pct_of_peak_sustained_active,\
sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second python -c "$RUN" 2>&1 | grep -E "sm__|==ERROR|==WARNING" || echo "pipe metrics: not read"
