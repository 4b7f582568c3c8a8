#!/usr/bin/env bash
# The engine at an older revision against the working tree, one bench workload each, on one machine (a card's own
# variance kept out of the comparison).  Prepare the old tree here first, then carry ".ab":
#   mkdir -p .ab/old && git archive REV kda_rt kernels_cu loader sampler setup.cfg setup.py pyproject.toml README.md LICENSE \
#     | tar -x -C .ab/old
#   (README.md, LICENSE, setup.py: the install needs them.  The sixty-third session's "old" run was the new tree again:
#   the install failed silently without them, and `python -m` from the repository root imports ./kda_rt whatever is
#   installed; each run now starts in its own tree and checks which kda_rt and kda_rt.loader it imports)
#   (.ab git-ignored: echo .ab/ >> .git/info/exclude)
# On the device (repository root):  bash tests/gpu/rev_ab.sh     (B, IN, OUTLEN, QUANT, T, ORDER override the defaults:
# the fp8 serving workload 256 x 8192 / 1024, each run under T=200 s, old first; ALSO=B:IN:OUT,... adds workloads to
# each run, bench's --also)
# Each run installs its tree (editable, the image's CuPy) and prints the bench's elapsed, TTFT max, decode step,
# steps, preemptions, padding and experts; the logs land in $OUT/ab_{old,new}.err.
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader
for which in ${ORDER:-old new}; do
  if [ "$which" = old ]; then src=.ab/old; else src=.; fi
  if ! pip install -q --no-build-isolation --no-deps -e "$src" > "$OUT/ab_${which}_install.log" 2>&1; then
    echo "rev_ab.sh: installing $src failed ($OUT/ab_${which}_install.log):"; tail -5 "$OUT/ab_${which}_install.log"; exit 1
  fi
  got=$(cd "$src" && python -c "import kda_rt.loader as m, os; print(os.path.realpath(os.path.dirname(m.__file__)))")
  if [ "$got" != "$(realpath "$src/loader")" ]; then
    echo "rev_ab.sh: $which imports kda_rt.loader from $got, not $src/loader"; exit 1
  fi
  (cd "$src" && timeout "${T:-200}" python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights --router-bias-std 0.05 \
    ${QUANT:---quantization fp8} --batch "${B:-256}" --input-len "${IN:-8192}" --output-len "${OUTLEN:-1024}" \
    ${ALSO:+--also "$ALSO"} \
    2>"$OUT/ab_$which.err") | python -c "
import json, sys
keys = ('elapsed_s', 'ttft_s_max', 'decode_step_s_mean', 'num_steps', 'num_decode_steps', 'preemptions',
        'decode_graph_padding', 'experts_per_moe_layer', 'output_tok_s', 'steps_launched_ahead')
for line in sys.stdin:
    d = json.loads(line)
    print('$which', {k: round(d[k], 5) if isinstance(d[k], float) else d[k] for k in keys if k in d})"
done
