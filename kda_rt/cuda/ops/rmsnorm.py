"""Launcher for kernels_cu/rmsnorm.cu: y = RMSNorm(x [+ residual]) * w, residual updated in place."""

from __future__ import annotations

from kda_rt.cuda.ops.check import BF16, expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["rmsnorm"]


def rmsnorm(x, weight, eps: float, *, residual=None, out=None, stream=None):
    """x: [T, D] bf16, weight: [D] bf16, residual: optional [T, D] bf16 (becomes x + residual).
    Returns y [T, D] bf16."""
    import cupy

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    expect(weight, "weight", shape=(D,), dtype=BF16)
    if residual is not None:
        expect(residual, "residual", shape=(T, D), dtype=BF16)
    out = cupy.empty_like(x) if out is None else out
    expect(out, "out", shape=(T, D), dtype=BF16)
    threads = next(t for t in (256, 128, 64, 32) if D % t == 0 and D // t <= 32) if D % 32 == 0 else None
    if threads is None:
        raise ValueError(f"rmsnorm: row width {D} must be a multiple of 32 and at most 8192")
    kernel = get_kernel("rmsnorm.cu", "rmsnorm_fwd", D=D, THREADS=threads, HAS_RESIDUAL=residual is not None)
    if T:
        kernel((T,), (threads,), (x, residual if residual is not None else x, weight, out, i32(T), f32(eps)),
               stream=stream)
    return out
