"""Launcher for kernels_cu/rmsnorm.cu: y = RMSNorm(x [+ residual]) * w, residual updated in place."""

from __future__ import annotations

from kda_rt.cuda.ops.check import BF16, expect, f32, i32
from kda_rt.cuda.ops.compile import get_kernel
from kda_rt.cuda.ops.quant import check_e4m3_out

__all__ = ["rmsnorm", "rmsnorm_kernel"]


def _threads(D: int) -> int:
    threads = next(t for t in (256, 128, 64, 32) if D % t == 0 and D // t <= 32) if D % 32 == 0 else None
    if threads is None:
        raise ValueError(f"rmsnorm: row width {D} must be a multiple of 32 and at most 8192")
    return threads


def rmsnorm_kernel(D: int, residual: bool, e4m3_out: bool = False):
    """The kernel for rows of D (built on first use; the runner builds the MoE's e4m3 one at start)."""
    return get_kernel("rmsnorm.cu", "rmsnorm_fwd_e4m3" if e4m3_out else "rmsnorm_fwd", D=D, THREADS=_threads(D),
                      HAS_RESIDUAL=residual, **({"E4M3_OUT": 1} if e4m3_out else {}))


def rmsnorm(x, weight, eps: float, *, residual=None, out=None, e4m3_out=None, stream=None):
    """x: [T, D] bf16, weight: [D] bf16, residual: optional [T, D] bf16 (becomes x + residual).
    Returns y [T, D] bf16.  e4m3_out: optional (q [T, D] uint8, scale [T] fp32) that also receive y's rows as e4m3
    codes with a scale a row, as ops/quant.quantize_activations_e4m3 makes them from y (rmsnorm.cu E4M3_OUT; sm_89+)."""
    import cupy

    T, D = expect(x, "x", ndim=2, dtype=BF16)
    expect(weight, "weight", shape=(D,), dtype=BF16)
    if residual is not None:
        expect(residual, "residual", shape=(T, D), dtype=BF16)
    out = cupy.empty_like(x) if out is None else out
    expect(out, "out", shape=(T, D), dtype=BF16)
    threads = _threads(D)
    codes = ()
    if e4m3_out is not None:
        check_e4m3_out(e4m3_out, T, D, "rmsnorm")
        codes = tuple(e4m3_out)
    kernel = rmsnorm_kernel(D, residual is not None, bool(codes))
    if T:
        kernel((T,), (threads,), (x, residual if residual is not None else x, weight, out, i32(T), f32(eps), *codes),
               stream=stream)
    return out
