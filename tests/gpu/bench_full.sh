#!/usr/bin/env bash
# Full Kimi-Linear-48B-A3B shape (27 layers, random bf16 weights built by the bench, router bias std
# 0.05): the seed benchmark (batch 32, 2048 in, 512 out, with --profile), batch 1 and 8 (2048 in, 128 out)
# and one 32K and one 128K prompt ($ALSO), each printing its decode bytes floor from the experts the
# run routed and its prefill floor; `peer` then times transformers + fla at batch 32 and 1 (2048 in)
# (peer_transformers.py --layers 27, its own random weights, same shapes).
#   bash tests/gpu/bench_full.sh [ours] [peer]        (needs .whl/ carried for `peer`)
# BENCH_ARGS adds bench flags to `ours`, e.g. BENCH_ARGS="--quantization fp8 --num-iters 3" (the fp8 rows, each number
# the median of three timed runs).
# One JSON line per run in $OUT/bench_full.jsonl, the profiles and floors in $OUT/bench_full_err.txt.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
for mode in "$@"; do
  if [ "$mode" = ours ]; then  # one process, one load: the seed benchmark (profiled), batch 1, long prompts
    timeout ${BENCH_TIMEOUT:-400} python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights \
      --router-bias-std 0.05 --batch 32 --input-len 2048 --output-len 512 --profile \
      --also ${ALSO:-1:2048:128,8:2048:128,1:32768:16,1:131072:16} ${BENCH_ARGS:-} 2>>$OUT/bench_full_err.txt | tee -a $OUT/bench_full.jsonl \
      | cut -c1-300
    grep -E "^[0-9]+ x [0-9]+ / [0-9]+: decode" $OUT/bench_full_err.txt
  elif [ "$mode" = peer ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fla ${WHL:-.whl}/*.whl
    for shape in "32 2048 64" "1 2048 64"; do
      set -- $shape
      PYTHONPATH=/tmp/fla timeout ${BENCH_TIMEOUT:-300} python ${WHL:-.whl}/peer_transformers.py --layers 27 --batch $1 \
        --input $2 --output $3 2>>$OUT/peer_err.txt | tail -1 | tee -a $OUT/bench_full.jsonl
    done
  fi
done
