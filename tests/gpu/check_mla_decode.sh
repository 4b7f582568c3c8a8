#!/usr/bin/env bash
# MLA absorbed decode (issue 12), one device call (<= 120 s on an H200), from the repo root after an
# editable install, PYTHONPATH=.:  the mla_attention GPU tests (decode: GEMV and bmm up-projections,
# tile edges, many splits, CUDA-graph replay; the absorbed prefill cases share the kernels), the
# expanded-vs-absorbed prefill check, then us / TB/s for B in (1, 32, 128) x L in (1K, 4K, 32K, 128K)
# (graph replay; bytes = latent rows read once + kv_b; shapes whose pool passes 8 GB are skipped).
# Goal: >= 3.2 TB/s (75% of the ~4.3 TB/s copy ceiling) for L >= 4K; B=1 L=1K <= 10 us.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pytest -q -p no:cacheprovider -rs tests/kernels/test_mla_attn.py \
  "tests/kernels/test_mla_prefill.py::test_mla_prefill_matches_absorbed" 2>&1 | tee "$OUT/check_mla_decode_tests.txt" | tail -25
python tests/gpu/bench_decode_sweep.py --parts=mla --mla-batches=1,32,128 --mla-contexts=1024,4096,32768,131072 \
  2>&1 | tee "$OUT/check_mla_decode_bench.txt"
