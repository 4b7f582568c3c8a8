"""Micro-bench of the MoE routing / combine kernels (issue 12): CUDA-graph replay time per call
(tests/helpers/gpu.py graph_us) at the Kimi-Linear-48B shape, D = 2304, E = 256, A = 8, 1 group.

    route fp32:  moe_route_logits (fp32 CUDA cores) + moe_route_select
    route split: one cuBLAS bf16 GEMM on the router split in three exact bf16 parts ([T, 3E] fp32 partial
                 logits) + moe_route_select adding them (moe_route's path from SPLIT_MIN_T tokens)
    select rank / warp: the two select kernels alone on the split logits (one thread per expert with rank
                 counting / one warp per token), and whether their ids and weights are bit-identical
    bucket:      moe_bucket with the shared expert in the stacks (A + 1 pairs a token)
    combine:     moe_combine, shared expert row in y (ncu before the change: 7.5 us at T = 1)

Bytes floors: the router is E·D·4 = 2.4 MB (0.5 us at 4.8 TB/s); combine reads T·(A+1)·D·2 bytes (bf16 y).
Run from the repo root: PYTHONPATH=. python tests/gpu/bench_moe_route.py"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.gpu import graph_us  # noqa: E402

D, E, A = 2304, 256, 8


def main(sizes=(1, 8, 32, 64, 128, 256, 512, 2048, 8192)):
    import cupy

    import kda_rt.cuda.ops.moe_route as mr
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.check import BF16, f32, i32
    from kda_rt.cuda.ops.compile import get_kernel
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket, moe_combine

    rng = cupy.random.default_rng(0)
    w_router = (rng.standard_normal((E, D), dtype=np.float32) / np.sqrt(D)).astype(np.float32)
    bias = (rng.standard_normal(E, dtype=np.float32) * 0.1).astype(np.float32)
    w_split = mr.split_router(w_router)
    print(f"{'T':>6} {'route fp32 us':>13} {'route split us':>14} {'bucket us':>10} {'combine us':>11} "
          f"{'select rank us':>14} {'select warp us':>14}")
    for T in sizes:
        x = rng.standard_normal((T, D), dtype=np.float32).astype(BF16)
        ids, w = cupy.empty((T, A), np.int32), cupy.empty((T, A), np.float32)
        scratch = cupy.empty((T, 3 * E), np.float32)
        logits = scratch.reshape(-1)[: T * E]
        tpb = mr.logits_tokens_per_block(T, D)  # the launcher's choice
        k_logits = get_kernel("moe_route.cu", "moe_route_logits", D=D, E=E, TPB=tpb, WARPS=8)
        k_select = get_kernel("moe_route.cu", "moe_route_select", E=E, THREADS=E, MAX_TOP_K=mr.MAX_TOP_K, PARTS=1)
        k_select3 = get_kernel("moe_route.cu", "moe_route_select", E=E, THREADS=E, MAX_TOP_K=mr.MAX_TOP_K, PARTS=3)
        flags = (i32(T), i32(A), i32(1), i32(1), i32(1), i32(0), f32(2.446))

        def old(stream, T=T, x=x, logits=logits, ids=ids, w=w, k_logits=k_logits, k_select=k_select, flags=flags, tpb=tpb):
            k_logits((-(-T // tpb), E // 8), (256,), (x, w_router, logits, i32(T)), stream=stream)
            k_select((T,), (E,), (logits, bias, ids, w, *flags), stream=stream)

        def new(stream, T=T, x=x, ids=ids, w=w, scratch=scratch, k_select3=k_select3, flags=flags):
            with stream:
                linear(x, w_split, out=scratch)
            k_select3((T,), (E,), (scratch, bias, ids, w, *flags), stream=stream)

        old_us, new_us = graph_us(old), graph_us(new)
        old(cupy.cuda.get_current_stream())
        ids_old = cupy.asnumpy(ids)
        new(cupy.cuda.get_current_stream())
        same = np.array_equal(np.sort(ids_old, -1), np.sort(cupy.asnumpy(ids), -1))
        N, bins = T * (A + 1), E + 1
        tiles = max_tiles(N, bins, 16)
        plan = MoEPlan(cupy.empty(bins + 1, np.int32), cupy.empty(N, np.int32), cupy.empty(N, np.int32),
                       cupy.empty(tiles, np.int32), cupy.empty(tiles, np.int32), cupy.empty(1, np.int32), 16)
        bucket_us = graph_us(lambda s, ids=ids, plan=plan: moe_bucket(ids, E, plan, shared_slot=True, stream=s))
        y = rng.standard_normal((N, D), dtype=np.float32).astype(BF16)
        out = cupy.empty((T, D), BF16)
        combine_us = graph_us(lambda s, y=y, plan=plan, w=w, out=out:
                              moe_combine(y, plan.pair_pos, w, shared_in_y=True, out=out, stream=s))
        k_warp = get_kernel("moe_route.cu", "moe_route_select_warp", E=E, SEL_WARPS=mr._SEL_WARPS,
                            MAX_TOP_K=mr.MAX_TOP_K, PARTS=3)
        warp_flags = (i32(T), i32(A), i32(1), i32(0), f32(2.446))
        ids2, w2 = cupy.empty_like(ids), cupy.empty_like(w)
        rank_us = graph_us(lambda s, T=T, scratch=scratch, ids=ids, w=w, k=k_select3, flags=flags:
                           k((T,), (E,), (scratch, bias, ids, w, *flags), stream=s))
        warp_us = graph_us(lambda s, T=T, scratch=scratch, ids2=ids2, w2=w2, k=k_warp, flags=warp_flags:
                           k((-(-T // mr._SEL_WARPS),), (32 * mr._SEL_WARPS,), (scratch, bias, ids2, w2, *flags),
                             stream=s))
        cupy.cuda.Device().synchronize()
        exact = bool(cupy.array_equal(ids, ids2) and cupy.array_equal(w.view(np.uint32), w2.view(np.uint32)))
        print(f"{T:>6} {old_us:>13.2f} {new_us:>13.2f} {bucket_us:>10.2f} {combine_us:>11.2f} {rank_us:>14.2f} "
              f"{warp_us:>14.2f}   ids fp32 == split: {same}   warp == rank bitwise: {exact}   "
              f"combine {N * D * 2 / combine_us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
