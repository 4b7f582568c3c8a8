#!/usr/bin/env bash
# Long-context rows of docs/PERFORMANCE.md (issue 8): kda_rt and transformers + fla 0.6 on the same
# Kimi-Linear-48B-shaped 5-layer random bf16 model (KDA-dense, KDA-MoE x2... as peer_transformers
# builds it, router bias std 0.05), one device call per mode:
#   bench_long.sh ours   peer at 1 x 32K (saves the checkpoint), then kda_rt at 1x32K, 1x128K, 8x8K
#   bench_long.sh peer   peer at 1 x 128K and 8 x 8K (same seed: the same weights)
# Needs .whl/ (carried, git-ignored) with the fla-core / flash-linear-attention 0.6.0 wheels and a
# copy of ../shared/bench/peer_transformers.py.  Each line printed is one JSON result.
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v -i "running pip as" | tail -3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
peer() { PYTHONPATH=/tmp/site python .whl/peer_transformers.py --layers 5 --output 64 "$@" 2>>$OUT/peer_err.txt | tail -1; }
if [ "$1" = ours ]; then
  peer --batch 1 --input 32768 --save /tmp/k5 | tee -a $OUT/bench.jsonl
  for shape in "1 32768" "1 131072" "8 8192"; do
    set -- $shape
    python -m kda_rt.bench --model /tmp/k5 --backend cuda --batch $1 --input-len $2 --output-len 64 \
      2>>$OUT/ours_err.txt | tee -a $OUT/bench.jsonl
  done
else
  peer --batch 1 --input 131072 | tee -a $OUT/bench.jsonl
  peer --batch 8 --input 8192 | tee -a $OUT/bench.jsonl
fi
tail -5 $OUT/peer_err.txt $OUT/ours_err.txt 2>/dev/null
