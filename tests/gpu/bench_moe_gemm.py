"""Prefill MoE grouped GEMMs on the Kimi-Linear-48B shape (E=256, top-8, D=2304, I=1024), random
routing: the decode kernel (moe_gemm.cu) against the prefill kernel (moe_gemm_tc.cu) per GEMM, the
whole moe_forward (route, bucket, both GEMMs, shared expert, combine) on each path, and cuBLAS on one
dense GEMM of the same size as the ceiling.

    FLOPs = 2 · N · K · NOUT over the N = T·A rows computed
            gate/up: K = D, NOUT = 2I (h = SiLU(gate)·up fused);  down: K = I, NOUT = D (fp32 out)
    % of peak against 790 TFLOP/s (bf16 dense, H200: cuBLAS 8192³ on random data, KINDS.md)

Times: CUDA events around each call, 3 warm-ups, median of 20.  `--sweep` also times every tile of
TILES (tests/helpers/moe_gemm.py) on each T (and checks it against the decode kernel) to choose the launcher's tiles.
Run: python tests/gpu/bench_moe_gemm.py [--sweep] [--tokens 2048,8192]
Letters: T tokens, A active experts, E experts, N = T·A rows, D hidden, I expert width."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

PEAK = 790e12
E, A, D, INTER = 256, 8, 2304, 1024




def gpu_f32(a):
    """fp32 copy on the GPU (bf16 widened bit-exactly through uint16 -> uint32 << 16)."""
    import cupy

    if a.dtype == np.float32:
        return a
    return (a.view(cupy.uint16).astype(cupy.uint32) << 16).view(cupy.float32)


def gpu_rms_rel(a, b) -> float:
    import cupy

    a, b = gpu_f32(a), gpu_f32(b)
    return float(cupy.sqrt(cupy.mean((a - b) ** 2) / cupy.mean(b**2)))


def line(name, ms, flops, extra=""):
    tf = flops / ms / 1e9
    print(f"  {name:44s} {ms:8.3f} ms {tf:7.1f} TFLOP/s {100 * tf * 1e12 / PEAK:5.1f}%  {extra}", flush=True)


def bench_step(T, wts, cfg, sweep):
    """Every timing of one step of T tokens (uniform random routing)."""
    import cupy

    from helpers.gpu import median_ms, rand_bf16, rms_rel, to_np
    from helpers.moe_gemm import TILES, make_ids, make_plan
    from kda_rt.cuda import moe as moe_mod
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.moe import moe_forward, moe_workspace_bytes
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm import moe_gemm, tile_rows_for
    from kda_rt.cuda.ops.moe_gemm_tc import TileConfig, moe_gemm_tc, prefill_tile_rows, tile_config

    w13, w2 = wts.w13, wts.w2
    N = T * A
    f13, f2 = 2 * N * D * 2 * INTER, 2 * N * INTER * D
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    ids = make_ids(T, E, A, False, hrng)
    counts = np.bincount(ids.ravel(), minlength=E)
    print(f"T={T} N={N}: rows/expert avg {N / E:.0f}, min {counts.min()}, max {counts.max()}; "
          f"launcher BM={prefill_tile_rows(N, E, D, INTER)}", flush=True)

    plan_old = make_plan(ids, E, tile_rows_for(N, E))
    h_old, y_old = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    ms = median_ms(partial(moe_gemm, x, w13, plan_old, top_k=A, fuse_silu=True, out=h_old))
    line(f"old gate/up [{N},{D}]x[{2 * INTER},{D}]", ms, f13)
    ms = median_ms(partial(moe_gemm, h_old, w2, plan_old, top_k=A, fuse_silu=False, out=y_old))
    line(f"old down    [{N},{INTER}]x[{D},{INTER}]", ms, f2)
    h_ref, y_ref = h_old[plan_old.pair_pos], y_old[plan_old.pair_pos]

    h, y = cupy.empty_like(h_old), cupy.empty_like(y_old)
    tiles = [TileConfig(*t) for t in TILES] if sweep else []
    for bm in (64, 128):
        plan = make_plan(ids, E, bm)
        default = (tile_config(bm, 2 * INTER, D, True), tile_config(bm, D, INTER, False))
        for t13, t2 in [default] + [(t, t) for t in tiles if t.bm == bm and t not in default]:
            try:
                ms13 = median_ms(partial(moe_gemm_tc, x, w13, plan, top_k=A, fuse_silu=True, out=h, tile=t13))
                ms2 = median_ms(partial(moe_gemm_tc, h, w2, plan, top_k=A, fuse_silu=False, out=y, tile=t2))
            except Exception as exc:  # a sweep tile that does not build or launch: report, go on
                print(f"  tile {t13}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                continue
            e13, e2 = gpu_rms_rel(h[plan.pair_pos], h_ref), gpu_rms_rel(y[plan.pair_pos], y_ref)
            tag = "default" if (t13, t2) == default else tuple(t13)[1:]
            line(f"new gate/up bm={bm} {tag}", ms13, f13, f"err vs old {e13:.1e}")
            line(f"new down    bm={bm} {tag}", ms2, f2, f"err vs old {e2:.1e}")

    # wgmma (sm_90a) on 128-row tiles: each (BN, stages) candidate
    from kda_rt.cuda.ops.compile import device_arch
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg

    if device_arch() == "sm_90a":
        plan = make_plan(ids, E, 128)
        for t in (WgTile(256, 4), WgTile(256, 3), WgTile(128, 4), WgTile(128, 3)):
            try:
                ms13 = median_ms(partial(moe_gemm_wg, x, w13, plan, top_k=A, fuse_silu=True, out=h, tile=t))
                ms2 = median_ms(partial(moe_gemm_wg, h, w2, plan, top_k=A, fuse_silu=False, out=y, tile=t))
            except Exception as exc:  # a tile that does not build or launch: report, go on
                print(f"  wg tile {t}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            e13, e2 = gpu_rms_rel(h[plan.pair_pos], h_ref), gpu_rms_rel(y[plan.pair_pos], y_ref)
            line(f"wgmma gate/up bn={t.bn} stages={t.stages}", ms13, f13, f"err vs old {e13:.1e}")
            line(f"wgmma down    bn={t.bn} stages={t.stages}", ms2, f2, f"err vs old {e2:.1e}")

    # cuBLAS on one dense GEMM of the same size (the ceiling for a perfect grouped GEMM)
    rng = cupy.random.default_rng(T)
    xd, hd = rand_bf16(rng, (N, D), 1.0), rand_bf16(rng, (N, INTER), 1.0)
    c13, c2 = cupy.empty((N, 2 * INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    line("cuBLAS dense gate/up (bf16 out)", median_ms(partial(linear, xd, w13[0], out=c13)), f13)
    line("cuBLAS dense down (bf16 out)", median_ms(partial(linear, hd, w2[0], out=c2)), f2)

    # whole MoE block: prefill path (launcher policy) vs the decode kernels everywhere
    ws = cupy.empty(moe_workspace_bytes(T, cfg, D, INTER, INTER), dtype=np.uint8)
    out = cupy.empty((T, D), dtype=BF16)
    block = partial(moe_forward, x, wts, cfg, out=out, workspace=ws)
    ms_new = median_ms(block, reps=10)
    ref_out = to_np(out)
    policy = moe_mod.prefill_tile_rows
    moe_mod.prefill_tile_rows = lambda *a, **k: 0
    try:
        ms_old = median_ms(block, reps=10)
    finally:
        moe_mod.prefill_tile_rows = policy
    err = rms_rel(to_np(out), ref_out)
    flops = (f13 + f2) * (A + 1) / A  # routed + shared expert
    line("moe_forward, new path (routed+shared FLOPs; wgmma at BM=128 on sm_90a)", ms_new, flops)
    line("moe_forward, decode kernels", ms_old, flops, f"new vs old err {err:.1e}")


def _wg_cases(T, wts):
    """The plan of T tokens (uniform random routing, 128-row tiles) and both wgmma GEMMs of it as (name, kernel
    arguments, K, NOUT, FUSE_SILU, launcher tile, grid) cases; gate/up writes the h that down reads."""
    import cupy

    from helpers.moe_gemm import make_ids, make_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import max_tiles
    from kda_rt.cuda.ops.moe_gemm_wg import wg_tile

    N = T * A
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    plan = make_plan(make_ids(T, E, A, False, hrng), E, 128)
    h, y = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    cases = []
    for name, src, w, out, k, nout, silu in (("gate/up", x, wts.w13, h, D, 2 * INTER, 1), ("down", h, wts.w2, y, INTER, D, 0)):
        t = wg_tile(nout, k, bool(silu))
        fb = (nout // 2 if silu else nout) // (t.bn // 2 if silu else t.bn)
        args = (src, plan.sorted_pair, w, plan.tile_expert, plan.tile_row, plan.expert_off, plan.num_tiles, out,
                np.uint64(0), np.uint64(0))  # (no scales: bf16 weights and sources)
        cases.append((name, args, k, nout, silu, t, (fb, max_tiles(N, E, 128))))
    return plan, cases


def bench_e4m3(T, wts, q, rounds: int = 5, w8a8: bool = False):
    """The wgmma GEMMs (launcher tiles) with bf16 weights against e4m3 weights (q = (q13, s13, q2, s2): uint8 codes
    and row scales; moe_gemm_wg.cu WFMT = 1) widened by the conversion unit (E4M3_CVT = 1) or by bit moves (0),
    interleaved over `rounds` rounds: medians, useful TFLOP/s (the routed rows).  w8a8: also e4m3 sources
    (WFMT = 2), the GEMM alone and after its source's quantization (ops/quant.quantize_activations_e4m3)."""
    import cupy

    from helpers.gpu import median_ms
    from helpers.moe_gemm import make_ids, make_plan
    from kda_rt.cuda.ops import moe_gemm_tc
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_wg import moe_gemm_wg
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    N = T * A
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    plan = make_plan(make_ids(T, E, A, False, hrng), E, 128)
    h, y = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    q13, s13, q2, s2 = q
    default = moe_gemm_tc.E4M3_CONVERT
    for name, src, w, wq, sc, out, silu, flop in (("gate/up", x, wts.w13, q13, s13, h, True, 2 * N * D * 2 * INTER),
                                                  ("down", h, wts.w2, q2, s2, y, False, 2 * N * INTER * D)):
        variants = {"bf16": (w, None, 1), "e4m3 cvt": (wq, sc, 1), "e4m3 bits": (wq, sc, 0)}
        srcq = srcs = None
        if w8a8:  # e4m3 sources too (WFMT = 2): the GEMM alone, and with its source's quantization
            srcq = cupy.empty(src.shape, dtype=np.uint8)
            srcs = cupy.empty(src.shape[0], dtype=np.float32)
            quantize_activations_e4m3(src, out=srcq, scale_out=srcs)
            variants = {"bf16": variants["bf16"], "e4m3 cvt": variants["e4m3 cvt"], "w8a8": (wq, sc, 1),
                        "w8a8+quant": (wq, sc, 1)}
        times = {v: [] for v in variants}

        def run(v, wt, scale, src=src, srcq=srcq, srcs=srcs, silu=silu, out=out):
            if v.startswith("w8a8"):
                if v == "w8a8+quant":
                    quantize_activations_e4m3(src, out=srcq, scale_out=srcs)
                return moe_gemm_wg(srcq, wt, plan, top_k=A, fuse_silu=silu, out=out, scale=scale, src_scale=srcs)
            return moe_gemm_wg(src, wt, plan, top_k=A, fuse_silu=silu, out=out, scale=scale)

        for _ in range(rounds):
            for v, (wt, scale, convert) in variants.items():
                moe_gemm_tc.E4M3_CONVERT = convert
                times[v].append(median_ms(partial(run, v, wt, scale)))
        moe_gemm_tc.E4M3_CONVERT = default
        base = float(np.median(times["bf16"]))
        print(f"T={T} {name}: " + "  ".join(
            f"{v} {np.median(ts):.3f} ms {flop / np.median(ts) / 1e9:.0f} TFLOP/s ({np.median(ts) / base - 1:+.1%})"
            for v, ts in times.items()), flush=True)


def bench_limits(T, wts):
    """What bounds the wgmma grouped GEMM: its default tile timed as built (EXP_SKIP=0) and with the B
    (weight, 1), A (rows, 2) or both (3) cp.async copies skipped after the prologue, and the epilogue (4; 7:
    copies and epilogue) skipped (wrong results, timing only).  Prints useful TFLOP/s (routed rows) and executed TFLOP/s (128-row tiles, padding
    included) and the bytes each CTA copies into shared memory per second (L2 -> SM traffic)."""
    from helpers.gpu import median_ms
    from kda_rt.cuda.ops.compile import get_kernel

    N = T * A
    plan, cases = _wg_cases(T, wts)
    tiles = int(plan.num_tiles.get()[0])
    print(f"T={T}: {tiles} tiles of 128 rows for {N} rows ({tiles * 128 / N:.3f}x padded)", flush=True)
    for name, args, k, nout, silu, t, grid in cases:
        for skip in (0, 1, 2, 3, 4, 7):
            kern = get_kernel("moe_gemm_wg.cu", "moe_grouped_gemm_wg", max_dynamic_smem=t.smem_bytes, K=k, NOUT=nout,
                              FUSE_SILU=silu, TOPK=A, BN=t.bn, STAGES=t.stages, EXP_SKIP=skip,
                              STAGED_OUT=int(t.staged_out))
            ms = median_ms(partial(kern, grid, (256,), args, shared_mem=t.smem_bytes))
            useful, done = 2 * N * k * nout / ms / 1e9, 2 * tiles * 128 * k * nout / ms / 1e9
            l2 = tiles * grid[0] * (k // 64) * (128 + t.bn) * 64 * 2 / ms / 1e9
            print(f"  {name:8s} skip={skip} {ms:7.3f} ms  useful {useful:6.1f}  executed {done:6.1f} TFLOP/s  "
                  f"smem fill {l2:5.2f} TB/s (as built)", flush=True)


def bench_epilogue(T, wts, rounds: int = 5):
    """The launcher's tile with each epilogue: STAGED_OUT 0 (direct stores of the accumulator pairs) or 1 (staged
    through shared memory), and for gate/up also the SiLU quotient of
    IEEE division (EXP_IEEE_SILU=1, the kernel before silu_nr), interleaved over `rounds` rounds (the kernel
    drifts as the GPU heats): medians."""
    from helpers.gpu import median_ms
    from kda_rt.cuda.ops.compile import get_kernel

    _, cases = _wg_cases(T, wts)
    for name, args, k, nout, silu, t, grid in cases:
        variants = [(0, 1), (0, 0), (1, 0)] if silu else [(0, 0), (1, 0)]  # (STAGED_OUT, EXP_IEEE_SILU)
        times = {v: [] for v in variants}
        for _ in range(rounds):
            for v in variants:
                kern = get_kernel("moe_gemm_wg.cu", "moe_grouped_gemm_wg", max_dynamic_smem=t.smem_bytes, K=k, NOUT=nout,
                                  FUSE_SILU=silu, TOPK=A, BN=t.bn, STAGES=t.stages, STAGED_OUT=v[0], EXP_IEEE_SILU=v[1])
                times[v].append(median_ms(partial(kern, grid, (256,), args, shared_mem=t.smem_bytes)))
        base = float(np.median(times[variants[0]]))
        print(f"T={T} {name}: " + "  ".join(
            f"staged={v[0]}{' ieee' if v[1] else ''} {np.median(ts):.3f} ms ({np.median(ts) / base - 1:+.1%})"
            for v, ts in times.items()), flush=True)


def bench_define(T, wts, spec: str, rounds: int = 5):
    """The launcher's tile and epilogue built with each value of one compile-time define ("NAME=v1,v2,..."; the
    first value is the baseline), interleaved over `rounds` rounds: medians, and whether every variant's output
    is bit-identical to the first's."""
    import cupy

    from helpers.gpu import median_ms
    from kda_rt.cuda.ops.compile import get_kernel
    from kda_rt.cuda.ops.moe_gemm_wg import weight_map

    name_def, values = spec.split("=")
    values = [int(v) for v in values.split(",")]
    _, cases = _wg_cases(T, wts)
    for name, args, k, nout, silu, t, grid in cases:
        out = args[7]  # (args[8] is the scale pointer, 0: bf16 weights)
        defs = dict(K=k, NOUT=nout, FUSE_SILU=silu, TOPK=A, BN=t.bn, STAGES=t.stages, STAGED_OUT=int(t.staged_out))
        kerns = {v: get_kernel("moe_gemm_wg.cu", "moe_grouped_gemm_wg", max_dynamic_smem=t.smem_bytes,
                               **{**defs, name_def: v}) for v in values}
        # B_TMA builds take the weights' tensor map as an 11th argument
        vargs = {v: args + (weight_map(args[2], t, name),) if name_def == "B_TMA" and v else args for v in values}
        same, ref = True, None
        for v, kern in kerns.items():
            out.fill(0)
            kern(grid, (256,), vargs[v], shared_mem=t.smem_bytes)
            if ref is None:
                ref = out.copy()
            else:
                same = same and bool(cupy.array_equal(ref, out))
        times = {v: [] for v in values}
        for _ in range(rounds):
            for v, kern in kerns.items():
                times[v].append(median_ms(partial(kern, grid, (256,), vargs[v], shared_mem=t.smem_bytes)))
        base = float(np.median(times[values[0]]))
        print(f"T={T} {name}: " + "  ".join(f"{name_def}={v} {np.median(ts):.3f} ms ({np.median(ts) / base - 1:+.1%})"
                                            for v, ts in times.items()) + f"  bit-identical: {same}", flush=True)


def bench_ws(T, wts, rounds: int = 5, q=None):
    """The launcher's GEMMs in their plain form (KDA_RT_MOE_WS=0) against the persistent, warp-specialized one (=1,
    moe_gemm_wg.cu WS) and that one in clusters with the weight rows multicast (mc: KDA_RT_MOE_MC=1), interleaved over
    `rounds` rounds: medians, useful TFLOP/s (the routed rows), and whether the outputs are bit-identical.  q = (q13, s13, q2, s2) (`--e4m3 --w8a8`): on e4m3 sources and weights (the sources
    quantized once, untimed)."""
    import os

    import cupy

    from helpers.gpu import median_ms
    from helpers.moe_gemm import make_ids, make_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_wg import moe_gemm_wg
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    N = T * A
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    plan = make_plan(make_ids(T, E, A, False, hrng), E, 128)
    h, y = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    moe_gemm_wg(x, wts.w13, plan, top_k=A, fuse_silu=True, out=h)  # h defined before down reads (or quantizes) it
    gemms = [("gate/up", x, wts.w13, None, h, True, 2 * N * D * 2 * INTER),
             ("down", h, wts.w2, None, y, False, 2 * N * INTER * D)]
    if q is not None:
        q13, s13, q2, s2 = q
        gemms = [(name, src, wq, sc, out, silu, flop) for (name, src, _, _, out, silu, flop), wq, sc
                 in zip(gemms, (q13, q2), (s13, s2), strict=True)]
    old = {k: os.environ.get(k) for k in ("KDA_RT_MOE_WS", "KDA_RT_MOE_MC")}

    def switch(v):
        os.environ["KDA_RT_MOE_WS"] = "0" if v == "0" else "1"
        os.environ["KDA_RT_MOE_MC"] = "1" if v == "mc" else "0"

    try:
        for name, src, w, sc, out, silu, flop in gemms:
            kw = {}
            if sc is not None:
                srcq = cupy.empty(src.shape, dtype=np.uint8)
                srcs = cupy.empty(src.shape[0], dtype=np.float32)
                quantize_activations_e4m3(src, out=srcq, scale_out=srcs)
                src, kw = srcq, dict(scale=sc, src_scale=srcs)
            run = partial(moe_gemm_wg, src, w, plan, top_k=A, fuse_silu=silu, out=out, **kw)
            outs, times = {}, {v: [] for v in ("0", "1", "mc")}
            for v in times:
                switch(v)
                out.fill(0)
                run()
                outs[v] = out.copy()
            same = all(bool(cupy.array_equal(outs["0"], o)) for o in outs.values())
            for _ in range(rounds):
                for v in times:
                    switch(v)
                    times[v].append(median_ms(run))
            base = float(np.median(times["0"]))
            print(f"T={T} {name}{' w8a8' if q is not None else ''}: " + "  ".join(
                f"{'WS+MC' if v == 'mc' else 'WS=' + v} {np.median(ts):.3f} ms {flop / np.median(ts) / 1e9:.0f} TFLOP/s ({np.median(ts) / base - 1:+.1%})"
                for v, ts in times.items()) + f"  bit-identical: {same}", flush=True)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_tiles(T, wts, rounds: int = 5, q=None):
    """The launcher's tile against the other tiles that fit (BN = 128 with 3 stages runs two CTAs per SM, so
    one CTA's epilogue overlaps the other's products), each GEMM with its launcher's epilogue and the other
    epilogue, interleaved over `rounds` rounds: medians.  q = (q13, s13, q2, s2) (`--e4m3 --w8a8`): the GEMMs
    on e4m3 sources and weights (moe_gemm_wg.cu WFMT = 2; the sources quantized once, untimed)."""
    import cupy

    from helpers.gpu import median_ms
    from helpers.moe_gemm import make_ids, make_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_wg import WgTile, moe_gemm_wg, wg_tile
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    N = T * A
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    plan = make_plan(make_ids(T, E, A, False, hrng), E, 128)
    h, y = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    if q is not None:  # h must be defined before it is quantized: the gate/up GEMM once
        moe_gemm_wg(x, wts.w13, plan, top_k=A, fuse_silu=True, out=h)
    for name, src, w, sc, out, k, nout, silu in (
            ("gate/up", x, wts.w13 if q is None else q[0], None if q is None else q[1], h, D, 2 * INTER, True),
            ("down", h, wts.w2 if q is None else q[2], None if q is None else q[3], y, INTER, D, False)):
        kw = {}
        if q is not None:
            codes, scales = cupy.empty(src.shape, dtype=np.uint8), cupy.empty(src.shape[0], dtype=np.float32)
            quantize_activations_e4m3(src, out=codes, scale_out=scales)
            src, kw = codes, {"scale": sc, "src_scale": scales}
        t0 = wg_tile(nout, k, silu, e4m3_src=q is not None)
        tiles = [t0] + [WgTile(bn, st, t0.staged_out) for bn, st in ((128, 3), (128, 4)) if (bn, st) != t0[:2]]
        tiles += [t._replace(staged_out=not t.staged_out) for t in tiles[:2]]
        times = {t: [] for t in tiles}
        for _ in range(rounds):
            for t in tiles:
                times[t].append(median_ms(partial(moe_gemm_wg, src, w, plan, top_k=A, fuse_silu=silu, out=out, tile=t,
                                                  **kw)))
        base = float(np.median(times[t0]))
        print(f"T={T} {name}{' w8a8' if q is not None else ''}: " + "  ".join(
            f"bn={t.bn} stages={t.stages} staged={int(t.staged_out)} {np.median(ts):.3f} ms ({np.median(ts) / base - 1:+.1%})"
            for t, ts in times.items()), flush=True)


def run_once(T, wts):
    """Both GEMMs once with the launcher's tiles after one warm-up pair (for a profiler: launches 3 and 4 of
    moe_grouped_gemm_wg are the gate/up and down GEMMs to look at; tests/gpu/ncu_moe_gemm.sh)."""
    import cupy

    from helpers.moe_gemm import make_ids, make_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm_wg import moe_gemm_wg

    N = T * A
    hrng = np.random.default_rng(T)
    x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
    plan = make_plan(make_ids(T, E, A, False, hrng), E, 128)
    h, y = cupy.empty((N, INTER), dtype=BF16), cupy.empty((N, D), dtype=BF16)
    for _ in range(2):
        moe_gemm_wg(x, wts.w13, plan, top_k=A, fuse_silu=True, out=h)
        moe_gemm_wg(h, wts.w2, plan, top_k=A, fuse_silu=False, out=y)
    cupy.cuda.Device().synchronize()
    print(f"T={T}: gate/up and down ran twice", flush=True)


def main():
    import cupy

    from helpers.gpu import rand_bf16, unused_defines
    from helpers.moe_router import make_cfg
    from kda_rt.cuda.weights import DeviceMLP, DeviceMoE

    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tokens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--limits", action="store_true", help="only the wgmma kernel with its copies skipped (bench_limits)")
    ap.add_argument("--epilogue", action="store_true", help="only the wgmma kernel's two epilogues, interleaved")
    ap.add_argument("--tiles", action="store_true", help="only the wgmma kernel's tiles, interleaved (with --e4m3 --w8a8: on e4m3 sources and weights)")
    ap.add_argument("--once", action="store_true", help="both wgmma GEMMs twice, untimed (for ncu)")
    ap.add_argument("--define", default="", help="NAME=v1,v2,...: the wgmma kernel built with each value, interleaved")
    ap.add_argument("--e4m3", action="store_true", help="the wgmma kernel with bf16 against e4m3 weights, interleaved")
    ap.add_argument("--w8a8", action="store_true", help="with --e4m3: e4m3 sources too (moe_gemm_wg.cu WFMT = 2)")
    ap.add_argument("--ws", action="store_true", help="the launcher's GEMMs plain, warp-specialized (KDA_RT_MOE_WS) "
                    "and multicast (KDA_RT_MOE_MC), interleaved (with --e4m3 --w8a8: on e4m3 sources and weights)")
    args = ap.parse_args()
    if args.define and (unused := unused_defines("moe_gemm_wg.cu", [args.define.split("=")[0]])):
        ap.error(f"--define: moe_gemm_wg.cu does not read {unused[0]}")

    rng = cupy.random.default_rng(1)
    w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
    s13, s2 = rand_bf16(rng, (2 * INTER, D), D**-0.5), rand_bf16(rng, (D, INTER), INTER**-0.5)
    router = cupy.asarray((np.random.default_rng(2).normal(size=(E, D)) / np.sqrt(D)).astype(np.float32))
    wts = DeviceMoE(router, cupy.zeros(E, dtype=np.float32), w13, w2, DeviceMLP(s13, s2))
    cfg = dataclasses.replace(make_cfg(E), intermediate_size=INTER)
    print(f"E={E} A={A} D={D} I={INTER}; peak {PEAK / 1e12:.0f} TFLOP/s", flush=True)
    q = None
    if args.e4m3:
        from helpers.moe_gemm import e4m3_stack

        hrng = np.random.default_rng(3)
        q = (*e4m3_stack(rng, hrng, E, 2 * INTER, D), *e4m3_stack(rng, hrng, E, D, INTER))
    for T in map(int, args.tokens.split(",")):
        if args.ws:
            bench_ws(T, wts, q=q if args.w8a8 else None)
        elif args.tiles:
            bench_tiles(T, wts, q=q if args.w8a8 else None)
        elif args.e4m3:
            bench_e4m3(T, wts, q, w8a8=args.w8a8)
        elif args.once:
            run_once(T, wts)
        elif args.define:
            bench_define(T, wts, args.define)
        elif args.epilogue:
            bench_epilogue(T, wts)
        else:
            bench_limits(T, wts) if args.limits else bench_step(T, wts, cfg, args.sweep)
        cupy.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
