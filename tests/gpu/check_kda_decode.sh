#!/usr/bin/env bash
# KDA decode layer (issue 12) on the device, from the repo root (< 90 s on an H200):
#   1. tests/kernels/test_kda_decode.py: every kernel variant (column split 1/2/4/8 over a cluster)
#      against the float64 reference, B = 1, 3, 5, 8, 32, 128; fresh + continuing slots, permuted
#      slots, normal / mixed / extreme gates; fused low-rank gates (B = 1, 3, 5, 16); decode after
#      prefill; CUDA-graph capture;
#   2. graph-replay us and TB/s of the fp32 state (read + written) for B = 1, 8, 32, 64, 128, 256,
#      the launcher's choice first, then every variant (issue 12 targets: B = 1 <= 6 us,
#      >= 3.6 TB/s at B >= 64; the H200 copy ceiling is ~4.3 TB/s); then, for B <= 64, the two
#      f_b / g_b cuBLAS GEMVs + kda_decode against kda_decode with them fused (sets FUSE_MAX_SEQS).
# Logs land in $OUT (when set).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python -m pytest -q tests/kernels/test_kda_decode.py -p no:cacheprovider -rs 2>&1 | tee "$OUT/kda_decode_tests.txt" | tail -15
rc=$?
python tests/gpu/bench_decode_sweep.py --parts=kda --kda-batches=1,8,32,64,128,256 --kda-variants 2>&1 \
  | tee "$OUT/kda_decode_bench.txt"
exit $((rc | $?))
