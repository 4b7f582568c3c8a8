#!/usr/bin/env bash
# What limits a weight stream on this GPU (issue 12, decode): Nsight Compute's breakdown of L2 throughput (the
# fabric between the two L2 partitions, the crossbars, the tag stage) with DRAM bytes and duration, for
#   1. a plain read stream: cupy's sum over 2 GiB of float32 (every byte read once, nothing written);
#   2. a device-to-device copy of 2 GiB (cupy.copyto: the "copy bandwidth" the floors use);
#   3. moe_decode_fused at batch T with bf16 and with e4m3 weights (tests/gpu/ncu_moe_decode.sh's launches).
#   bash tests/gpu/ncu_stream_limit.sh [T]      (default 32)
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
T=${1:-32}
M=breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,lts__t_sectors.sum,lts__t_sectors_srcunit_tex.sum,lts__t_sectors_srcunit_ltcfabric.sum
M=$M,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,gpu__time_duration.sum
cat > /tmp/stream_run.py <<'PY'
import cupy
a = cupy.random.random(2**29, dtype=cupy.float32)  # 2 GiB
b = cupy.empty_like(a)
for _ in range(2):  # launches 1-2 warm-up, 3-4 profiled (sum, copy)
    s = a.sum()
    cupy.copyto(b, a)
cupy.cuda.Device().synchronize()
print("GB", a.nbytes / 1e9, float(s) > 0)
PY
echo "=== read stream (sum) and copy, 2 GiB"
timeout 120 "$NCU" --clock-control none --launch-skip 2 --launch-count 2 --metrics "$M" python /tmp/stream_run.py 2>&1 \
  | grep -E "^  [a-zA-Z_]|lts__|dram__|gpu__time"
echo "=== moe_decode_fused, T=$T: bf16 then e4m3 weights"
bash tests/gpu/ncu_moe_decode.sh "$T" > /dev/null 2>&1  # (writes /tmp/ncu_moe_decode_run.py)
timeout 120 "$NCU" --clock-control none -k "regex:moe_decode_fused" --launch-skip 2 --launch-count 2 --metrics "$M" \
  python /tmp/ncu_moe_decode_run.py "$T" 2>&1 | grep -E "^  [a-zA-Z_]|lts__|dram__|gpu__time"
