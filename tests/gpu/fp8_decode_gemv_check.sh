#!/usr/bin/env bash
# KDA_RT_FP8_DECODE_GEMV (prepared in the fifty-fourth session; the default 1 since the fifty-fifth, batch-1 replay
# 1.827 -> 1.638 ms): an fp8 model's one-sequence decode
# steps run the dense projections as e4m3 GEMVs (gemv_dense with scale=: KDA q|k|v|f_a|g_a|b and o_proj, MLA q|kv_a
# and o_proj, the dense layer's gate|up), half the bytes of the bf16 weights they read otherwise (on the 48B shape
# ~2.0 GB of bf16 rows a step, so ~1.0 GB less, ~0.23 ms at 4.3 TB/s: the fp8 batch-1 step is 1.86 ms), in one call:
#   1. the tests: tests/kernels/test_gemv_dense.py -k e4m3 (new: o_proj's K = 4096 and MAX_K_E4M3 = 5120) and
#      tests/gpu/test_cuda_model.py -k fp8_decode_gemv (the engine against the bf16 path on the e4m3 rows' values,
#      eager and in graphs; the GEMV counted in every decode step) (a failure stops the script: nothing is timed);
#   2. batch-1 decode graph replays of the full 27-layer shape in fp8 with the switch 1 and 0 (the rows are made at
#      upload, so the process starts with it 1 and bench_ab flips what the forward reads);
#   3. the engine's batch-1 run (`python -m kda_rt.bench`, one process a value) while the call's time lasts.
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/fp8_decode_gemv_check.sh
. tests/gpu/check_common.sh
echo "== tests"
gate_tests fp8_gemv_tests 300 tests/kernels/test_gemv_dense.py tests/gpu/test_cuda_model.py -k "e4m3 or fp8_decode_gemv" -s
echo "== batch-1 replays, fp8, KDA_RT_FP8_DECODE_GEMV 1 / 0 ($SECONDS s)"
KDA_RT_FP8_DECODE_GEMV=1 timeout $((560 - SECONDS)) python tests/gpu/bench_ab.py --quantization fp8 \
  --env KDA_RT_FP8_DECODE_GEMV --values 1,0 --prompts 0 --replays 1 --rounds 3 2> "$OUT/fp8_gemv_ab.err" \
  | tee "$OUT/fp8_gemv_ab.jsonl" | grep summary
echo "== bench, fp8, 1 x 2048 / 128"
run_values fp8_gemv_bench KDA_RT_FP8_DECODE_GEMV 470 "1 0" python -m kda_rt.bench --config kimi-linear-48b-a3b \
  --random-weights --router-bias-std 0.05 --quantization fp8 --batch 1 --input-len 2048 --output-len 128
