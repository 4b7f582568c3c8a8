"""Launcher for kernels_cu/skinny_gemm.cu: y = x · Wᵀ for up to MAX_ROWS rows and MAX_N outputs (the
narrow decode projections: o_proj, f_a|g_a|b, the dense MLP's down), bf16 in, fp32 accumulate, bf16 or
fp32 out, one CTA per 16 output features with the reduction split over its 8 warps.  `fits` says
whether a call qualifies; `gemm.linear` takes this path for those and cuBLAS for the rest
(KDA_RT_SKINNY=0 sends everything to cuBLAS).  The limits are measured (tests/gpu/bench_skinny.py, H200):
wider outputs stream as fast through cuBLAS, and 16 rows ran slower here.

Letters: M rows (tokens), K reduction width, N output features."""

from __future__ import annotations

import numpy as np

from kda_rt.cuda.ops.check import BF16, i32, leading_dim
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["MAX_N", "MAX_ROWS", "fits", "precompile", "skinny_gemm"]

MAX_ROWS = 8  # rows of one call (one n-tile of 8 tokens)
MAX_N = 4096  # output features
_WARPS = 8
_UNROLL = 8  # 32-wide k chunks of loads in flight per warp (106 registers: two CTAs per SM)


def fits(x, weight, out, accumulate: bool) -> bool:
    """This kernel can compute out = x · weightᵀ (shapes already checked by the caller)."""
    M, K = x.shape
    N = weight.shape[0]
    return (not accumulate and 1 <= M <= MAX_ROWS and N <= MAX_N and N % 16 == 0 and K % (32 * _WARPS) == 0
            and weight.flags.c_contiguous and weight.data.ptr % 16 == 0 and x.data.ptr % 16 == 0
            and leading_dim(x) % 8 == 0 and out.dtype in (BF16, np.dtype(np.float32)))


def _kernel(out_f32: bool):
    return get_kernel("skinny_gemm.cu", "skinny_gemm", OUT_F32=int(out_f32), UNROLL=_UNROLL, WARPS=_WARPS)


def precompile() -> int:
    """Build every variant a decode step can pick (so no step waits for NVRTC); returns their number."""
    for out_f32 in (False, True):
        _kernel(out_f32)
    return 2


def skinny_gemm(x, weight, out, *, stream=None):
    """out [M, N] (bf16 or fp32, rows may be strided) = x [M, K] bf16 (rows may be strided) · weight [N, K]ᵀ;
    the caller checked shapes and `fits`."""
    M, K = x.shape
    N = weight.shape[0]
    kernel = _kernel(out.dtype == np.float32)
    kernel((N // 16,), (32 * _WARPS,), (x, i32(leading_dim(x)), weight, out, i32(leading_dim(out)), i32(M), i32(K)),
           stream=stream)
    return out
