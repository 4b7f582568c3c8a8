#!/usr/bin/env bash
# What bounds mla_attn_split in a decode step (issue 12: at batch 32 and 2K context the model's trace gives it ~40 us a
# layer against ~17.5 us of latent-row bytes): Nsight Compute on one launch of the absorbed decode attention.
#   bash tests/gpu/ncu_mla_decode.sh [B] [L]      (defaults 32 2048; writes $OUT/ncu_mla_B_L.ncu-rep)
# Prints the launch's speed of light, warp states and memory headline rows; leaves every metric (..._raw.csv) and the
# SASS with its sampled stall reasons (..._sass.csv; tests/gpu/ncu_source_top.py lists the top lines).
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | sort -V | tail -1)
if [ -z "$NCU" ] || [ ! -x "$NCU" ]; then
  echo "ncu_mla_decode.sh: Nsight Compute (ncu) not found on PATH or under /opt/nvidia/nsight-compute" >&2
  exit 2
fi
B=${1:-32} L=${2:-2048}
R="$OUT/ncu_mla_${B}_${L}"
cat > /tmp/ncu_mla_run.py <<'PY'
import sys

import cupy
import numpy as np

sys.path.insert(0, "tests")
from helpers.gpu import BF16  # noqa: E402
from helpers.mla_kernel import DV, SCALE, bench_decode_inputs  # noqa: E402
from kda_rt.cuda.ops.mla_attn import decode_workspace_bytes, launch_splits, mla_attention, num_splits  # noqa: E402

B, L = (int(v) for v in sys.argv[1:3])
H, S = 32, 64
case = bench_decode_inputs(B, L, H, S, seed=1, scattered=True)
q, pool, w_kvb, cu, ctx, tables, M = (case[k] for k in ("q", "pool", "w_kvb", "cu", "ctx", "tables", "M"))
out = cupy.empty((B, H * DV), dtype=BF16)
ws = cupy.empty(decode_workspace_bytes(B, H, M, S), dtype=np.uint8)
print("splits", num_splits(B, M, S), "launched", launch_splits(B, num_splits(B, M, S)))
for _ in range(4):  # the build, then warm launches; the profiled one is the 4th split launch
    mla_attention(q, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE, max_seqlen=1, decode=True, out=out,
                  workspace=ws)
cupy.cuda.Device().synchronize()
PY
"$NCU" --clock-control none -k "regex:mla_attn_split" --launch-skip 3 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats \
  --section SourceCounters \
  -f -o "$R" python /tmp/ncu_mla_run.py "$B" "$L" 2>&1 | grep -v "^==PROF==" | tail -3
"$NCU" --import "$R.ncu-rep" --page details --print-units base > "${R}_details.txt"
"$NCU" --import "$R.ncu-rep" --page raw --csv --print-units base > "${R}_raw.csv"
"$NCU" --import "$R.ncu-rep" --page source --csv --print-source sass > "${R}_sass.csv" || true
grep -E "^  [a-z_]+|Duration|Throughput|Busy|Issue Slots|Eligible Warps|Active Warps Per|No Eligible|Stall|highest|Registers Per|Achieved Occupancy|Executed Ipc|Pipe" \
  "${R}_details.txt" | head -120
