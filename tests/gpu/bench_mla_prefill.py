"""MLA prefill: absorbed (mla_attention) vs expanded (mla_prefill) path, H = 32, one layer.

    PYTHONPATH=. python tests/gpu/bench_mla_prefill.py

Per shape (chunked shapes run every chunk in order, each after the previous chunks' context) it
prints the warm CUDA-event time of the whole old and new calls (the new one includes its host
readback and planning), and, from a replay of the new path's rounds with events between launches,
the gather, the decompress GEMM and the attention kernel alone.  Attention FLOPs (causal):
2·H·(Dqk + Dv)·Σ_queries (keys attended) = 2·32·320·Σ (ctx + i + 1).  GEMM FLOPs: 2·keys·R·H·(Dn+Dv).
"""

from __future__ import annotations

import math
import time

import cupy
import numpy as np

from kda_rt.cuda.gemm import linear
from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.ops.mla_attn import mla_attention
from kda_rt.cuda.ops.mla_prefill import NUM_WARPS, _kernels, mla_prefill, plan_rounds

H, R, DN, DR, DV, S = 32, 512, 128, 64, 128, 64
SCALE = (DN + DR) ** -0.5
SHAPES = [("1x2048", 1, 2048, 2048), ("8x2048", 8, 2048, 2048), ("1x32768 chunks 2048", 1, 32768, 2048),
          ("1x32768 whole", 1, 32768, 32768), ("1x131072 chunks 8192", 1, 131072, 8192)]


def events_ms(fn, reps: int, warm: bool) -> float:
    if warm:
        fn()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / reps


def replay_rounds(q, pool, w_kvb, cu, ctx, tables, cu_h, ctx_h) -> tuple[float, float, float]:
    """(gather, GEMM, attention) ms of the new path's rounds, events between launches."""
    gather, attn, smem = _kernels(H, R, DN, DR, DV, S)
    rounds = plan_rounds(cu_h, ctx_h, list(range(len(ctx_h))), 65536)
    T, M = q.shape[0], tables.shape[1]
    rows = max(r.rows for r in rounds)
    lat, kv = cupy.empty((rows, R + DR), BF16), cupy.empty((rows, H * (DN + DV)), BF16)
    out = cupy.empty((T, H * DV), BF16)
    st_o, st_ml = cupy.empty((T, H, DV), np.float32), cupy.empty((T, H, 2), np.float32)
    ev = [cupy.cuda.Event() for _ in range(4)]
    total = [0.0, 0.0, 0.0]
    for rd in rounds:
        meta = cupy.asarray(np.concatenate([rd.seq_rec.ravel(), rd.row_start, rd.tiles.ravel()]))
        rec, rs, tl = meta, meta[rd.seq_rec.size:], meta[rd.seq_rec.size + len(ctx_h) + 1:]
        ev[0].record()
        gather(((rd.rows * 72 + 255) // 256,), (256,), (pool, tables, np.int32(M), rec, rs, np.int32(len(ctx_h)),
                                                        np.int32(rd.rows), lat))
        ev[1].record()
        linear(lat[:rd.rows, :R], w_kvb, out=kv[:rd.rows])
        ev[2].record()
        attn((len(rd.tiles), H), (NUM_WARPS * 32,), (q, np.int32(q.shape[1]), kv, lat, rec, tl,
                                                     np.float32(SCALE * math.log2(math.e)), out, np.int32(H * DV),
                                                     st_o, st_ml), shared_mem=smem)
        ev[3].record()
        ev[3].synchronize()
        for k in range(3):
            total[k] += cupy.cuda.get_elapsed_time(ev[k], ev[k + 1])
    return tuple(total)


def main() -> None:
    t_start = time.time()
    w_kvb = (cupy.random.standard_normal((H * (DN + DV), R), dtype=np.float32) / 23).astype(BF16)
    print(f"{'shape':<22} {'old ms':>9} {'new ms':>9} {'speedup':>7} | {'gather':>7} {'GEMM ms':>8} {'GEMM TF':>7} "
          f"{'attn ms':>8} {'attn TF/s':>9}")
    for name, B, L, chunk in SHAPES:
        pages = -(-L // S)
        pool = cupy.random.standard_normal((B * pages, S, R + DR), dtype=np.float32).astype(BF16)
        tables = cupy.arange(B * pages, dtype=np.int32).reshape(B, pages)
        q_all = cupy.random.standard_normal((B * chunk, H * (DN + DR)), dtype=np.float32).astype(BF16)
        old = new = gat = gemm = att = 0.0
        flops_attn = flops_gemm = 0
        for c0 in range(0, L, chunk):
            cu_h = (np.arange(B + 1) * chunk).astype(np.int32)
            ctx_h = np.full(B, c0, np.int32)
            cu, ctx = cupy.asarray(cu_h), cupy.asarray(ctx_h)
            args = (q_all, pool, w_kvb, cu, ctx, tables)
            reps = 3 if L <= 32768 and chunk == L else 1
            old += events_ms(lambda args=args, chunk=chunk: mla_attention(*args, num_heads=H, scale=SCALE, max_seqlen=chunk,
                                                   decode=False), reps, c0 == 0)
            new += events_ms(lambda args=args: mla_prefill(*args, num_heads=H, scale=SCALE), reps, c0 == 0)
            g, m, a = replay_rounds(q_all, pool, w_kvb, cu, ctx, tables, cu_h, ctx_h)
            gat, gemm, att = gat + g, gemm + m, att + a
            keys = np.arange(c0 + 1, c0 + chunk + 1, dtype=np.float64).sum()
            flops_attn += B * 2 * H * (DN + DR + DV) * keys
            flops_gemm += B * 2 * (c0 + chunk) * R * H * (DN + DV)
        print(f"{name:<22} {old:9.2f} {new:9.2f} {old / new:6.2f}x | {gat:7.2f} {gemm:8.2f} "
              f"{flops_gemm / gemm / 1e9:7.0f} {att:8.2f} {flops_attn / att / 1e9:9.0f}")
        del pool, q_all
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"wall {time.time() - t_start:.1f} s")


if __name__ == "__main__":
    main()
