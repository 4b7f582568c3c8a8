"""MLA prefill, expanded form, H = 32, one layer: the mma.sync attention (mla_prefill.cu, KDA_RT_WGMMA=0)
against the Hopper wgmma one (mla_prefill_wg.cu, the default on sm_90a).

    PYTHONPATH=. python tests/gpu/bench_mla_prefill.py [--shapes 1x2048,8x2048,...]
    PYTHONPATH=. python tests/gpu/bench_mla_prefill.py --fp8 [--shapes ...]   (bf16 wgmma against fp8=True)

Per shape (chunked shapes run every chunk in order, each after the previous chunks' context) it
prints the warm CUDA-event time of the whole mla_prefill call on each path (host readback and planning
included), and, from a replay of the rounds with events between launches, the gather, the decompress
GEMM(s) and the attention kernel alone, with the attention's TFLOP/s and the relative RMS difference
between the two paths' outputs (largest over the chunks).  Attention FLOPs (causal):
2·H·(Dqk + Dv)·Σ_queries (keys attended) = 2·32·320·Σ (ctx + i + 1).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time

import cupy
import numpy as np

from kda_rt.cuda.gemm import bmm, linear
from kda_rt.cuda.ops.check import BF16
from kda_rt.cuda.ops.mla_prefill import NUM_WARPS, WG_STAGES, _kernels, _wg_kernel, _wg_smem, mla_prefill, plan_rounds

H, R, DN, DR, DV, S = 32, 512, 128, 64, 128, 64
SCALE = (DN + DR) ** -0.5
SHAPES = {"1x2048": (1, 2048, 2048), "8x2048": (8, 2048, 2048), "1x32768-chunks-8192": (1, 32768, 8192),
          "1x32768-whole": (1, 32768, 32768), "1x131072-chunks-8192": (1, 131072, 8192),
          "1x32768-chunks-16384": (1, 32768, 16384), "1x131072-chunks-16384": (1, 131072, 16384)}


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


def replay_rounds(q, pool, w_kvb, tables, cu_h, ctx_h, wg: bool, stages: int = WG_STAGES, want_out: bool = False):
    """(gather, decompress, attention) ms of one call's rounds on one path, events between launches (and the
    output when want_out); `stages`: the wgmma kernel's pipeline stages."""
    gather, attn, smem = _kernels(H, R, DN, DR, DV, S)
    rounds = plan_rounds(cu_h, ctx_h, list(range(len(ctx_h))), 65536)
    T, M = q.shape[0], tables.shape[1]
    rows = max(r.rows for r in rounds)
    lat = cupy.empty((rows, R + DR), BF16)
    kv = cupy.empty((rows, H * (DN + DV)), BF16)
    kn, vt = cupy.empty((H, rows, DN), BF16), cupy.empty((H, DV, rows), BF16)
    w3 = w_kvb.reshape(H, DN + DV, R)
    out = cupy.empty((T, H * DV), BF16)
    st_o, st_ml = cupy.empty((T, H, DV), np.float32), cupy.empty((T, H, 2), np.float32)
    ev = [cupy.cuda.Event() for _ in range(4)]
    total = [0.0, 0.0, 0.0]
    scale_log2 = np.float32(SCALE * math.log2(math.e))
    for rd in rounds:
        meta = cupy.asarray(np.concatenate([rd.seq_rec.ravel(), rd.row_start, rd.tiles.ravel()]))
        rec, rs, tl = meta, meta[rd.seq_rec.size:], meta[rd.seq_rec.size + len(ctx_h) + 1:]
        ev[0].record()
        gather(((rd.rows * 72 + 255) // 256,), (256,), (pool, tables, np.int32(M), rec, rs, np.int32(len(ctx_h)),
                                                        np.int32(rd.rows), lat))
        ev[1].record()
        if wg:
            c = cupy.broadcast_to(lat[None, :rd.rows, :R], (H, rd.rows, R))
            bmm(c, w3[:, :DN], out=kn[:, :rd.rows], transpose_b=True)
            bmm(w3[:, DN:], c, out=vt[:, :, :rd.rows], transpose_b=True)
        else:
            linear(lat[:rd.rows, :R], w_kvb, out=kv[:rd.rows])
        ev[2].record()
        if wg:
            _wg_kernel(H, R, DN, DR, DV, stages)((len(rd.tiles), H), (256,), (
                q, np.int32(q.shape[1]), kn, vt, lat, np.int32(rows), rec, tl, scale_log2, out, np.int32(H * DV),
                st_o, st_ml), shared_mem=_wg_smem(DN, DR, stages))
        else:
            attn((len(rd.tiles), H), (NUM_WARPS * 32,), (q, np.int32(q.shape[1]), kv, lat, rec, tl, scale_log2, out,
                                                         np.int32(H * DV), st_o, st_ml), shared_mem=smem)
        ev[3].record()
        ev[3].synchronize()
        for k in range(3):
            total[k] += cupy.cuda.get_elapsed_time(ev[k], ev[k + 1])
    return (*total, out) if want_out else tuple(total)


def shape_inputs(name: str):
    """(B, L, chunk, pool, tables, q_all) of a SHAPES entry: a random latent cache of B sequences of L
    positions in pages of S, identity block tables, random queries of one chunk."""
    B, L, chunk = SHAPES[name]
    pages = -(-L // S)
    pool = cupy.random.standard_normal((B * pages, S, R + DR), dtype=np.float32).astype(BF16)
    tables = cupy.arange(B * pages, dtype=np.int32).reshape(B, pages)
    q_all = cupy.random.standard_normal((B * chunk, H * (DN + DR)), dtype=np.float32).astype(BF16)
    return B, L, chunk, pool, tables, q_all


def random_w_kvb():
    return (cupy.random.standard_normal((H * (DN + DV), R), dtype=np.float32) / 23).astype(BF16)


def chunk_flops(B: int, c0: int, chunk: int) -> float:
    """Causal attention FLOPs of B sequences' queries c0 .. c0 + chunk - 1 (after c0 cached positions)."""
    return B * 2 * H * (DN + DR + DV) * np.arange(c0 + 1, c0 + chunk + 1, dtype=np.float64).sum()


def bench_variants(name: str, variants: list[int], rounds: int = 3) -> None:
    """The wgmma attention kernel built with each number of pipeline stages, interleaved over `rounds` rounds
    after a warm-up one (the GPU's clock drifts as it heats): attention ms and TFLOP/s of each, and whether the
    outputs are bit-identical."""
    B, L, chunk, pool, tables, q_all = shape_inputs(name)
    w_kvb = random_w_kvb()
    times = {v: [] for v in variants}
    same, flops = True, 0.0
    for c0 in range(0, L, chunk):
        cu_h, ctx_h = (np.arange(B + 1) * chunk).astype(np.int32), np.full(B, c0, np.int32)
        flops += chunk_flops(B, c0, chunk)
        ref = None
        for v in variants:
            times[v].append(0.0)
        for r in range(rounds + 1):
            for v in variants:
                *t, out = replay_rounds(q_all, pool, w_kvb, tables, cu_h, ctx_h, True, v, want_out=True)
                if r > 0:  # round 0 warms up (and builds) every variant
                    times[v][-1] += t[2] / rounds
                if ref is None:
                    ref = out.copy()
                else:
                    same = same and bool(cupy.array_equal(ref, out))
    base = sum(times[variants[0]])
    print(f"{name}: " + "  ".join(f"stages={v} {sum(ts):.2f} ms {flops / sum(ts) / 1e9:.0f} TF/s "
                                  f"({sum(ts) / base - 1:+.1%})" for v, ts in times.items())
          + f"  outputs bit-identical: {same}", flush=True)


def bench_fp8(names: list[str], rounds: int = 3) -> None:
    """The whole mla_prefill call (every chunk in order) with the bf16 wgmma attention and with fp8=True (its
    quantization passes included), interleaved over `rounds` rounds after a warm-up call: ms, the causal attention's
    TFLOP/s at that time, and the relative RMS difference of the outputs (largest over the chunks)."""
    w_kvb = random_w_kvb()
    print(f"{'shape':<24} {'bf16 ms':>8} {'TF/s':>5} {'fp8 ms':>8} {'TF/s':>5} {'speedup':>7} | rel RMS diff")
    for name in names:
        B, L, chunk, pool, tables, q_all = shape_inputs(name)
        t = {False: 0.0, True: 0.0}
        flops, diff = 0.0, 0.0
        for c0 in range(0, L, chunk):
            cu, ctx = cupy.asarray((np.arange(B + 1) * chunk).astype(np.int32)), cupy.asarray(np.full(B, c0, np.int32))
            flops += chunk_flops(B, c0, chunk)
            outs = {}
            for fp8 in (False, True):  # warm-up (and build)
                outs[fp8] = mla_prefill(q_all, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE, fp8=fp8)
            a, b = outs[False].astype(np.float32), outs[True].astype(np.float32)
            diff = max(diff, float(cupy.sqrt(cupy.mean((a - b) ** 2) / cupy.mean(a ** 2))))
            for r in range(rounds):
                for fp8 in ((False, True) if r % 2 == 0 else (True, False)):
                    call = functools.partial(mla_prefill, q_all, pool, w_kvb, cu, ctx, tables, num_heads=H, scale=SCALE,
                                             fp8=fp8)
                    t[fp8] += events_ms(call, 1, False) / rounds
        print(f"{name:<24} {t[False]:8.2f} {flops / t[False] / 1e9:5.0f} {t[True]:8.2f} {flops / t[True] / 1e9:5.0f} "
              f"{t[False] / t[True]:6.2f}x | {diff:.3g}", flush=True)
        del pool, q_all
        cupy.get_default_memory_pool().free_all_blocks()


def on_path(wg: bool, fn):
    os.environ["KDA_RT_WGMMA"] = "1" if wg else "0"
    try:
        return fn()
    finally:
        os.environ.pop("KDA_RT_WGMMA", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="", help="e.g. 3,4: only the wgmma attention built with each number "
                                                   "of stages, interleaved rounds")
    ap.add_argument("--fp8", action="store_true", help="the bf16 wgmma attention against fp8=True (whole calls)")
    args = ap.parse_args()
    t_start = time.time()
    if args.fp8:
        bench_fp8(args.shapes.split(","))
        print(f"wall {time.time() - t_start:.1f} s")
        return
    if args.variants:
        variants = [int(v) for v in args.variants.split(",")]
        for name in args.shapes.split(","):
            bench_variants(name, variants)
            cupy.get_default_memory_pool().free_all_blocks()
        print(f"wall {time.time() - t_start:.1f} s")
        return
    w_kvb = random_w_kvb()
    print(f"{'shape':<22} {'mma ms':>8} {'wg ms':>8} {'speedup':>7} | {'attn mma':>8} {'TF/s':>5} {'attn wg':>8} "
          f"{'TF/s':>5} | {'gather':>6} {'dec mma':>7} {'dec wg':>7} | rel RMS diff")
    for name in args.shapes.split(","):
        B, L, chunk, pool, tables, q_all = shape_inputs(name)
        whole = [0.0, 0.0]
        parts = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
        flops_attn, diff = 0, 0.0
        for c0 in range(0, L, chunk):
            cu_h = (np.arange(B + 1) * chunk).astype(np.int32)
            ctx_h = np.full(B, c0, np.int32)
            cu, ctx = cupy.asarray(cu_h), cupy.asarray(ctx_h)
            call = (q_all, pool, w_kvb, cu, ctx, tables)
            reps = 3 if L <= 32768 and chunk == L else 1
            outs = []
            for k, wg in enumerate((False, True)):
                whole[k] += on_path(wg, lambda call=call, reps=reps, c0=c0: events_ms(
                    lambda: mla_prefill(*call, num_heads=H, scale=SCALE), reps, c0 == 0))
                outs.append(on_path(wg, lambda call=call: mla_prefill(*call, num_heads=H, scale=SCALE)))
                got = replay_rounds(q_all, pool, w_kvb, tables, cu_h, ctx_h, wg)
                parts[k] = [a + b for a, b in zip(parts[k], got, strict=True)]
            a, b = outs[0].astype(np.float32), outs[1].astype(np.float32)
            diff = max(diff, float(cupy.sqrt(cupy.mean((a - b) ** 2) / cupy.mean(a ** 2))))
            flops_attn += chunk_flops(B, c0, chunk)
        (_, dm, am), (gw, dw, aw) = parts
        print(f"{name:<22} {whole[0]:8.2f} {whole[1]:8.2f} {whole[0] / whole[1]:6.2f}x | {am:8.2f} "
              f"{flops_attn / am / 1e9:5.0f} {aw:8.2f} {flops_attn / aw / 1e9:5.0f} | {gw:6.2f} {dm:7.2f} {dw:7.2f} | "
              f"{diff:.3g}", flush=True)
        del pool, q_all
        cupy.get_default_memory_pool().free_all_blocks()
    print(f"wall {time.time() - t_start:.1f} s")


if __name__ == "__main__":
    main()
