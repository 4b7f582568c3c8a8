#!/usr/bin/env bash
# The fifty-third session's new decode defaults in the engine, in one device call (after the GPU suite has passed on
# them: PART=1 / 2 / 3 bash tests/gpu/device_run.sh):
#   1. the seed run (batch 32, 2048 in, 512 out) of the full 27-layer shape in bf16 and fp8, with a ramp-down workload
#      (100 x 2048 / 128: the batch shrinks through the new 1.5x graph sizes as requests finish, its padding rows
#      skipping their KDA state and MoE pairs since the fifty-fourth session: KDA_RT_SKIP_PAD), each printing its
#      floor and decode_graph_padding (bench_full.sh ours); bf16 also the serving workload (256 x 8192 / 1024: its
#      decode steps at batch 256 take the bf16 64-row fused tiles, -5.0% in the replays);
#   2. the bf16 32-row fused tiles against the 64-row ones now that those run on moe_decode_fused with the A rows by
#      cp.async (KDA_RT_MOE_FUSED32=auto against 0 at batch 128 and 160: moe_gemm_tc.py FUSED32_BF16_MAX_AVG's
#      crossover was measured against the two 64-row launches), while the call's time lasts;
#   3. then fp8 with moe_decode_fused's items in reverse order against plan order (KDA_RT_MOE_DEC_REVERSE 1 / 0 at
#      batch 32 and 768: on by default in both formats, timed in bf16 alone).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/defaults53_bench.sh
set -o pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} PYTHONPATH=${PYTHONPATH:-$PWD}
mkdir -p "$OUT"
echo "== bf16 seed run"
ALSO=100:2048:128,256:8192:1024 BENCH_TIMEOUT=$((560 - SECONDS)) bash tests/gpu/bench_full.sh ours
[ "$SECONDS" -lt 330 ] || exit 0
echo "== fp8 seed run ($SECONDS s)"
ALSO=100:2048:128 BENCH_ARGS="--quantization fp8" BENCH_TIMEOUT=$((570 - SECONDS)) bash tests/gpu/bench_full.sh ours
[ "$SECONDS" -lt 430 ] || exit 0
echo "== bf16 32-row fused tiles against 64-row ones, exact graphs ($SECONDS s)"
timeout $((585 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_FUSED32 --values auto,0 --prompts 0 \
  --replays 128,160 --rounds 1 2> "$OUT/fused32_ab.err" | tee "$OUT/fused32_ab.jsonl" | grep summary
[ "$SECONDS" -lt 480 ] || exit 0
echo "== fp8: moe_decode_fused's items in reverse order (on by default, timed in bf16 only) ($SECONDS s)"
timeout $((590 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 --env KDA_RT_MOE_DEC_REVERSE --values 1,0 \
  --prompts 0 --replays 32,768 --rounds 1 2> "$OUT/reverse_fp8.err" | tee "$OUT/reverse_fp8.jsonl" | grep summary
