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
Run from the repo root: PYTHONPATH=. python tests/gpu/bench_moe_route.py

    PYTHONPATH=. python tests/gpu/bench_moe_route.py --fused [--tokens 1,8,32,64]
A decode step's routing as moe_forward runs it: three launches (logits on the fp32 kernel below SPLIT_MIN_T,
else the split-router GEMM; select; moe_bucket with the shared slot) against moe_route_fused's one, each
captured plainly and with programmatic dependent launch; and whether ids, weights and plan agree."""

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


def fused(sizes=(1, 2, 4, 8, 16, 32, 64)):
    import cupy

    import kda_rt.cuda.ops.moe_route as mr
    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket

    rng = cupy.random.default_rng(0)
    w_router = (rng.standard_normal((E, D), dtype=np.float32) / np.sqrt(D)).astype(np.float32)
    bias = (rng.standard_normal(E, dtype=np.float32) * 0.1).astype(np.float32)
    w_split = mr.split_router(w_router)
    print(f"{'T':>4} {'3 launches us':>13} {'fused us':>9} {'3 launches pdl':>15} {'fused pdl':>10}  same   "
          "| fused cut after logits / count / select (plain)")
    for T in sizes:
        x = rng.standard_normal((T, D), dtype=np.float32).astype(BF16)
        N, bins = T * (A + 1), E + 1
        tiles = max_tiles(N, bins, 16)
        outs = []
        for _ in range(2):
            plan = MoEPlan(*(cupy.zeros(n, np.int32) for n in (bins + 1, N, N, tiles, tiles, 1)), 16)
            outs.append((plan, cupy.empty((T, A), np.int32), cupy.empty((T, A), np.float32),
                         cupy.empty((T, 3 * E), np.float32), cupy.zeros(1 + tiles, np.int32), cupy.zeros(64, np.int32),
                         cupy.zeros(2, np.int32)))

        def three(s, o=outs[0], x=x):
            plan, ids, w, logits, sync, _, stats = o
            mr.moe_route(x, w_router, bias, top_k=A, num_groups=1, topk_group=1, renormalize=True, scaling=2.446,
                         out_ids=ids, out_w=w, logits=logits, router_split=w_split, stream=s)
            moe_bucket(ids, E, plan, stats=stats, shared_slot=True, sync=sync, stream=s)

        def one(s, o=outs[1], x=x, phases=3):
            plan, ids, w, logits, sync, done, stats = o
            mr.moe_route_fused(x, w_router, bias, plan, top_k=A, renormalize=True, scaling=2.446, out_ids=ids,
                               out_w=w, logits=logits, done=done, stats=stats, shared_slot=True, sync=sync, stream=s,
                               phases=phases)

        cuts = [graph_us(lambda s, n=n: one(s, phases=n)) for n in (0, 1, 2)]
        times = [graph_us(three), graph_us(one)]
        with pdl.capturing(True):
            times += [graph_us(three), graph_us(one)]
        cupy.cuda.Device().synchronize()
        (p0, i0, w0, *_), (p1, i1, w1, *_) = outs
        same_ids = bool(cupy.array_equal(cupy.sort(i0, axis=1), cupy.sort(i1, axis=1)))
        rel = float(cupy.max(cupy.abs(cupy.sort(w0, axis=1) - cupy.sort(w1, axis=1)) / cupy.abs(w0).max()))
        same_plan = bool(cupy.array_equal(p0.expert_off, p1.expert_off) and cupy.array_equal(p0.num_tiles, p1.num_tiles))
        print(f"{T:>4} {times[0]:>13.2f} {times[1]:>9.2f} {times[2]:>15.2f} {times[3]:>10.2f}  ids {same_ids}, "
              f"w rel {rel:.1e}, expert_off/num_tiles {same_plan} | " + " / ".join(f"{c:.2f}" for c in cuts))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--fused", action="store_true")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    args = ap.parse_args()
    if args.fused:
        fused(tuple(int(t) for t in args.tokens.split(",")))
    else:
        main()
