"""Decode-sized MoE grouped GEMMs on the Kimi-Linear-48B shape (E=256, top-8, D=2304, I=1024): the
weight-stationary decode kernel (moe_gemm.cu, with its K split at small T) against the tiled kernel
(moe_gemm_tc.cu) with 16-row tiles, per GEMM, in TB/s of expert weights touched (the bytes floor of
a decode step's MoE: every touched expert's weights read once).  Routing: uniform, and concentrated
(tokens pick from a pool of ~T·A/3.7 experts, as the random 48B-shaped model routes at batch 32).

    bytes gate/up = touched · 2I · D · 2,  down = touched · D · I · 2;   copy ceiling ~4.3 TB/s (H200)

Times: CUDA events around each call, 3 warm-ups, median of 20.
Run: python tests/gpu/bench_moe_decode.py [--tokens 1,8,32,128] [--tiles "16,128,64,5,1,4,2;16,64,64,6,1,2,3"]
(--tiles: TileConfig fields bm, bn, bk, stages, warps_m, warps_n, min_blocks; default TILES below)"""

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
    from kernels.test_moe_gemm_tc import make_plan

    from helpers.gpu import median_ms, rand_bf16, rms_rel, to_np
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.moe_gemm import moe_gemm, tile_rows_for
    from kda_rt.cuda.ops.moe_gemm_tc import TileConfig, moe_gemm_tc

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4,8,32,64,128,256")
    ap.add_argument("--tiles", default="", help="';'-separated tiles, each 7 comma-separated TileConfig fields")
    ap.add_argument("--no-old", action="store_true", help="skip the weight-stationary moe_gemm.cu rows")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
