set -o pipefail
export OUT=${OUT:-/tmp/out}
PART=3 bash tests/gpu/device_run.sh 2>&1 | tail -15
export PYTHONPATH=$PWD KDA_RT_CACHE_DIR=$HOME/.cache/kda_rt PYTHONUNBUFFERED=1
echo "== rows32 ($SECONDS s)"
timeout 150 python -m pytest -q tests/kernels/test_moe_block.py -k rows32 -p no:cacheprovider -s 2>&1 | grep -E "rms rel|plan|passed|failed|Error" | tail -8
echo "== bf16 A/B ($SECONDS s)"
timeout $((570 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_FUSED32 --values 0,1 --prompts 0 \
    --replays 128,256 --rounds 2 2> "$OUT/fused32_ab_bf16.err" | tee "$OUT/fused32_ab_bf16.jsonl" | grep summary
echo "done $SECONDS s"
