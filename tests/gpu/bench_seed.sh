#!/usr/bin/env bash
# The seed benchmark (batch 32, 2048 in, 512 out) on a Kimi-Linear-48B-shaped 4-layer random
# checkpoint (router bias std 0.05, so routing follows the data), before and after a change, in
# one device call:  bench_seed.sh [BEFORE_DIR]   (BEFORE_DIR: a plain copy of the older tree,
# e.g. `git archive REV | tar -x -C .before`, carried to the device).  One JSON line per run.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=$PWD
CK=${CK:-/tmp/k48b}
if [ ! -d "$CK" ]; then
  python tests/helpers/configs.py /tmp/k48b.json 4
  python -m kda_rt.random_checkpoint --config /tmp/k48b.json --out "$CK" --seed 2 --router-bias-std 0.05 > /dev/null
fi
ARGS="--model $CK --backend cuda --batch 32 --input-len 2048 --output-len 512"
if [ -n "$1" ]; then  # twice: the first run fills the older tree's kernel cache (NVRTC), the second is timed
  (cd "$1" && python -m kda_rt.bench $ARGS --output-len 8 > /dev/null 2>>$OUT/bench_err.txt)
  (cd "$1" && python -m kda_rt.bench $ARGS 2>>$OUT/bench_err.txt | sed 's/^/before: /' | tee -a $OUT/seed.txt)
fi
python -m kda_rt.bench $ARGS --max-model-len 2560 --no-warmup 2>>$OUT/bench_err.txt | sed 's/^/after (same method): /' | tee -a $OUT/seed.txt
python -m kda_rt.bench $ARGS ${PROFILE:---profile} 2>>$OUT/bench_err.txt | sed "s/^/after (warm-up, default max_model_len): /" | tee -a $OUT/seed.txt
grep -v "^\[kda_rt\]" $OUT/bench_err.txt | grep -A30 "prefill step\|decode step" | head -70
