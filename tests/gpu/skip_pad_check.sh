#!/usr/bin/env bash
# KDA_RT_SKIP_PAD (prepared in the fifty-third session, GPU-run and the default 1 since the fifty-fourth; its level 2,
# the KDA decode kernel's padding CTAs writing zeros and leaving, the default since the fifty-fifth: 160 rows on the
# 256-row graph +4.2% -> +1.0% over the exact graph): decode graphs' padding rows get the slot -1
# and the KDA decode kernel stores no state for them (kernels_cu/kda_decode.cu SKIP_PAD), and the MoE plans the live
# rows' pairs alone (the live count in the metadata; kernels_cu/moe_bucket.cuh LIVE_PAIRS / LIVE_TOKENS), in one
# device call:
#   1. the tests: tests/kernels/test_kda_decode.py -k skip_pad (every state form: outputs and live slots bit for bit,
#      nothing else written), tests/kernels/test_moe_block.py and test_moe_bucket.py -k live_count (the live rows
#      bit for bit, padding rows zeros, exact plans of the live tokens, every bucketing path) and tests/gpu/test_cuda_model.py -k skip_their_state (the engine's tokens with
#      the switch on, the padding slot untouched) (a failure stops the script: nothing is timed);
#   2. what the padding rows cost with and without it: tests/gpu/graph_pad_check.py --batches 96,160 (each batch on its
#      own graph and on the next power of two's), KDA_RT_SKIP_PAD=2 then 1 (SKIP_PAD_VALUES="1 0" the fifty-fourth
#      session's comparison: 96 on 128 +4.0% -> -0.3%, 160 on 256 +14.7% -> +4.2%).  The fifty-third session measured the
#      padding at ~23 us a padding row a step (96 on 128 +5.6%, 160 on 256 +12.1%); the state stores alone are 2 MiB a
#      row a KDA layer, ~9.8 us a padding row a step at 4.3 TB/s, most of the rest the MoE's extra tiles (identical
#      padding rows all route to the same 8 experts).  With the switch on, the "experts" column counts the live
#      rows' experts alone (the padding rows' pairs are no longer planned).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/skip_pad_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests skip_pad_tests 330 tests/kernels/test_kda_decode.py tests/kernels/test_moe_block.py \
  tests/kernels/test_moe_bucket.py tests/gpu/test_cuda_model.py -k "skip_pad or skip_their_state or live_count"
run_values skip_pad KDA_RT_SKIP_PAD 420 "${SKIP_PAD_VALUES:-2 1}" \
  python tests/gpu/graph_pad_check.py --batches 96,160 --rounds 1  # (each line names its skip_pad)
