#!/usr/bin/env bash
# Full Kimi-Linear-48B-A3B shape (27 layers, random bf16 weights built by the bench, router bias std
# 0.05): the seed benchmark (batch 32, 2048 in, 512 out, with --profile) and batch 1 (2048 in, 128
# out), each printing its decode bytes floor from the experts the run routed; `peer` then times
# transformers + fla on the same shapes (peer_transformers.py --layers 27, its own random weights).
#   bash tests/gpu/bench_full.sh [ours] [peer]        (needs .whl/ carried for `peer`)
# One JSON line per run in $OUT/bench_full.jsonl, the profiles and floors in $OUT/bench_full_err.txt.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
for mode in "$@"; do
  if [ "$mode" = ours ]; then
    for shape in "32 2048 512 --profile" "1 2048 128"; do
      set -- $shape
      timeout ${BENCH_TIMEOUT:-300} python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights \
        --router-bias-std 0.05 --batch $1 --input-len $2 --output-len $3 $4 2>>$OUT/bench_full_err.txt \
        | tee -a $OUT/bench_full.jsonl
      grep -E "^decode step|floor" $OUT/bench_full_err.txt | tail -1
    done
  elif [ "$mode" = peer ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla .whl/*.whl
    for shape in "32 2048 64" "1 2048 64"; do
      set -- $shape
      PYTHONPATH=/tmp/fla timeout ${BENCH_TIMEOUT:-300} python .whl/peer_transformers.py --layers 27 --batch $1 \
        --input $2 --output $3 2>>$OUT/peer_err.txt | tail -1 | tee -a $OUT/bench_full.jsonl
    done
  fi
done
