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
--spin-us US: each call comes after a kernel of 128 small CTAs that only waits US microseconds (a latency-bound
predecessor such as kda_decode_step), both launched with programmatic dependent launch as in a decode graph:
"spin_<kernel>_us" is the time each call adds to the spin alone, for the streaming kernel (KDA_RT_SKINNY_STAGED=0),
skinny_gemm_staged with cp.async pieces (1) or bulk copies (2), and cuBLAS: what of the weight stream the
predecessor hides.  SPIN_SHAPE=C:B (environment) gives the spin kernel clusters of C CTAs and B bytes of dynamic
shared memory a CTA (kda_decode_step at batch 1: 4:21504).
--l2: one copy of each weight (it stays in the 50 MB L2 between calls where it fits): what the kernels take when
the bytes are not what they wait for.  --pdl: the calls of each graph launched with programmatic dependent
launch, as in a decode graph (the next call's CTAs start its weight loads while the one before drains).
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
    "router logits, split": (2304, 768),
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
    ap.add_argument("--spin-us", type=float, default=0.0)
    ap.add_argument("--only", default="", help="shapes whose name contains this text")
    ap.add_argument("--l2", action="store_true", help="one copy of each weight (L2-resident where it fits)")
    ap.add_argument("--pdl", action="store_true", help="capture the calls with programmatic dependent launch")
    args = ap.parse_args()

    import cupy

    from helpers.gpu import graph_us
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops import pdl
    from kda_rt.cuda.ops import skinny_gemm as sk
    from kda_rt.cuda.ops.check import BF16

    if args.pdl:  # every graph below captured with the programmatic-serialization attribute
        base_graph_us = graph_us

        def graph_us(fn, calls: int = 20) -> float:  # noqa: F811 (the --pdl form of the helper)
            def body(stream):
                with pdl.capturing(True):
                    fn(stream)

            return base_graph_us(body, calls=calls)

    rng = cupy.random.default_rng(0)
    for name, (K, N) in SHAPES.items():
        if args.only not in name:
            continue
        nbytes = N * K * 2
        copies = 1 if args.l2 else int(min(64, max(1, -(-(160 << 20) // nbytes))))
        reps = 64 if args.l2 else 4  # graph calls of `copies` projections each
        ws = [(rng.standard_normal((N, K), dtype=np.float32) * K**-0.5).astype(BF16) for _ in range(copies)]
        for M in (int(m) for m in args.rows.split(",")):
            x = rng.standard_normal((M, K), dtype=np.float32).astype(BF16)
            out = cupy.empty((M, N), dtype=BF16)
            row = {"shape": name, "M": M, "K": K, "N": N, "MB": round(nbytes / 1e6, 2), "copies": copies,
                   "pdl": args.pdl}
            for flag in ("1", "0"):
                os.environ["KDA_RT_SKINNY"] = flag
                os.environ["KDA_RT_SKINNY_STAGED"] = "0"  # the streaming kernel (--spin-us times the staged ones)

                def body(stream, x=x, out=out, ws=ws):
                    with stream:
                        for w in ws:
                            linear(x, w, out=out)

                us = graph_us(body, calls=reps) / copies
                key = "skinny" if flag == "1" else "cublas"
                row[f"{key}_us"] = round(us, 2)
                row[f"{key}_tb_s"] = round(nbytes / us / 1e6, 2)
            if args.spin_us:
                row.update(_spin_rows(x, out, ws, args.spin_us, linear))
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

                    row[f"split_{splits}_us"] = round(graph_us(forced, calls=reps) / copies, 2)
            if args.small_splits and M <= sk.MAX_ROWS and N <= sk.MAX_N:
                for fpc in (32, 64):
                    for splits in (1, 2, 3, 4, 6, 8):
                        if not sk._plan_fits(M, N, K, fpc, splits, 1):
                            continue

                        def small(stream, x=x, out=out, ws=ws, p=(fpc, splits, 1)):
                            for w in ws:
                                sk.skinny_gemm(x, w, out, stream=stream, plan=p)

                        row[f"cl_{fpc}x{splits}_us"] = round(graph_us(small, calls=reps) / copies, 2)
                        os.environ["KDA_RT_SKINNY"] = "0"
                        ref = linear(x, ws[0], out=cupy.empty_like(out)).astype(np.float32)
                        got = sk.skinny_gemm(x, ws[0], cupy.empty_like(out), plan=(fpc, splits, 1)).astype(np.float32)
                        row[f"cl_{fpc}x{splits}_err"] = float(cupy.abs(got - ref).max() / cupy.abs(ref).max())
            print(json.dumps(row), flush=True)
        del ws
    os.environ.pop("KDA_RT_SKINNY", None)
    return 0


_SPIN = r"""
#ifdef CLUSTER
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) spin(long long ns) {
#else
extern "C" __global__ void spin(long long ns) {
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}
"""


def _spin_rows(x, out, ws, spin_us: float, linear) -> dict:
    """Per call: (spin + projection) - spin alone, in graphs captured with programmatic dependent launch."""
    import cupy

    from helpers.gpu import graph_us
    from kda_rt.cuda.ops import pdl

    cluster, smem = (int(v) for v in os.environ.get("SPIN_SHAPE", "1:0").split(":"))
    spin = cupy.RawKernel(_SPIN, "spin", options=(f"-DCLUSTER={cluster}",) if cluster > 1 else ())
    if smem > 48 * 1024:
        spin.max_dynamic_shared_size_bytes = smem
    ns = np.int64(spin_us * 1e3)

    def spins(stream, with_gemm: bool):
        with pdl.capturing(True), stream:
            for w in ws:
                if not pdl.launch(spin, (128,), (128,), (ns,), shared_mem=smem, stream=stream):
                    raise RuntimeError("spin: PDL launch refused")
                if with_gemm:
                    linear(x, w, out=out)

    alone = graph_us(lambda st: spins(st, False), calls=4) / len(ws)
    row = {"spin_alone_us": round(alone, 2)}
    for key, skinny, staged in (("stream", "1", "0"), ("staged", "1", "1"), ("bulk", "1", "2"), ("cublas", "0", "1")):
        os.environ["KDA_RT_SKINNY"], os.environ["KDA_RT_SKINNY_STAGED"] = skinny, staged
        row[f"spin_{key}_us"] = round(graph_us(lambda st: spins(st, True), calls=4) / len(ws) - alone, 2)
    os.environ.pop("KDA_RT_SKINNY_STAGED", None)
    return row


if __name__ == "__main__":
    raise SystemExit(main())
