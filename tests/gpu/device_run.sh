#!/usr/bin/env bash
# One device run: install, every GPU test, the fast-path report on the demo and on a
# Kimi-Linear-48B-shaped 4-layer random checkpoint, and a bench.  Results land in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=$PWD
pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v -i "running pip as" | tail -5
python tests/gpu/k48_config.py /tmp/k48.json 4
python -m kda_rt.random_checkpoint --config /tmp/k48.json --out /tmp/k48 --seed 1 --fixed-routing > /dev/null &
CK=$!
python -m pytest -q -m "gpu and not slow" tests/kernels tests/gpu -p no:cacheprovider 2>&1 | tee $OUT/pytest_gpu.txt | tail -25
python -m kda_rt.generate --backend cuda --report --max-tokens 16 2>&1 | tee $OUT/report_demo.txt | tail -40
wait $CK
KDA_RT_TEST_48B_DIR=/tmp/k48 python -m pytest -q -m "gpu and slow" tests/gpu -s -p no:cacheprovider 2>&1 | tee $OUT/pytest_48b.txt | tail -8
python -m kda_rt.generate --backend cuda --report --model /tmp/k48 --prompt-token-ids 11,22,33,44 --max-tokens 8 2>&1 | tee $OUT/report_48b.txt | tail -40
python -m kda_rt.bench --model /tmp/k48 --backend cuda --batch 32 --input-len 2048 --output-len 128 2>&1 | tee $OUT/bench_48b4.txt | tail -3
