#!/usr/bin/env bash
# The engine's headline rows on the current defaults, in one device call (docs/PERFORMANCE.md "At a glance"): the full
# 27-layer 48B shape (random weights built on the GPU, router bias std 0.05), each run printing its decode floor from
# the experts it routed and its prefill floor (bench_full.sh ours):
#   1. bf16: the seed run (32 x 2048 / 512, profiled), batch 1 (2048 / 128), the ramp-down workload (100 x 2048 /
#      128: the batch shrinks through the graph sizes, padding rows and all) and the serving workload (256 x 8192 /
#      1024);
#   2. fp8 (--quantization fp8): the same four (batch 1 with the e4m3 decode GEMVs, KDA_RT_FP8_DECODE_GEMV, whose
#      floor bench lowers by the bytes they do not read).
# The defaults include prefix caching (on since the fifty-ninth session; bench empties the cache before each run, and
# these workloads share no prompt start) and 2-row fp8 decode GEMVs.  The bf16 part needs an H200 (98 GB of weights:
# on an 80 GB card the runner refuses it by name; ask for nvidia-h200 with needs_h200).
# ~5 minutes with the machine warm (the bf16 part 140-200 s, two model builds of ~36-46 s).  Run from the repository
# root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/headline_bench.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
workloads=1:2048:128,100:2048:128,256:8192:1024
echo "== bf16"
ALSO=$workloads BENCH_TIMEOUT=$((290 - SECONDS)) bash tests/gpu/bench_full.sh ours
echo "== fp8 ($SECONDS s)"
ALSO=$workloads BENCH_ARGS="--quantization fp8" BENCH_TIMEOUT=$((590 - SECONDS)) bash tests/gpu/bench_full.sh ours
