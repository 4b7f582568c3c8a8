#!/usr/bin/env bash
# The KDA decode kernel's shared-memory state forms (kernels_cu/kda_decode.cu SMEM_STATE, issue 12) in one device call:
#   1. tests/kernels/test_kda_decode.py -k "smem_state or pdl_writer": SMEM_STATE 1 (bulk loads, the default from 32
#      sequences) and 2 (bulk stores too; prepared in the fifty-first session, never run) bit for bit the register
#      form, eager and in a captured PDL graph (a wrong result stops the script: nothing is timed);
#   2. the kernel alone, forms 0 / 1 / 2 (bench_decode_sweep.py --kda-define=KDA_RT_KDA_SMEM_STATE=0,1,2);
#   3. the full 27-layer model's decode graph replays (bench_ab.py --replays, 2K context), KDA_RT_KDA_SMEM_STATE 1, 2
#      and 0 at batch 16 (where the default is the register form: does form 1 pay below 32?), 32, 64 and 256.
# Fifty-first session (H200): the kernel alone 0 -> 1 at B = 32 42.0 -> 45.7 us, 256 304.7 -> 290.1 us; the model's
# replays 0 -> 1 at batch 32 8.690 -> 8.666 ms, 256 22.254 -> 21.873 ms.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/kda_smem_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests kda_smem_tests 200 tests/kernels/test_kda_decode.py -k "smem_state or pdl_writer" --tb=short
echo "== the kernel alone ($SECONDS s)"
timeout 150 python tests/gpu/bench_decode_sweep.py --parts=kda --kda-batches=16,32,64,128,256 \
  --kda-define=KDA_RT_KDA_SMEM_STATE=0,1,2 2>&1 | grep -E "kda_decode|rror" | tee "$OUT/kda_smem_sweep.txt"
echo "== decode replays ($SECONDS s)"
timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_KDA_SMEM_STATE --values 1,2,0 --prompts 0 \
  --replays 16,32,64,256 --rounds 2 2> "$OUT/kda_smem_ab.err" | tee "$OUT/kda_smem_ab.jsonl" | grep summary
