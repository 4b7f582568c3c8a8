#!/usr/bin/env bash
# Penalised requests on the full 27-layer shape with KDA_RT_GPU_SAMPLING_EXTRAS 0 / 1 (read at start: one process each):
# 0 samples every penalised row on the host from its copied-back logits (the NumPy reference sampler), 1 on the GPU
# from the runner's per-sequence token counts (sampler/penalties.py, fifty-sixth session).  32 prompts of 512 tokens,
# 16 output tokens each, temperature 0.8, top_p 0.95, frequency_penalty 0.5: the decode step time is the number
# to compare (engine56_check.sh's tests check the tokens).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/gpu_penalties_bench.sh
. tests/gpu/check_common.sh
run_values gpu_penalties KDA_RT_GPU_SAMPLING_EXTRAS 420 "1 0" \
  python -m kda_rt.bench --config kimi-linear-48b-a3b --random-weights --router-bias-std 0.05 --batch 32 \
  --input-len 512 --output-len 16 --sampling temperature=0.8,top_p=0.95,frequency_penalty=0.5
python - "$OUT/gpu_penalties.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"KDA_RT_GPU_SAMPLING_EXTRAS={r['env'].get('KDA_RT_GPU_SAMPLING_EXTRAS')}: decode step {r['decode_step_s_mean'] * 1e3:.2f} ms, "
          f"TTFT max {r['ttft_s_max']:.3f} s, elapsed {r['elapsed_s']:.2f} s")
PY
