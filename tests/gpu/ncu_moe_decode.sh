#!/usr/bin/env bash
# What bounds the fused decode MoE kernel with e4m3 weights (issue 12, fp8 decode): Nsight Compute on one launch of
# moe_decode_fused with bf16 weights and one with e4m3 weights (the launcher's tiles and conversion), batch T tokens
# routed over ~T*8/3.7 experts (tests/gpu/bench_moe_decode.py's "concentrated" routing: 68 experts at T = 32).
#   bash tests/gpu/ncu_moe_decode.sh [T]      (default 32; writes $OUT/ncu_moe_decode.ncu-rep and its details page)
# Prints each launch's speed of light, warp states, scheduler, pipe utilization and memory headline rows; leaves every
# metric ($OUT/ncu_moe_decode_raw.csv) and the SASS with its sampled stall reasons ($OUT/ncu_moe_decode_sass.csv).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
T=${1:-32}
R="$OUT/ncu_moe_decode"
cat > /tmp/ncu_moe_decode_run.py <<'PY'
import sys
sys.path.insert(0, "tests/gpu")
sys.path.insert(0, "tests")
import cupy
from bench_moe_decode import A, D, E, INTER, _decode_cases
from helpers.gpu import rand_bf16
from helpers.moe_gemm import e4m3_stack
import numpy as np
from kda_rt.cuda.ops import moe_gemm_tc as mod
from kda_rt.cuda.ops.moe_align import moe_bucket

T = int(sys.argv[1])
rng, hrng = cupy.random.default_rng(1), np.random.default_rng(1)
w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
q13, s13 = e4m3_stack(rng, hrng, E, 2 * INTER, D)
q2, s2 = e4m3_stack(rng, hrng, E, D, INTER)
shapes = [(2 * INTER, D, True), (D, INTER, False)]
case = next(c for c in _decode_cases([T], 1) if c[1] == "concentrated" or T * A >= 3.7 * E)
_, routing, cases, touched, x, h, y = case
ids, plan, sync = cases[0]
tf = mod.fused_decode_tile(T, D, INTER)
print(f"T={T} {routing} {touched} experts; bf16 tile {tuple(tf)}, e4m3 tile {tuple(mod.fused_e4m3_tile(tf, shapes))}")
for _ in range(2):  # launches 1-2 warm-up (bf16, e4m3), 3-4 profiled
    moe_bucket(ids, E, plan, sync=sync)
    mod.moe_decode_fused(x, w13, w2, plan, top_k=A, h=h, out=y, sync=sync, tile=tf)
    moe_bucket(ids, E, plan, sync=sync)
    mod.moe_decode_fused(x, q13, q2, plan, top_k=A, h=h, out=y, sync=sync, scale13=s13, scale2=s2)
cupy.cuda.Device().synchronize()
PY
"$NCU" --clock-control none -k "regex:moe_decode_fused" --launch-skip 2 --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
  --section SourceCounters --section WarpStateStats \
  -f -o "$R" python /tmp/ncu_moe_decode_run.py "$T" 2>&1 | grep -v "^==PROF==" | tail -3
"$NCU" --import "$R.ncu-rep" --page details --print-units base > "${R}_details.txt"
# every metric (the sampled stall reasons: smsp__pcsamp_warps_issue_stalled_*) and the SASS with its samples
"$NCU" --import "$R.ncu-rep" --page raw --csv --print-units base > "${R}_raw.csv"
"$NCU" --import "$R.ncu-rep" --page source --csv --print-source sass > "${R}_sass.csv" 2>&1 || true
grep -E "^  [a-z_]+|Duration|Throughput|Busy|Issue Slots|Eligible Warps|Active Warps Per|No Eligible|Stall|highest|Registers Per|Achieved Occupancy|Executed Ipc|Pipe" \
  "${R}_details.txt" | head -120
