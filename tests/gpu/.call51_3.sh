set -o pipefail
export OUT=${OUT:-/tmp/out}
export KDA_RT_CACHE_DIR=$HOME/.cache/kda_rt
PART=1 XDIST=4 timeout 300 bash tests/gpu/device_run.sh 2>&1 | tail -8
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
touch /tmp/st2
for q in bf16 fp8; do
  echo "== seed $q ($SECONDS s)"
  quant=""; [ $q = fp8 ] && quant="--quantization fp8"
  timeout $((585 - SECONDS)) python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights --router-bias-std 0.05 \
     --batch 32 --input-len 2048 --output-len 512 $quant --num-iters 1 2> $OUT/seed_$q.err | tail -3 | tee $OUT/seed_$q.json
done
python tests/gpu/kcache.py pack $KDA_RT_CACHE_DIR $OUT/kcache2.tar.xz /tmp/st2 $((15*1024*1024))
echo "done $SECONDS s"
