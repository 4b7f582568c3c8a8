"""gemv_dense (kernels_cu/moe_gemv.cu DENSE) with bf16 weights against e4m3 weights with a scale a row (WFMT = 1,
loader/quant.py), one row x at the 48B shape's one-row projections.  Each timing is a CUDA graph of calls cycling
over enough copies of the weight (>= 160 MB in all) that every call streams its weight from HBM, as in a decode
step; time per call and TB/s of the bytes each call reads (weights, and the e4m3 kernel's scales).

    PYTHONPATH=. python tests/gpu/bench_gemv_e4m3.py [--configs 8x1,8x2,4x4]
One JSON line per shape.  --configs: also time the e4m3 kernel at these launch configurations (warps x CTAs an SM,
ops/gemv.GemvConfig; the default is 8x1): "e4m3_<c>_us" / "_tb_s" per configuration.  More CTAs an SM put more
bytes in flight at the same conversion work a byte, which tells a memory-parallelism limit from an issue limit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

SHAPES = {  # name: (N, K)
    "kda q|k|v|f_a|g_a|b": (12576, 2304),
    "mla q|kv_a": (6720, 2304),
    "dense gate|up (the 9 experts' gate|up rows of a token have the same shape)": (18432, 2304),
}


def main() -> int:
    import argparse

    import cupy

    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="", help="e.g. 8x1,8x2,4x4 (warps x CTAs an SM) for the e4m3 kernel")
    args = ap.parse_args()

    from helpers.gpu import graph_us
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.gemv import DEFAULT, gemv_dense

    configs = []
    for c in filter(None, args.configs.split(",")):
        warps, _, per_sm = c.partition("x")
        configs.append((c, DEFAULT._replace(warps=int(warps), blocks_per_sm=int(per_sm or 1))))

    rng = cupy.random.default_rng(0)
    for name, (N, K) in SHAPES.items():
        x = rng.standard_normal((1, K), dtype=np.float32).astype(BF16)
        out = cupy.empty((1, N), dtype=BF16)
        row = {"shape": name, "N": N, "K": K}
        for fmt, nbytes in (("bf16", 2 * N * K), ("e4m3", N * K + 4 * N)):
            copies = int(min(64, max(2, -(-(160 << 20) // nbytes))))
            if fmt == "bf16":
                ws = [((rng.standard_normal((N, K), dtype=np.float32) * K**-0.5).astype(BF16), None)
                      for _ in range(copies)]
            else:  # random bytes that are finite e4m3 values (0x7f / 0xff are the NaNs: cleared to 0x7e / 0xfe)
                ws = []
                for _ in range(copies):
                    q = cupy.random.randint(0, 256, size=(N, K)).astype(np.uint8)
                    q[(q & 0x7F) == 0x7F] &= 0xFE
                    ws.append((q, ((cupy.random.random_sample(N) + 0.5) * 2**-10).astype(np.float32)))

            def body(stream, ws=ws, x=x, out=out, cfg=DEFAULT):
                with stream:
                    for w, scale in ws:
                        gemv_dense(x, w, out, scale=scale, cfg=cfg)

            us = graph_us(body, calls=4) / copies
            assert np.isfinite(cupy.asnumpy(out.astype(np.float32))).all(), f"{name} {fmt}: non-finite outputs"
            row.update({f"{fmt}_MB": round(nbytes / 1e6, 2), f"{fmt}_us": round(us, 2),
                        f"{fmt}_tb_s": round(nbytes / us / 1e6, 2)})
            for label, cfg in configs if fmt == "e4m3" else ():
                us = graph_us(lambda stream, cfg=cfg, body=body: body(stream, cfg=cfg), calls=4) / copies
                row.update({f"e4m3_{label}_us": round(us, 2), f"e4m3_{label}_tb_s": round(nbytes / us / 1e6, 2)})
            del ws
        row["speedup"] = round(row["bf16_us"] / row["e4m3_us"], 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
