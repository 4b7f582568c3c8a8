#!/usr/bin/env bash
# KDA_RT_MLA_FUSED_COMBINE (prepared in the fifty-fourth session, never GPU-run): decode steps of up to 8 tokens merge
# the MLA attention's splits inside the output up-projection (mla_expand_out COMBINE_CG) instead of a separate
# mla_attn_combine launch (a batch-1 MLA layer's combine advanced the step ~3 us in the twenty-third session's trace:
# 7 layers, ~1% of the batch-1 step), in one device call:
#   1. the tests: tests/kernels/test_mla_attn.py -k fused_combine (bit for bit the two-launch form, within TOL of the
#      reference, no combine launched);
#   2. decode graph replays of the full 27-layer shape at batch 1 and 8, 0 against 1.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/mla_fused_combine_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests mla_fused_combine_tests 200 tests/kernels/test_mla_attn.py -k fused_combine
echo "== replays, bf16, KDA_RT_MLA_FUSED_COMBINE 0 / 1 ($SECONDS s)"
timeout $((590 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_MLA_FUSED_COMBINE --values 0,1 \
  --prompts 0 --replays 1,8 --rounds 3 2> "$OUT/mla_fused_combine_ab.err" | tee "$OUT/mla_fused_combine_ab.jsonl" \
  | grep summary
