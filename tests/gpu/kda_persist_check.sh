#!/usr/bin/env bash
# The KDA decode kernel's persistent form (kernels_cu/kda_decode.cu SMEM_STATE = 3, KDA_RT_KDA_SMEM_STATE=3; issue
# 12's KDA row: >= 3.6 TB/s from batch 64) in one device call:
#   1. tests/kernels/test_kda_decode.py -k "smem_state or skip_pad or pdl_writer": form 3 bit for bit the register
#      form (one CTA an SM, and 3 / 5 CTAs that each walk many heads), eager and in a captured PDL graph, padding rows
#      among the heads (a wrong result stops the script: nothing is timed);
#   2. the kernel alone, forms 0 / 1 / 3 (bench_decode_sweep.py --kda-define=KDA_RT_KDA_SMEM_STATE=0,1,3, three
#      interleaved rounds), then form 3 with and without the next head's conv history prefetched (PERSIST_PREFETCH);
#   3. (MODEL=1) the full 27-layer model's decode graph replays (bench_ab.py --replays, 2K context), forms 1 and 3.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   [MODEL=1] bash tests/gpu/kda_persist_check.sh
. tests/gpu/check_common.sh
export PYTHONPATH=$PYTHONPATH:$PWD/tests
echo "== tests"
gate_tests kda_persist_tests 240 tests/kernels/test_kda_decode.py -k "smem_state or skip_pad or pdl_writer" -n 4 --tb=short
echo "== the kernel alone ($SECONDS s)"
timeout 200 python tests/gpu/bench_decode_sweep.py --parts=kda --kda-batches=32,64,128,256 \
  --kda-define=KDA_RT_KDA_SMEM_STATE=0,1,3 2>&1 | grep -E "kda_decode|rror" | tee "$OUT/kda_persist_sweep.txt"
echo "== form 3, the next head's history prefetched ($SECONDS s)"
KDA_RT_KDA_SMEM_STATE=3 timeout 120 python tests/gpu/bench_decode_sweep.py --parts=kda --kda-batches=32,64,128 \
  --kda-define=PERSIST_PREFETCH=0,1 2>&1 | grep -E "kda_decode|rror" | tee "$OUT/kda_persist_prefetch.txt"
if [ "${MODEL:-0}" = 1 ]; then
  echo "== decode replays ($SECONDS s)"
  timeout $((580 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_KDA_SMEM_STATE --values 1,3 --prompts 0 \
    --replays 32,64,128,256 --rounds 2 2> "$OUT/kda_persist_ab.err" | tee "$OUT/kda_persist_ab.jsonl" | grep summary
fi
