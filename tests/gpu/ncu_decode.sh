#!/usr/bin/env bash
# Per-kernel GPU times of one eager decode step (ncu, no clock control, duration only), on a cut of the
# Kimi-Linear-48B-A3B shape: `bash tests/gpu/ncu_decode.sh [layers] [batch] [context]` (defaults 4, 32, 2048).
# Prints every kernel of the last decode step (between the last two sampling launches) with its time.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
L=${1:-4} B=${2:-32} C=${3:-2048}
# one prefill step for all prompts, so the last two steps decode the whole batch
$NCU --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
  --log-file $OUT/ncu_decode_${L}_${B}_${C}.csv \
  python -m kda_rt.bench --config kimi-linear-48b-a3b --num-layers $L --random-weights --router-bias-std 0.05 \
  --batch $B --input-len $C --output-len 3 --enforce-eager --no-warmup --max-num-batched-tokens $((B * C)) \
  --max-num-seqs $B --gpu-memory-utilization 0.6 > /dev/null 2>$OUT/ncu_bench_err_${B}.txt
python tests/gpu/ncu_table.py $OUT/ncu_decode_${L}_${B}_${C}.csv
