"""Launcher for kernels_cu/silu_mul.cu: out = bf16(bf16(SiLU(gate)) · up) on a fused [gate | up] row."""

from __future__ import annotations

from kda_rt.cuda.ops.check import BF16, expect, i32
from kda_rt.cuda.ops.compile import get_kernel

__all__ = ["silu_mul"]

_THREADS = 128


def silu_mul(gu, *, out=None, stream=None):
    """gu: [T, 2I] bf16 (gate columns first, then up) -> out [T, I] bf16."""
    import cupy

    T, two_i = expect(gu, "gu", ndim=2, dtype=BF16)
    inter = two_i // 2
    if two_i % 16:
        raise ValueError(f"silu_mul: gu width {two_i} must be 2·I with I a multiple of 8")
    out = cupy.empty((T, inter), dtype=BF16) if out is None else out
    expect(out, "out", shape=(T, inter), dtype=BF16)
    kernel = get_kernel("silu_mul.cu", "silu_mul_fwd", I=inter, THREADS=_THREADS)
    if T:
        kernel((T, -(-inter // (8 * _THREADS))), (_THREADS,), (gu, out, i32(T)), stream=stream)
    return out
