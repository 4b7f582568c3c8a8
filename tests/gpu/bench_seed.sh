#!/usr/bin/env bash
# The seed benchmark (batch 32, 2048 in, 512 out) on a Kimi-Linear-48B-shaped 4-layer random
# checkpoint (router bias std 0.05, so routing follows the data), before and after a change, in
# one device call:  bench_seed.sh [BEFORE_DIR]   (BEFORE_DIR: a plain copy of the older tree,
# e.g. `git archive REV | tar -x -C .before`, carried to the device).  Both trees' kernel caches
# are filled first; then REPEATS (default 3) alternating before/after runs with the same method
# (no warm-up run, max_model_len 2560, as the older bench did), then one run of today's defaults
# with --profile.  One line per run: elapsed s, TTFT mean s, decode step mean s.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=$PWD
CK=${CK:-/tmp/k48b}
if [ ! -d "$CK" ]; then
  python tests/helpers/configs.py /tmp/k48b.json 4
  python -m kda_rt.random_checkpoint --config /tmp/k48b.json --out "$CK" --seed 2 --router-bias-std 0.05 > /dev/null
fi
ARGS="--model $CK --backend cuda --batch 32 --input-len 2048 --output-len 512"
SAME="--max-model-len 2560 --no-warmup"
line() { python -c "import json, sys; d = json.load(sys.stdin); print('$1', 'elapsed', round(d['elapsed_s'], 3), 'ttft_mean', round(d['ttft_s_mean'], 3), 'decode_step', round(d['decode_step_s_mean'] * 1e3, 3), 'ms')" | tee -a $OUT/seed.txt; }
[ -n "$1" ] && (cd "$1" && python -m kda_rt.bench $ARGS --output-len 8 > /dev/null 2>>$OUT/bench_err.txt)
python -m kda_rt.bench $ARGS $SAME --output-len 8 > /dev/null 2>>$OUT/bench_err.txt
for i in $(seq ${REPEATS:-3}); do
  [ -n "$1" ] && (cd "$1" && python -m kda_rt.bench $ARGS 2>>$OUT/bench_err.txt | line before)
  python -m kda_rt.bench $ARGS $SAME 2>>$OUT/bench_err.txt | line after
done
python -m kda_rt.bench $ARGS --profile 2>>$OUT/bench_err.txt | tee $OUT/seed_profile.json | line "after, defaults (warm-up, max_model_len = model limit)"
grep -A10 "prefill step\|decode step" $OUT/bench_err.txt | head -24
