"""Decode-sized MoE grouped GEMMs on the Kimi-Linear-48B shape (E=256, top-8, D=2304, I=1024): the
weight-stationary decode kernel (moe_gemm.cu, with its K split at small T) against the tiled kernel
(moe_gemm_tc.cu) with 16-row tiles, per GEMM, in TB/s of expert weights touched (the bytes floor of
a decode step's MoE: every touched expert's weights read once).  Routing: uniform, and concentrated
(tokens pick from a pool of ~T·A/3.7 experts, as the random 48B-shaped model routes at batch 32).

    bytes gate/up = touched · 2I · D · 2,  down = touched · D · I · 2;   copy ceiling ~4.3 TB/s (H200)

Times: CUDA events around each call, 3 warm-ups, median of 20.
Run: python tests/gpu/bench_moe_decode.py [--tokens 1,8,32,128] [--tiles "16,128,64,5,1,4,2;16,64,64,6,1,2,3"]
(--tiles: TileConfig fields bm, bn, bk, stages, warps_m, warps_n, min_blocks; default TILES below)

--fused: instead, the decode path as the model runs it, in CUDA-graph replays captured with programmatic
dependent launch: moe_bucket + the two moe_gemm_tc launches against moe_bucket + moe_decode_fused (both
GEMMs in one launch), with the launcher's tiles; each graph cycles through 8 routings (different experts,
so the weights come from HBM, not L2); outputs compared bit for bit.

--gemv: one-token steps (9 routed rows, as the 48B model's 8 experts + the shared slot) in CUDA-graph replays
with programmatic dependent launch, 8 routings a graph: moe_bucket + the tiled gate/up (moe_gemm_tc) + down
against moe_bucket + the GEMV gate/up (moe_gemv.cu, each configuration of --gemv-configs) + the same down; and
the gate/up launch alone each way.  h compared against the tiled kernel's (RMS relative).

--e4m3: moe_decode_fused with bf16 weights against e4m3 weights (uint8 codes with a scale a row, moe_gemm_tc.cu
WFMT = 1) in the same graph replays as --fused: e4m3 converted by bit moves (E4M3_CONVERT = 0) with the launcher's
tile (twice the k step) and with the bf16 tile's k step, and by the conversion unit (1, the launcher's default) with
the launcher's tile; TB/s counted in each format's own bytes."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

E, A, D, INTER = 256, 8, 2304, 1024
TILES = [(16, 128, 64, 4, 1, 4, 2), (16, 64, 64, 4, 1, 2, 4), (16, 128, 64, 6, 1, 4, 2), (16, 64, 64, 6, 1, 2, 3),
         (32, 128, 64, 4, 1, 4, 2)]




def main():
    import cupy

    from helpers.gpu import median_ms, rand_bf16, rms_rel, to_np
    from helpers.moe_gemm import make_plan
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm import moe_gemm, tile_rows_for
    from kda_rt.cuda.ops.moe_gemm_tc import TileConfig, moe_gemm_tc

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8,32,64,128,256")
    ap.add_argument("--tiles", default="", help="';'-separated tiles, each 7 comma-separated TileConfig fields")
    ap.add_argument("--no-old", action="store_true", help="skip the weight-stationary moe_gemm.cu rows")
    ap.add_argument("--fused", action="store_true", help="time moe_decode_fused against the two launches")
    ap.add_argument("--gemv", action="store_true", help="time the one-token GEMV gate/up against the tiled one")
    ap.add_argument("--e4m3", action="store_true", help="time moe_decode_fused with e4m3 weights against bf16")
    ap.add_argument("--gemv-configs", default="8,2,0;8,1,1;4,3,0;16,1,0",
                    help="';'-separated GemvConfig fields: warps, blocks per SM, pipe")
    args = ap.parse_args()
    if args.gemv:
        return bench_gemv([tuple(int(v) for v in c.split(",")) for c in args.gemv_configs.split(";") if c])
    if args.fused:
        return bench_fused([int(t) for t in args.tokens.split(",")])
    if args.e4m3:
        return bench_e4m3([int(t) for t in args.tokens.split(",")],
                          [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";") if t])
    tiles = [tuple(int(v) for v in t.split(",")) for t in args.tiles.split(";") if t] or TILES
    rng = cupy.random.default_rng(1)
    w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
    per13, per2 = 2 * INTER * D * 2, D * INTER * 2
    for T in map(int, args.tokens.split(",")):
        for routing in ("uniform", "concentrated"):
            hrng = np.random.default_rng(T)
            pool = E if routing == "uniform" else max(A, min(E, int(T * A / 3.7)))
            experts = hrng.choice(E, pool, replace=False)
            ids = np.stack([hrng.choice(experts, A, replace=False) for _ in range(T)]).astype(np.int32)
            touched = np.unique(ids).size
            if routing == "concentrated" and pool == E:
                continue
            N = T * A
            x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
            b13, b2 = touched * per13, touched * per2
            print(f"T={T} {routing}: {touched} experts touched, {b13 / 1e6:.0f} + {b2 / 1e6:.0f} MB", flush=True)
            plan = make_plan(ids, E, tile_rows_for(N, E))
            h_ref, y_ref = cupy.empty((N, INTER), BF16), cupy.empty((N, D), BF16)
            moe_gemm(x, w13, plan, top_k=A, fuse_silu=True, out=h_ref)  # the reference rows
            moe_gemm(h_ref, w2, plan, top_k=A, fuse_silu=False, out=y_ref)
            if not args.no_old:
                ms13 = median_ms(partial(moe_gemm, x, w13, plan, top_k=A, fuse_silu=True, out=h_ref))
                ms2 = median_ms(partial(moe_gemm, h_ref, w2, plan, top_k=A, fuse_silu=False, out=y_ref))
                print(f"  old          gate/up {ms13 * 1e3:7.1f} us {b13 / ms13 / 1e9:5.2f} TB/s | down "
                      f"{ms2 * 1e3:7.1f} us {b2 / ms2 / 1e9:5.2f} TB/s", flush=True)
            h_ref_s, y_ref_s = to_np(h_ref[plan.pair_pos]), to_np(y_ref[plan.pair_pos])
            for t in tiles:
                tile = TileConfig(*t)
                p = make_plan(ids, E, tile.bm)
                h, y = cupy.empty_like(h_ref), cupy.empty_like(y_ref)
                h_in = cupy.empty_like(h)
                h_in[p.pair_pos] = h_ref[plan.pair_pos]
                try:
                    ms13 = median_ms(partial(moe_gemm_tc, x, w13, p, top_k=A, fuse_silu=True, out=h, tile=tile))
                    ms2 = median_ms(partial(moe_gemm_tc, h_in, w2, p, top_k=A, fuse_silu=False, out=y, tile=tile))
                except Exception as exc:  # report and go on
                    print(f"  tile {t}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                e13, e2 = rms_rel(to_np(h[p.pair_pos]), h_ref_s), rms_rel(to_np(y[p.pair_pos]), y_ref_s)
                print(f"  tc {str(t):26s} gate/up {ms13 * 1e3:7.1f} us {b13 / ms13 / 1e9:5.2f} TB/s | down "
                      f"{ms2 * 1e3:7.1f} us {b2 / ms2 / 1e9:5.2f} TB/s | err {e13:.1e} {e2:.1e}", flush=True)
            cupy.get_default_memory_pool().free_all_blocks()


def _decode_cases(tokens, rounds: int, seed: int | None = None):
    """For each T of `tokens` and routing (uniform; concentrated where its pool of ~T·A/3.7 experts is smaller than
    E): (T, routing, cases, touched, x, h, y) with `rounds` cases of (ids on the device, a 16-row plan, zeroed
    counters), the experts each touches, the step's x and its h / y buffers.  Draws from default_rng(T) per step, or
    from one default_rng(seed) over all of them."""
    import cupy

    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles
    from kda_rt.cuda.ops.moe_gemm_tc import sync_words

    shared = None if seed is None else np.random.default_rng(seed)
    for T in tokens:
        for routing in ("uniform", "concentrated"):
            pool = E if routing == "uniform" else max(A, min(E, int(T * A / 3.7)))
            if routing == "concentrated" and pool == E:
                continue
            hrng = shared or np.random.default_rng(T)
            N, tiles = T * A, max_tiles(T * A, E, 16)
            cases, touched = [], []
            for _ in range(rounds):
                experts = hrng.choice(E, pool, replace=False)
                ids = np.stack([hrng.choice(experts, A, replace=False) for _ in range(T)]).astype(np.int32)
                touched.append(np.unique(ids).size)
                z = lambda n: cupy.zeros(n, dtype=np.int32)  # noqa: E731
                plan = MoEPlan(z(E + 1), z(N), z(N), z(tiles), z(tiles), z(1), 16)
                cases.append((cupy.asarray(ids), plan, z(sync_words(N, E))))
            x = cupy.asarray(hrng.standard_normal((T, D), dtype=np.float32)).astype(BF16)
            yield T, routing, cases, touched, x, cupy.empty((N, INTER), BF16), cupy.empty((N, D), BF16)


def _decode_moe(cases, x, w13, w2, h, y, tiles, stream):
    """Every routing of `cases` through the decode MoE GEMMs: bucket, then the two launches (tiles = the
    gate/up and down TileConfigs) or the fused one (tiles = its TileConfig)."""
    from kda_rt.cuda.ops.moe_align import moe_bucket
    from kda_rt.cuda.ops.moe_gemm_tc import moe_decode_fused, moe_gemm_tc

    for ids, plan, sync in cases:
        moe_bucket(ids, E, plan, sync=sync, stream=stream)
        if isinstance(tiles, tuple) and len(tiles) == 2:
            moe_gemm_tc(x, w13, plan, top_k=A, fuse_silu=True, out=h, tile=tiles[0], stream=stream)
            moe_gemm_tc(h, w2, plan, top_k=A, fuse_silu=False, out=y, tile=tiles[1], stream=stream)
        else:
            moe_decode_fused(x, w13, w2, plan, top_k=A, h=h, out=y, sync=sync, tile=tiles, stream=stream)


def bench_fused(tokens, rounds: int = 8):
    import cupy

    from helpers.gpu import graph_us, rand_bf16
    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.moe_gemm_tc import fused_decode_tile, tile_config

    rng = cupy.random.default_rng(1)
    w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
    per_expert = 3 * INTER * D * 2
    for T, routing, cases, touched, x, h, y in _decode_cases(tokens, rounds):
        t13, t2, tf = tile_config(16, 2 * INTER, D, True, T), tile_config(16, D, INTER, False, T), fused_decode_tile(T, D, INTER)

        with pdl.capturing(True):
            run = partial(_decode_moe, cases, x, w13, w2, h, y)
            last = cases[-1][1]  # rows of y in pair order (the order inside an expert is the atomics')
            us_two = graph_us(partial(run, (t13, t2)), calls=2) / rounds
            y_two = y[last.pair_pos].view(cupy.uint16)
            us_one = graph_us(partial(run, tf), calls=2) / rounds
        same = bool(cupy.all(y[last.pair_pos].view(cupy.uint16) == y_two))
        mb = np.mean(touched) * per_expert / 1e6
        print(f"T={T:4d} {routing:12s} {np.mean(touched):6.1f} experts {mb:7.1f} MB | two launches "
              f"{us_two:7.1f} us {mb / us_two:5.2f} TB/s | fused {us_one:7.1f} us {mb / us_one:5.2f} TB/s "
              f"({us_one / us_two - 1:+.1%}) | tiles {t13.bn}/{t2.bn} {tf} | same {same}", flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


def bench_e4m3(tokens, tiles=(), rounds: int = 8):
    import cupy

    from helpers.gpu import graph_us, rand_bf16
    from helpers.moe_gemm import e4m3_stack
    from kda_rt.cuda.ops import moe_gemm_tc as mod
    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.moe_align import moe_bucket

    rng = cupy.random.default_rng(1)
    hrng = np.random.default_rng(1)
    w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
    q13, s13 = e4m3_stack(rng, hrng, E, 2 * INTER, D)
    q2, s2 = e4m3_stack(rng, hrng, E, D, INTER)
    per_expert = 3 * INTER * D  # elements
    shapes = [(2 * INTER, D, True), (D, INTER, False)]

    def run(cases, x, h, y, tile, e4m3, stream):
        for ids, plan, sync in cases:
            moe_bucket(ids, E, plan, sync=sync, stream=stream)
            if e4m3:
                mod.moe_decode_fused(x, q13, q2, plan, top_k=A, h=h, out=y, sync=sync, tile=tile, scale13=s13,
                                     scale2=s2, stream=stream)
            else:
                mod.moe_decode_fused(x, w13, w2, plan, top_k=A, h=h, out=y, sync=sync, tile=tile, stream=stream)

    for T, routing, cases, touched, x, h, y in _decode_cases(tokens, rounds, seed=2):
        tf = mod.fused_decode_tile(T, D, INTER)
        variants = [("bf16", tf, False, 0), ("e4m3 bits", mod.e4m3_tile(tf, shapes), True, 0),
                    (f"e4m3 bits bk{tf.bk}", tf, True, 0), ("e4m3 cvt", mod.e4m3_tile(tf, shapes), True, 1),
                    ("e4m3 cvt launcher", mod.fused_e4m3_tile(tf, shapes), True, 1)]
        if tiles:  # --tiles: the launcher's e4m3 tile against these (conversion unit), those both GEMMs take
            fit = [mod.TileConfig(*t) for t in tiles]
            fit = [t for t in fit if all(mod._fits(t, nout, k, silu, e4m3=True) for nout, k, silu in shapes)]
            variants = variants[:1] + variants[3:] + [(f"e4m3 {tuple(t)}", t, True, 1) for t in fit]
        n = np.mean(touched) * per_expert
        line = [f"T={T:4d} {routing:12s} {np.mean(touched):6.1f} experts"]
        base = None
        default = mod.E4M3_CONVERT
        try:
            with pdl.capturing(True):
                for label, tile, e4m3, convert in variants:
                    mod.E4M3_CONVERT = convert
                    us = graph_us(partial(run, cases, x, h, y, tile, e4m3), calls=2) / rounds
                    base = base or us
                    mb = n * (1 if e4m3 else 2) / 1e6
                    line.append(f"{label} {us:7.1f} us {mb / us:5.2f} TB/s ({us / base:.3f}x)")
        finally:
            mod.E4M3_CONVERT = default
        print(" | ".join(line), flush=True)
        cupy.get_default_memory_pool().free_all_blocks()


def bench_gemv(configs, rounds: int = 8, pairs: int = 9):
    import cupy

    from helpers.gpu import graph_us, rand_bf16, rms_rel, to_np
    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_align import MoEPlan, max_tiles, moe_bucket
    from kda_rt.cuda.ops.moe_gemm_tc import moe_gemm_tc, tile_config
    from kda_rt.cuda.ops.moe_gemv import GemvConfig, moe_gemv_gate_up

    rng = cupy.random.default_rng(1)
    w13, w2 = rand_bf16(rng, (E, 2 * INTER, D), D**-0.5), rand_bf16(rng, (E, D, INTER), INTER**-0.5)
    hrng = np.random.default_rng(1)
    tiles = max_tiles(pairs, E, 16)
    cases = []
    for _ in range(rounds):
        z = lambda n: cupy.zeros(n, dtype=np.int32)  # noqa: E731
        ids = cupy.asarray(hrng.choice(E, pairs, replace=False)[None].astype(np.int32))
        cases.append((ids, MoEPlan(z(E + 1), z(pairs), z(pairs), z(tiles), z(tiles), z(1), 16)))
    x = cupy.asarray(hrng.standard_normal((1, D), dtype=np.float32)).astype(BF16)
    h, y = cupy.empty((pairs, INTER), BF16), cupy.empty((pairs, D), BF16)
    t13, t2 = tile_config(16, 2 * INTER, D, True, 1), tile_config(16, D, INTER, False, 1)
    mb13, mb2 = pairs * 2 * INTER * D * 2 / 1e6, pairs * D * INTER * 2 / 1e6

    def step(cfg, down, stream):
        for ids, plan in cases:
            moe_bucket(ids, E, plan, stream=stream)
            if cfg is None:
                moe_gemm_tc(x, w13, plan, top_k=pairs, fuse_silu=True, out=h, tile=t13, stream=stream)
            else:
                moe_gemv_gate_up(x, w13, plan, out=h, cfg=cfg, stream=stream)
            if down:
                moe_gemm_tc(h, w2, plan, top_k=pairs, fuse_silu=False, out=y, tile=t2, stream=stream)

    with pdl.capturing(True):
        ref = None
        for _ in range(2):  # every variant twice, interleaved (the clock drifts within a process)
            for c in [None, *configs]:
                cfg = GemvConfig(c[0], c[1], bool(c[2])) if c else None
                us_both = graph_us(partial(step, cfg, True), calls=2) / rounds
                us_gu = graph_us(partial(step, cfg, False), calls=2) / rounds
                got = to_np(h)
                ref = got if cfg is None else ref
                err = rms_rel(got, ref)
                print(f"{'tiled' if cfg is None else str(tuple(cfg)):22s} gate/up+bucket {us_gu:6.1f} us "
                      f"({mb13 / us_gu:4.2f} TB/s) | with down {us_both:6.1f} us ({(mb13 + mb2) / us_both:4.2f} TB/s) "
                      f"| h rms rel vs tiled {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
