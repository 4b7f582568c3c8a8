#!/usr/bin/env bash
# Why KDA_RT_ASYNC_PREFILL=1 made the seed prefill's TTFT max longer (fifty-eighth session: bf16 0.850 s against
# 0.812, fp8 0.670 against 0.609, though it removes the host gaps between the steps), in one call: the whole seed
# prefill (32 x 2048, 16384-token steps, the full 27-layer shape in bf16) traced once per value (CUPTI through
# torch.profiler, a device tool only): TTFT max, the host's time in each launch / collect / schedule / build_batch /
# postprocess call, the GPU's busy time, span and idle gaps, and the host's CUDA API calls by total time (a
# cudaFree, cudaMalloc or synchronize that the step launched ahead meets shows here).
# Run from the repository root on the GPU machine (the project installed as the device README says); logs in $OUT.
#   bash tests/gpu/async_prefill_trace.sh
. tests/gpu/check_common.sh
timeout 560 python tests/gpu/trace_decode.py --batches '' --prefill 32x2048 --step-tokens 16384 \
  --env KDA_RT_ASYNC_PREFILL --values 1,0,1,0 2> "$OUT/async_prefill_trace.err" | tee "$OUT/async_prefill_trace.jsonl" \
  | python -c "
import json, sys
for line in sys.stdin:
    d = json.loads(line)
    print('KDA_RT_ASYNC_PREFILL=%s: TTFT max %.4f s, busy %.1f ms, span %.1f ms, idle %.1f ms' % (
        d.get('KDA_RT_ASYNC_PREFILL'), d['ttft_s_max'], d['busy_ms'], d['span_ms'], d['idle_ms']))
    print('  host ms:', {k: v for k, v in d['host_ms'].items()})
    print('  host API:', d.get('host_api', [])[:8])
    print('  largest gaps:', d['largest_gaps'][:5])"
