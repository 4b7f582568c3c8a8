#!/usr/bin/env bash
# What bounds skinny_gemm_cl / _ws (KDA_RT_SKINNY_WS picks) at a decode batch (issue 12: o_proj 4096 -> 2304 at 32 rows streams ~1.8 TB/s):
# Nsight Compute on one launch, its weight in HBM (ncu flushes the caches before each pass; bench_skinny.py --l2
# times the L2-resident case).
#   bash tests/gpu/ncu_skinny.sh [M] [K] [N]      (defaults 32 4096 2304; writes $OUT/ncu_skinny_M_K_N.ncu-rep)
# Prints each launch's speed of light, warp states and memory headline rows; leaves every metric
# (..._raw.csv) and the SASS with its sampled stall reasons (..._sass.csv).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
M=${1:-32} K=${2:-4096} N=${3:-2304}
R="$OUT/ncu_skinny_${M}_${K}_${N}"
cat > /tmp/ncu_skinny_run.py <<'PY'
import sys
import cupy
import numpy as np
from kda_rt.cuda.ops import skinny_gemm as sk
from kda_rt.cuda.ops.check import BF16

M, K, N = (int(v) for v in sys.argv[1:4])
rng = cupy.random.default_rng(0)
ws = [(rng.standard_normal((N, K), dtype=np.float32) * K**-0.5).astype(BF16) for _ in range(8)]
x = rng.standard_normal((M, K), dtype=np.float32).astype(BF16)
out = cupy.empty((M, N), dtype=BF16)
print("plan", sk.wide_plan(M, N, K))
for w in ws[1:]:  # warm-up launches (the build)
    sk.skinny_gemm(x, w, out)
sk.skinny_gemm(x, ws[0], out)  # profiled
cupy.cuda.Device().synchronize()
PY
"$NCU" --clock-control none -k "regex:skinny_gemm_(cl|ws)" --launch-skip 7 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
  --section SourceCounters \
  -f -o "$R" python /tmp/ncu_skinny_run.py "$M" "$K" "$N" 2>&1 | grep -v "^==PROF==" | tail -3
"$NCU" --import "$R.ncu-rep" --page details --print-units base > "${R}_details.txt"
"$NCU" --import "$R.ncu-rep" --page raw --csv --print-units base > "${R}_raw.csv"
"$NCU" --import "$R.ncu-rep" --page source --csv --print-source sass > "${R}_sass.csv" 2>&1 || true
grep -E "^  [a-z_]+|Duration|Throughput|Busy|Issue Slots|Eligible Warps|Active Warps Per|No Eligible|Stall|highest|Registers Per|Achieved Occupancy|Executed Ipc|Pipe" \
  "${R}_details.txt" | head -120
