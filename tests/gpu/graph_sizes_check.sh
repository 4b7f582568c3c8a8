#!/usr/bin/env bash
# The fifty-second session's prepared work in one device call (up to its 10 minutes; steps 2-4 while time lasts):
#   1. GPU tests of what it changed and could not run: EngineConfig.cuda_graph_sizes in the engine
#      (tests/gpu/test_cuda_model.py -k graph_sizes), the graphs' shared workspace (KDA_RT_SHARED_GRAPH_WS:
#      test_shared_graph_workspace, test_shared_workspace_views_and_lock), the MLA decode of more sequences than SMs with and without
#      KDA_RT_MLA_WAVE_SPLITS, the e4m3 MoE block cases (among them T300-E64-G8k4-fused64, the new default path:
#      moe_decode_fused's 64-row tiles of 33-63 rows) and the bf16 64-row fused tiles of 33-63 rows
#      (test_moe_forward_fused_rows) (a failure stops the script: nothing is timed);
#   2. what the decode graphs' padding rows cost (tests/gpu/graph_pad_check.py: batches 96, 160, 192 on their own
#      graphs against the next power of two's, the default buckets' way), for a finer default of cuda_graph_sizes;
#   3. KDA_RT_MLA_WAVE_SPLITS 0 against 1 on graphs of exactly 160 and 192 rows (bench_ab.py now captures them; its
#      fifty-second-session A/B replayed the 256-row graph there, one split either way);
#   4. while the call's time lasts, bf16 32-row fused tiles (KDA_RT_MOE_FUSED32=1) against the default 64-row
#      launches at batch 160 and 192 on their own graphs (moe_gemm_tc.py FUSED32_BF16_MAX_AVG's open crossover).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/graph_sizes_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests graph_sizes_tests 360 tests/gpu/test_cuda_model.py tests/kernels/test_mla_attn.py tests/kernels/test_moe_block.py \
  tests/kernels/test_workspace.py -k "graph_sizes or graph_capture or shared_graph or shared_workspace or more_tokens or \
  fused_rows or (e4m3 and (T256 or T300-E64))"
echo "== padding rows ($SECONDS s)"
timeout $((570 - SECONDS)) python tests/gpu/graph_pad_check.py --batches 96,160,192 --rounds 2 2> "$OUT/graph_pad.err" \
  | tee "$OUT/graph_pad.jsonl"
[ "$SECONDS" -lt 470 ] || exit 0
echo "== MLA wave splits ($SECONDS s)"
timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MLA_WAVE_SPLITS --values 0,1 --prompts 0 \
  --replays 160,192 --rounds 2 2> "$OUT/wave_ab.err" | tee "$OUT/wave_ab.jsonl" | grep summary
[ "$SECONDS" -lt 420 ] || exit 0
echo "== bf16 32-row tiles at 5.6 / 6.7 rows an expert, exact graphs ($SECONDS s)"
# (FUSED32_BF16_MAX_AVG = 5.5 rests on batch 128 and a "192" that ran the 256-row graph: the crossover is open)
timeout $((585 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MOE_FUSED32 --values auto,1 --prompts 0 \
  --replays 160,192 --rounds 1 2> "$OUT/fused32_ab.err" | tee "$OUT/fused32_ab.jsonl" | grep summary
