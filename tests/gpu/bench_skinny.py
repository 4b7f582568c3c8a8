"""Decode projections of the 48B shape: kernels_cu/skinny_gemm.cu against cuBLAS (gemm.linear with
KDA_RT_SKINNY=0), by rows M.  Each timing is a CUDA graph of calls cycling over enough copies of the
weight (>= 160 MB in all) that every call streams its weight from HBM, as in a decode step; time per
call and TB/s of the weight bytes.

    PYTHONPATH=. python tests/gpu/bench_skinny.py [--rows 1,2,4,8,16,32] [--splits] [--small-splits] [--only o_proj]
One JSON line per (shape, M).  --splits: for 9-32 rows also skinny_gemm_cl at every cluster split that
divides K (features per CTA as wide_plan picks them), "split_S_us" per split.  --small-splits: for 1-8 rows
also skinny_gemm_cl with one n-tile of 8 rows at every (FPC, SPLITS) that fits, "cl_FPCxS_us" (shapes of up
to MAX_N outputs; a measurement for the 8-row kernel's alternative: its 144 CTAs of o_proj on 132 SMs leave
12 SMs with two).  --only: shapes whose name contains the text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

SHAPES = {  # name: (K, N)
    "kda o_proj / mla o_proj": (4096, 2304),
    "kda q|k|v": (2304, 12288),
    "kda f_a|g_a|b": (2304, 288),
    "mla q|kv_a": (2304, 6720),
    "dense gate|up": (2304, 18432),
    "dense down": (9216, 2304),
    "lm_head": (2304, 163840),
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--splits", action="store_true")
    ap.add_argument("--small-splits", action="store_true",
                    help="rows <= 8: also skinny_gemm_cl with one n-tile at every (FPC, SPLITS) that fits")
    ap.add_argument("--only", default="", help="shapes whose name contains this text")
    args = ap.parse_args()

    import cupy

    from helpers.gpu import graph_us
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops import skinny_gemm as sk
    from kda_rt.cuda.ops.check import BF16

    rng = cupy.random.default_rng(0)
    for name, (K, N) in SHAPES.items():
        if args.only not in name:
            continue
        nbytes = N * K * 2
        copies = int(min(64, max(1, -(-(160 << 20) // nbytes))))
        ws = [(rng.standard_normal((N, K), dtype=np.float32) * K**-0.5).astype(BF16) for _ in range(copies)]
        for M in (int(m) for m in args.rows.split(",")):
            x = rng.standard_normal((M, K), dtype=np.float32).astype(BF16)
            out = cupy.empty((M, N), dtype=BF16)
            row = {"shape": name, "M": M, "K": K, "N": N, "MB": round(nbytes / 1e6, 2), "copies": copies}
            for flag in ("1", "0"):
                os.environ["KDA_RT_SKINNY"] = flag

                def body(stream, x=x, out=out, ws=ws):
                    with stream:
                        for w in ws:
                            linear(x, w, out=out)

                us = graph_us(body, calls=4) / copies
                key = "skinny" if flag == "1" else "cublas"
                row[f"{key}_us"] = round(us, 2)
                row[f"{key}_tb_s"] = round(nbytes / us / 1e6, 2)
            plan = sk.wide_plan(M, N, K)
            if args.splits and plan:
                row["plan"] = plan
                fpc, _, nt = plan
                for splits in (1, 2, 3, 4, 6, 8):
                    if not sk._plan_fits(M, N, K, fpc, splits, nt):
                        continue

                    def forced(stream, x=x, out=out, ws=ws, p=(fpc, splits, nt)):
                        for w in ws:
                            sk.skinny_gemm(x, w, out, stream=stream, plan=p)

                    row[f"split_{splits}_us"] = round(graph_us(forced, calls=4) / copies, 2)
            if args.small_splits and M <= sk.MAX_ROWS and N <= sk.MAX_N:
                for fpc in (32, 64):
                    for splits in (1, 2, 3, 4, 6, 8):
                        if not sk._plan_fits(M, N, K, fpc, splits, 1):
                            continue

                        def small(stream, x=x, out=out, ws=ws, p=(fpc, splits, 1)):
                            for w in ws:
                                sk.skinny_gemm(x, w, out, stream=stream, plan=p)

                        row[f"cl_{fpc}x{splits}_us"] = round(graph_us(small, calls=4) / copies, 2)
                        os.environ["KDA_RT_SKINNY"] = "0"
                        ref = linear(x, ws[0], out=cupy.empty_like(out)).astype(np.float32)
                        got = sk.skinny_gemm(x, ws[0], cupy.empty_like(out), plan=(fpc, splits, 1)).astype(np.float32)
                        row[f"cl_{fpc}x{splits}_err"] = float(cupy.abs(got - ref).max() / cupy.abs(ref).max())
            print(json.dumps(row), flush=True)
        del ws
    os.environ.pop("KDA_RT_SKINNY", None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
