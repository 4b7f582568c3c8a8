"""Launcher for gemv_dense (kernels_cu/moe_gemv.cu, DENSE = 1): a one-row projection y = x · Wᵀ as a GEMV whose
row pairs are spread evenly over every warp of a one-wave grid, its first weight rows loaded before the
programmatic-launch wait (2-4 rows of x in one launch too: MAX_ROWS).  gemm.linear takes it where `fits` (one row,
or up to KDA_RT_DENSE_GEMV_MAX_T; bf16 out, KDA_RT_DENSE_GEMV not 0): at batch 1 the KDA q|k|v|f_a|g_a|b and MLA
q|kv_a projections, and a dense MLP's gate|up; fp8 models' decode steps call it with e4m3 rows (cuda/model.py).
Also the GEMVs' shared launch configuration (GemvConfig, grid), which ops/moe_gemv.py uses too.

The kernel sits in moe_gemv.cu beside the MoE GEMVs, whose helpers it shares; its launcher is apart from
ops/moe_gemv.py because gemm.linear imports it and ops/moe_gemv.py imports the routing launcher, which imports
gemm (one launcher module per .cu would make that a cycle)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kda_rt import env
from kda_rt.cuda.ops.check import BF16, expect, i32, leading_dim
from kda_rt.cuda.ops.compile import arch_number, device_arch, get_kernel, sm_count

__all__ = ["DEFAULT", "MAX_BYTES", "MAX_K", "MAX_K_E4M3", "MAX_ROWS", "MIN_BYTES", "GemvConfig", "check_e4m3_arch",
           "check_weight_dtype", "fits", "fits_e4m3", "gemv_dense", "grid", "precompile", "takes_e4m3_width"]

MAX_K = 2560  # a lane holds D / 256 pieces of each of two rows (twice with PIPE): D = 2304 at the 48B shape
MAX_K_E4M3 = 2 * MAX_K  # e4m3 rows: 16 weights a piece, so as many pieces a lane (o_proj's K = 4096 at the 48B shape)
# rows of x one launch takes (moe_gemv.cu MROWS: each weight pair widened once for all of them; at K = 5120 and 4 rows
# 242 registers, no spills, NVRTC 13.5 sm_90a): decode steps of up to 4 rows (KDA_RT_FP8_DECODE_GEMV_MAX_T for the fp8
# decode GEMVs, KDA_RT_DENSE_GEMV_MAX_T for gemm.linear's bf16 ones; both 1 by default)
MAX_ROWS = 4


class GemvConfig(NamedTuple):
    """Warps per CTA, CTAs per SM (at most as many as fit: the grid is one wave) and whether each warp loads
    its next unit's rows before reducing the current one (~166 registers a thread against ~100)."""

    warps: int = 8
    blocks_per_sm: int = 1
    pipe: bool = True


# H200 (tests/gpu/bench_moe_decode.py --gemv, 2026-12-01: graph replays of bucket + gate/up at batch 1, 9 routed
# rows): tiled 28.9-29.1 us, (8, 1, pipe) 25.6-25.8, (8, 2) 26.4-26.5, (8, 1) 26.6-26.7, (4, 3) / (4, 4) /
# (12, 1) / (16, 1) 27.0-27.3
DEFAULT = GemvConfig()


def grid(kernel, cfg: GemvConfig, warps: int, routed: bool = False) -> int:
    """One wave: cfg.blocks_per_sm CTAs per SM, capped at what one SM holds at once.  The routed variant starts
    while the routing kernel's last block still runs, and a CTA of it does not fit beside that block (registers):
    one SM fewer, or the CTA left over would start when the routing kernel ends and finish that much later."""
    import cupy

    from kda_rt.cuda.ops.pdl import resident_per_sm

    sms = sm_count(cupy.cuda.Device().id)
    return max(1, sms - int(routed)) * min(cfg.blocks_per_sm, resident_per_sm(kernel, 32 * warps, 0))


MIN_BYTES = 4 << 20  # smaller weights: skinny_gemm or cuBLAS (the wait-free start matters little there)
MAX_BYTES = 256 << 20  # larger (lm_head's 755 MB): cuBLAS is at its bytes floor


def _takes(N: int, K: int) -> bool:
    """A [N, K] bf16 weight that gemv_dense serves: K the kernel can hold, 4-256 MB."""
    return 0 < K <= MAX_K and K % 8 == 0 and MIN_BYTES <= 2 * N * K <= MAX_BYTES


def fits(x, weight, out, accumulate: bool) -> bool:
    """gemv_dense can compute out = x · weightᵀ (shapes already checked by the caller: x [M, K], weight [N, K],
    out [M, N]): one row, or up to KDA_RT_DENSE_GEMV_MAX_T rows with 16-byte aligned row starts."""
    M, K = x.shape
    rows_ok = M == 1 or (M <= env.dense_gemv_max_t() and leading_dim(x) % 8 == 0)
    return (rows_ok and not accumulate and out.dtype == BF16 and env.dense_gemv() and _takes(weight.shape[0], K)
            and weight.data.ptr % 16 == 0 and x.data.ptr % 16 == 0)


def takes_e4m3_width(K: int) -> bool:
    """gemv_dense's e4m3 form holds rows of K weights: a multiple of 16 (a 16-byte piece) within MAX_K_E4M3
    (floors.e4m3_gemv_savings asks too, without a GPU)."""
    return 0 < K <= MAX_K_E4M3 and K % 16 == 0


def fits_e4m3(N: int, K: int) -> bool:
    """gemv_dense takes an [N, K] weight as e4m3 rows (WFMT = 1; the fp8 decode GEMVs, KDA_RT_FP8_DECODE_GEMV): K as
    takes_e4m3_width says, on sm_89 or newer (the model makes such rows only beside its dense e4m3 copies, on sm_90a:
    cuda/weights.py)."""
    return N > 0 and takes_e4m3_width(K) and arch_number(device_arch()) >= 89


# row pairs a warp loads before the programmatic-launch wait (KDA_RT_DENSE_GEMV_PRE).  H200, 2026-12-01, batch-1
# full-model replays (tests/gpu/bench_ab.py --env KDA_RT_DENSE_GEMV,KDA_RT_DENSE_GEMV_PRE --values 1:1,1:2,1:0,0:1
# --rounds 3 --prompts 0 --replays 1): 1 unit 2.2197 ms, 2 units 2.2400, 0 2.2324, cuBLAS 2.2694
PRE_UNITS = 1


def check_e4m3_arch(what: str) -> None:
    """e4m3 weights (moe_gemv.cu WFMT = 1) convert with cvt.rn.f16x2.e4m3x2: sm_89 or newer."""
    arch = device_arch()
    if arch_number(arch) < 89:
        raise ValueError(f"{what}: e4m3 weights need sm_89 or newer (this GPU: {arch})")


def check_weight_dtype(what: str, name: str, weight, e4m3: bool) -> None:
    """The GEMVs' weight: bf16, or uint8 e4m3 bits when a scale is given (moe_gemv.cu WFMT)."""
    if weight.dtype != (np.uint8 if e4m3 else BF16):
        want = "uint8 (e4m3 bits, with scale=)" if e4m3 else "bfloat16 (or uint8 e4m3 bits with scale=)"
        raise TypeError(f"{what}: {name} must have dtype {want}, got {weight.dtype.name}")


def _kernel(K: int, cfg: GemvConfig = DEFAULT, e4m3: bool = False, rows: int = 1):
    fmt = {"WFMT": 1} if e4m3 else {}  # e4m3 weights with a scale a row (moe_gemv.cu WFMT)
    pre = env.dense_gemv_pre(PRE_UNITS)
    if rows > 1:  # (two row buffers, DENSE_PRE = 2, spill with 2-4 x rows: one there)
        fmt["MROWS"], pre = rows, min(pre, 1)
    return get_kernel("moe_gemv.cu", "gemv_dense", DENSE=1, KW=K, WARPS=cfg.warps, DENSE_PRE=pre, **fmt)


def precompile(shapes=(), e4m3_widths=(), e4m3_rows: int = 1) -> int:
    """Build the kernel for the reduction width K of every (N, K, fp32 out) in `shapes` that `fits` could take (1 to
    KDA_RT_DENSE_GEMV_MAX_T rows of x), and the e4m3 ones for each K of `e4m3_widths` (the fp8 decode GEMVs' weights)
    and 1 to `e4m3_rows` rows of x."""
    count = 0
    for k in sorted(set(e4m3_widths)):
        for m in range(1, e4m3_rows + 1):
            _kernel(k, e4m3=True, rows=m)
            count += 1
    if not env.dense_gemv():
        return count
    widths = sorted({k for n, k, f32 in shapes if not f32 and _takes(n, k)})
    rows = env.dense_gemv_max_t()
    for k in widths:
        for m in range(1, rows + 1):
            _kernel(k, rows=m)
    return count + len(widths) * rows


def gemv_dense(x, weight, out, *, scale=None, cfg: GemvConfig = DEFAULT, stream=None):
    """x [M, K] bf16 (M 1 to MAX_ROWS, rows 16-byte aligned), weight [N, K] bf16 C-contiguous -> out [M, N] bf16
    (rows of a wider buffer are fine): out = bf16(x · weightᵀ) with fp32 sums, each row of out bit for bit what a
    launch on that row of x alone gives.
    With scale [N] fp32, weight holds e4m3 values as uint8 bits [N, K] (loader/quant.quantize_rows; K % 16 == 0,
    sm_89+): out = bf16(scale · (x · float(weight)ᵀ)), the scale applied to each row's fp32 sum."""
    shape = getattr(x, "shape", ())
    if len(shape) == 2 and not 1 <= shape[0] <= MAX_ROWS:  # (first: CuPy gives an empty x strides (0, 0))
        raise ValueError(f"gemv_dense: x must have 1 to {MAX_ROWS} rows, got shape {shape}")
    M, K = expect(x, "x", shape=(None, None), dtype=BF16, row_stride=True)
    e4m3 = scale is not None
    N, _ = expect(weight, "weight", shape=(None, K))
    check_weight_dtype("gemv_dense", "weight", weight, e4m3)
    expect(out, "out", shape=(M, N), dtype=BF16, row_stride=True)
    if M > 1 and leading_dim(x) % 8:
        raise ValueError(f"gemv_dense: x's rows must be 16-byte aligned (row stride {leading_dim(x)} elements)")
    piece, max_k = (16, MAX_K_E4M3) if e4m3 else (8, MAX_K)  # weights a 16-byte piece; a lane's pieces
    if K <= 0 or K % piece or K > max_k or weight.data.ptr % 16 or x.data.ptr % 16:
        raise ValueError(f"gemv_dense: needs 0 < K <= {max_k}, K % {piece} == 0 (got {K}; {piece} "
                         f"{'e4m3' if e4m3 else 'bf16'} weights a 16-byte piece) and x and weight 16-byte aligned")
    if e4m3:
        expect(scale, "scale", shape=(N,), dtype=np.float32)
        check_e4m3_arch("gemv_dense")
    if N == 0:
        return out
    kernel = _kernel(K, cfg, e4m3, M)
    strides = (i32(leading_dim(x)), i32(leading_dim(out))) if M > 1 else (i32(0), i32(0))  # (one row: unused)
    kernel((grid(kernel, cfg, cfg.warps),), (32 * cfg.warps,),
           (x, weight, i32(N), out, scale if e4m3 else np.uint64(0), *strides), stream=stream)
    return out
