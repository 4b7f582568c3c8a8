set -o pipefail
export OUT=${OUT:-/tmp/out}
pip install -q --no-build-isolation --no-deps -e . > /dev/null 2>&1
export PYTHONPATH=$PWD KDA_RT_CACHE_DIR=$HOME/.cache/kda_rt PYTHONUNBUFFERED=1
python tests/gpu/kcache.py unpack .kcache/kcache.tar.xz $KDA_RT_CACHE_DIR; touch -d '2020-01-01' /tmp/st
echo "== kda tests ($SECONDS s)"
timeout 200 python -m pytest -q tests/kernels/test_kda_decode.py -k "smem_state or pdl_writer" -p no:cacheprovider --tb=short 2>&1 | grep -vE "^\s*$" | tail -60 | tee $OUT/kda_tests.txt
! grep -q "differs from the register\|CUDADriverError\|CUDARuntimeError\|CompileException\|illegal" $OUT/kda_tests.txt || { echo "tests failed: nothing timed"; python tests/gpu/kcache.py pack $KDA_RT_CACHE_DIR $OUT/kcache.tar.xz /tmp/st $((15*1024*1024)); exit 1; }
echo "== kda sweep ($SECONDS s)"
timeout 120 python tests/gpu/bench_decode_sweep.py --parts=kda --kda-batches=8,32,64,128,256 --kda-define=KDA_RT_KDA_SMEM_STATE=0,1 2>&1 | grep -E "kda_decode|rror" | tee $OUT/kda_sweep.txt
echo "== model A/B ($SECONDS s)"
timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py --env KDA_RT_KDA_SMEM_STATE,KDA_RT_MOE_FUSED32 --values 0:0,1:0,0:1 --prompts 0 \
    --replays 32,128,192,256 --rounds 2 2> "$OUT/ab.err" | tee "$OUT/ab.jsonl" | grep -E "summary|replay"
python tests/gpu/kcache.py pack $KDA_RT_CACHE_DIR $OUT/kcache.tar.xz /tmp/st $((15*1024*1024))
echo "done $SECONDS s"
