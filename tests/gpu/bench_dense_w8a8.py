"""Dense prefill projections of the Kimi-Linear-48B shape in FP8: cuBLAS bf16 (`kda_rt.cuda.gemm.linear`, what the
model runs without the e4m3 copies) against `ops/dense_w8a8.dense_w8a8` (the e4m3 x e4m3 wgmma GEMM, WFMT = 2, as a
one-expert grouped GEMM over an identity plan), on codes made before (as the norm hands them over) and with its
source's quantization (`quantize_activations_e4m3`).  Random codes and scales: the times do not depend on the values.

    PYTHONPATH=. python tests/gpu/bench_dense_w8a8.py [--tokens 16384,8192] [--rounds 5]

Shapes (name: K -> NOUT): the KDA layer's q|k|v (2304 -> 12288) and o_proj (4096 -> 2304, also MLA's), MLA's
q|kv_a (2304 -> 6720, padded to 6912 for the e4m3 tile), the dense layer's gate|up with SiLU (2304 -> 2 x 9216) and
down (9216 -> 2304).  CUDA events, medians over interleaved rounds; TFLOP/s of the unpadded work."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (helpers)

SHAPES = {  # name: (K, NOUT, padded NOUT for the e4m3 tile, SiLU fused)
    "kda q|k|v": (2304, 12288, 12288, False),
    "o_proj": (4096, 2304, 2304, False),
    "mla q|kv_a": (2304, 6720, 6912, False),
    "mlp gate|up": (2304, 18432, 18432, True),
    "mlp down": (9216, 2304, 2304, False),
}


def main() -> int:
    import cupy

    from helpers.gpu import median_ms
    from helpers.moe_gemm import e4m3_stack
    from kda_rt.cuda.gemm import linear
    from kda_rt.cuda.ops.check import BF16
    from kda_rt.cuda.ops.dense_w8a8 import E4m3Dense, dense_w8a8
    from kda_rt.cuda.ops.quant import quantize_activations_e4m3

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="16384,8192")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    crng, hrng = cupy.random.default_rng(1), np.random.default_rng(2)
    for T in map(int, args.tokens.split(",")):
        total = {"bf16": 0.0, "w8a8": 0.0, "w8a8+quant": 0.0}
        for name, (K, nout, padded, silu) in SHAPES.items():
            x = (crng.standard_normal((T, K), dtype=np.float32)).astype(BF16)
            w = (crng.standard_normal((nout, K), dtype=np.float32) * K**-0.5).astype(BF16)
            wq, ws = e4m3_stack(crng, hrng, 1, padded, K)  # (random codes: the timing does not depend on them)
            w8 = E4m3Dense(wq, ws, nout, silu)
            xq, xs = cupy.empty((T, K), dtype=np.uint8), cupy.empty(T, dtype=np.float32)
            quantize_activations_e4m3(x, out=xq, scale_out=xs)
            out_bf16 = cupy.empty((T, nout), dtype=BF16)
            out_q = cupy.empty((T, padded // 2 if silu else padded), dtype=BF16)

            def w8a8(quant: bool, x=x, xq=xq, xs=xs, w8=w8, out_q=out_q):
                dense_w8a8(x, w8, out=out_q, codes=(xq, xs), quantized=not quant)

            runs = {"bf16": partial(linear, x, w, out=out_bf16), "w8a8": partial(w8a8, False),
                    "w8a8+quant": partial(w8a8, True)}
            times = {k: [] for k in runs}
            for _ in range(args.rounds):
                for k, fn in runs.items():
                    times[k].append(median_ms(fn))
            flop = 2.0 * T * K * nout
            med = {k: float(np.median(v)) for k, v in times.items()}
            for k in total:
                total[k] += med[k]
            print(f"T={T} {name} ({K} -> {nout}{' SiLU' if silu else ''}): " + "  ".join(
                f"{k} {m:.3f} ms {flop / m / 1e9:.0f} TFLOP/s ({m / med['bf16'] - 1:+.1%})" for k, m in med.items()),
                flush=True)
            del x, w, wq, ws, w8, xq, xs, out_bf16, out_q
            cupy.get_default_memory_pool().free_all_blocks()
        print(f"T={T} all five: " + "  ".join(f"{k} {v:.3f} ms" for k, v in total.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
