#!/usr/bin/env bash
# Issue 12 (small MoE decode kernels): GPU tests of moe_route / moe_combine (+ the MoE block tests on
# small shapes and its CUDA-graph replay), then the old-vs-new micro-bench (graph replay us).
# Run from the repo root after an editable install: PYTHONPATH=. bash tests/gpu/check_moe_route.sh  (~60 s)
set -o pipefail
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_moe_route.py tests/kernels/test_moe_combine.py \
  tests/kernels/test_moe_stats.py "tests/kernels/test_moe_block.py" -k "not test_moe_forward or small or T1-E256 or graph" -rs 2>&1 | tail -25
rc=$?
python tests/gpu/bench_moe_route.py || rc=1
exit $rc
